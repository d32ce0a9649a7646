"""The state of a host block manager and its read side: lookups, load pins, miss reasons and statistics.

:class:`ManagerState` holds what :class:`~kvoffload.offload.manager.HostBlockManager` knows about each key
(its chunk, its vLLM-style ``ref_cnt``, why it left) and answers questions about it; the manager adds the
write side (stores, drops, resets). A key's chunk is *pending* while its write is in flight (``ref_cnt ==
-1``), *ready* once the store completed (``0``) and *pinned* while loads read it (``> 0``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload._generated import MissReason
from kvoffload._ints import check_int
from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager._results import LookupResult, ManagerStats, OffloadEvent
from kvoffload.offload.manager.policies import CachePolicy, make_policy

__all__ = ["ManagerState"]

_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING


class ManagerState:
    """The key -> chunk state of a host block manager, its lookups and load pins (see :class:`HostBlockManager`).

    Not used on its own: :class:`~kvoffload.offload.manager.HostBlockManager` builds on it.
    """

    __slots__ = (
        "_alloc_sizes",
        "_cid",
        "_counts",
        "_dead",
        "_departed",
        "_dropped_total",
        "_events",
        "_evictable",
        "_evicted_total",
        "_free",
        "_hits",
        "_load_pins",
        "_max_departures",
        "_max_tracker_size",
        "_misses",
        "_next_fresh",
        "_num_chunks",
        "_policy",
        "_policy_name",
        "_ref",
        "_store_misses",
        "_store_threshold",
        "_stored_total",
        "_stores_skipped",
        "_write_pending",
    )

    def __init__(
        self,
        num_chunks: int,
        policy: str = "lru",
        *,
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        max_departures: int = 65_536,
    ) -> None:
        """Create an empty manager; invalid arguments raise :class:`ConfigError` naming field and value.

        ``max_departures`` bounds the memory of why keys left the pool (see :meth:`miss_reason`).
        """
        self._num_chunks = check_int("num_chunks", num_chunks, 0)
        self._store_threshold = check_int("store_threshold", store_threshold, 0)
        self._max_tracker_size = check_int("max_tracker_size", max_tracker_size, 1)
        if not isinstance(enable_events, bool):
            raise ConfigError(f"enable_events must be a bool, got {enable_events!r}")
        if not isinstance(policy, str):
            raise ConfigError(f"policy must be a str, got {policy!r}")
        self._policy: CachePolicy = make_policy(policy, num_chunks)
        self._policy_name = policy
        # key -> vLLM ref_cnt: -1 pending write, 0 ready, n > 0 pinned by n loads. Presence == resident.
        self._ref: dict[OffloadKey, int] = {}
        self._cid: dict[OffloadKey, int] = {}  # key -> chunk id (mirrors the policy, for fast loads)
        self._next_fresh = 0  # vLLM _num_allocated_chunks: ids below it have been handed out once
        self._free: list[int] = []  # LIFO stack of freed chunk ids
        self._evictable = 0  # resident chunks with ref_cnt == 0
        self._write_pending = 0  # resident chunks with ref_cnt == -1
        self._events: list[OffloadEvent] | None = [] if enable_events else None
        self._counts: OrderedDict[OffloadKey, int] | None = OrderedDict() if store_threshold >= 2 else None
        self._store_misses: dict[str, set[OffloadKey]] = {}  # request id -> keys already reported
        self._alloc_sizes: list[int] = []
        self._stores_skipped = 0
        self._hits = 0
        self._misses = 0
        self._stored_total = 0
        self._evicted_total = 0
        self._load_pins = 0
        self._dead: set[OffloadKey] = set()  # pinned keys dropped as corrupt: freed at their last unpin
        self._dropped_total = 0
        # Observability: why a key left (bounded, oldest forgotten first), so a later miss can say so.
        self._max_departures = check_int("max_departures", max_departures, 1)
        self._departed: OrderedDict[OffloadKey, MissReason] = OrderedDict()

    # ------------------------------------------------------------------ introspection

    @property
    def num_chunks(self) -> int:
        """Return the pool size in chunks."""
        return self._num_chunks

    @property
    def policy(self) -> CachePolicy:
        """Return the cache policy instance (for inspection; do not mutate it directly)."""
        return self._policy

    @property
    def policy_name(self) -> str:
        """Return the registry name of the cache policy."""
        return self._policy_name

    @property
    def num_free_chunks(self) -> int:
        """Return the number of chunks not holding any key (never used plus freed)."""
        return len(self._free) + self._num_chunks - self._next_fresh

    @property
    def num_evictable_chunks(self) -> int:
        """Return the number of ready, unpinned chunks (eviction candidates before protection)."""
        return self._evictable

    @property
    def store_counts(self) -> dict[OffloadKey, int]:
        """Return a copy of the store-threshold tracker (offer counts, oldest first); empty when disabled."""
        return dict(self._counts) if self._counts is not None else {}

    def __len__(self) -> int:
        """Return the number of resident keys (pending, ready or pinned)."""
        return len(self._ref)

    def __contains__(self, key: object) -> bool:
        """Tell whether ``key`` is resident in any state."""
        return key in self._ref

    def chunk_id(self, key: OffloadKey) -> int | None:
        """Return the chunk id holding ``key``, or ``None`` if it is not resident."""
        return self._cid.get(key)

    def is_ready(self, key: OffloadKey) -> bool:
        """Tell whether ``key`` is stored and readable (ready or pinned), without counting a lookup."""
        ref = self._ref.get(key)
        return ref is not None and ref >= 0 and key not in self._dead

    def has_pending_work(self) -> bool:
        """Tell whether any store is in flight or any load pin is held.

        vLLM's CPU manager always answers False (its connector tracks transfers); here the answer lets a
        caller check that every ``prepare_*`` was matched by its ``complete_*`` before shutting down.
        """
        return self._next_fresh - len(self._free) - self._evictable > 0

    # ------------------------------------------------------------------ lookups and loads

    def lookup(self, key: OffloadKey) -> LookupResult:
        """Return whether ``key`` is stored (HIT), being written (HIT_PENDING) or absent (MISS).

        Read-only apart from statistics: recency is only changed by :meth:`touch`, and offers, not
        lookups, count towards ``store_threshold`` (as in vLLM 0.33.0).
        """
        ref = self._ref.get(key)
        if ref is None or (self._dead and key in self._dead):
            self._misses += 1
            return _MISS
        self._hits += 1
        return _HIT if ref >= 0 else _HIT_PENDING

    def prepare_load(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Pin ``keys`` for reading and return their chunk ids in key order.

        Every key must be stored and ready, else :class:`InvalidStateError` names it and nothing stays
        pinned. A key may be pinned several times; each pin needs one :meth:`complete_load`.
        """
        ref = self._ref
        first_pins: list[OffloadKey] = []
        for i, key in enumerate(keys):
            count = ref.get(key)
            if count is None or count < 0 or key in self._dead:
                for done in keys[:i]:
                    ref[done] -= 1
                state = "not stored" if count is None or count > 0 else "not ready (its store is in flight)"
                raise InvalidStateError(f"cannot load key {key!r}: {state}")
            if count == 0:
                first_pins.append(key)
            ref[key] = count + 1
        if first_pins:
            self._evictable -= len(first_pins)
            self._policy.mark_non_evictable_many(first_pins)
        self._load_pins += len(keys)
        cid = self._cid
        return [cid[key] for key in keys]

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Release one pin per key taken by :meth:`prepare_load`; a chunk becomes evictable at zero pins.

        A key that is not pinned raises :class:`InvalidStateError` naming it, and no pin is released.
        """
        ref = self._ref
        released: list[OffloadKey] = []
        for i, key in enumerate(keys):
            count = ref.get(key)
            if count is None or count <= 0:
                for done in keys[:i]:
                    ref[done] += 1
                state = "not stored" if count is None else "not pinned by a load"
                raise InvalidStateError(f"cannot complete load of key {key!r}: {state}")
            count -= 1
            ref[key] = count
            if count == 0:
                released.append(key)
        if released and self._dead:
            dead = [key for key in released if key in self._dead]
            if dead:
                released = [key for key in released if key not in self._dead]
                self._dead.difference_update(dead)
                for key in dead:
                    self._free_key(key)
        if released:
            self._evictable += len(released)
            self._policy.mark_evictable_many(released)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record an access to resident ``keys`` for the policy; ``keys[0]`` ends most recent."""
        self._policy.touch(keys)

    def _free_key(self, key: OffloadKey) -> None:
        """Forget a resident key and free its chunk (no event, no counters)."""
        del self._ref[key]
        self._policy.remove(key)
        self._free.append(self._cid.pop(key))

    # ------------------------------------------------------------------ miss explanations (observability)

    def _remember(self, keys: Sequence[OffloadKey], reason: MissReason) -> None:
        """Record why ``keys`` left the pool (or are unavailable), forgetting the oldest beyond the bound."""
        departed = self._departed
        for key in keys:
            departed[key] = reason
            departed.move_to_end(key)
        while len(departed) > self._max_departures:
            departed.popitem(last=False)

    def miss_reason(self, key: OffloadKey) -> MissReason | None:
        """Why ``key`` is not loadable now, or ``None`` when it is stored and ready (no statistics change).

        A pending write answers STORE_PENDING; a dropped key (absent, or dead until its last unpin) answers the
        remembered reason it left (evicted, store failed, corrupt, or whatever :meth:`remove` was told); else
        BELOW_STORE_THRESHOLD when it was offered fewer than ``store_threshold`` times, else NEVER_STORED. The
        memory is bounded by ``max_departures`` (oldest forgotten first) and survives :meth:`reset`.
        """
        ref = self._ref.get(key)
        if ref is not None:
            if ref < 0:
                return MissReason.STORE_PENDING
            if key not in self._dead:
                return None
        reason = self._departed.get(key)
        if reason is not None:
            return reason
        if ref is not None:
            return MissReason.CORRUPT  # dead, its reason forgotten: only corrupt chunks turn dead on their own
        counts = self._counts
        if counts is not None and 0 < counts.get(key, 0) < self._store_threshold:
            return MissReason.BELOW_STORE_THRESHOLD
        return MissReason.NEVER_STORED

    @property
    def usage(self) -> float:
        """Share of chunks that cannot be evicted (pending or pinned): vLLM's ``cpu_cache_usage_perc``."""
        num_chunks = self._num_chunks
        if num_chunks <= 0:
            return 0.0
        return (self._next_fresh - len(self._free) - self._evictable) / num_chunks

    def stats(self) -> ManagerStats:
        """Return usage gauges and counters; allocation sizes and skipped stores restart from zero."""
        num_chunks = self._num_chunks
        usage = self.usage
        write_usage = self._write_pending / num_chunks if num_chunks > 0 else 0.0
        sizes = tuple(self._alloc_sizes)
        self._alloc_sizes.clear()
        skipped = self._stores_skipped
        self._stores_skipped = 0
        return ManagerStats(
            num_chunks=num_chunks,
            usage=usage,
            write_usage=write_usage,
            read_usage=max(usage - write_usage, 0.0),
            allocation_sizes=sizes,
            stores_skipped=skipped,
            lookups=self._hits + self._misses,
            hits=self._hits,
            misses=self._misses,
            stored=self._stored_total,
            evicted=self._evicted_total,
            load_pins=self._load_pins,
            dropped=self._dropped_total,
        )
