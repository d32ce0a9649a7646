"""Scheduler-side bookkeeping of the host pool: which chunk holds which key, in which state.

:class:`HostBlockManager` reproduces vLLM 0.33's ``CPUOffloadingManager`` (reference doc §4.4): chunk ids,
evicted keys, lookup results and event order are identical for the same call sequence (without vLLM's
per-request position hints). A key's chunk is *pending* while its write is in flight (vLLM
``ref_cnt == -1``), *ready* once the store completed (``0``) and *pinned* while loads read it (``> 0``).
Only ready, unpinned chunks are evicted, never a key of the current offer, and never partially.

The manager is not thread-safe; callers serialize access (vLLM's callers hold the manager lock).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Collection, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from kvoffload._generated import Medium, MissReason
from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.policy import CachePolicy, make_policy

__all__ = [
    "HostBlockManager",
    "LookupResult",
    "ManagerStats",
    "OffloadEvent",
    "StorePlan",
]


class LookupResult(enum.Enum):
    """Where a key stands in the host pool, as answered by :meth:`HostBlockManager.lookup`."""

    MISS = "miss"
    """Not in the pool."""
    HIT = "hit"
    """Stored and readable now."""
    HIT_PENDING = "hit_pending"
    """Allocated but its write is still in flight: ask again later instead of recomputing."""


_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING


@dataclass(frozen=True, slots=True)
class StorePlan:
    """What :meth:`HostBlockManager.prepare_store` decided: copy ``keys_to_store[i]`` into ``chunk_ids[i]``.

    ``evicted_keys`` were dropped from the pool to make room (their chunks may be among ``chunk_ids``).
    Keys of the offer that are not listed are already stored, in flight, or below the store threshold.
    """

    keys_to_store: list[bytes]
    chunk_ids: list[int]
    evicted_keys: list[bytes]


@dataclass(frozen=True, slots=True)
class OffloadEvent:
    """A change of the pool's contents, for KV-cache event publishers (vLLM ``OffloadingEvent``).

    ``removed`` is False for keys whose store completed and True for evictions; ``metadata_only``
    removals undo a failed store that was never announced as stored, so publishers emit nothing for them.
    """

    keys: tuple[bytes, ...]
    removed: bool
    medium: Medium = Medium.CPU
    metadata_only: bool = False


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """A snapshot of pool usage and activity, as returned by :meth:`HostBlockManager.stats`.

    ``usage`` counts chunks that cannot be evicted (pending or pinned) over ``num_chunks``, like vLLM's
    ``cpu_cache_usage_perc``; ``write_usage`` is the pending share and ``read_usage`` the rest.
    ``allocation_sizes`` and ``stores_skipped`` cover the time since the previous ``stats()`` call; the
    other counters are totals since construction (``reset`` keeps them): ``hits`` includes HIT_PENDING
    answers, ``stored`` counts completed stores, ``evicted`` evicted keys, ``load_pins`` keys pinned by
    ``prepare_load``.
    """

    num_chunks: int
    usage: float
    write_usage: float
    read_usage: float
    allocation_sizes: tuple[int, ...]
    stores_skipped: int
    lookups: int
    hits: int
    misses: int
    stored: int
    evicted: int
    load_pins: int
    dropped: int = 0
    """Keys dropped because their chunk was found corrupt (:meth:`HostBlockManager.drop`), since construction."""


def _check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int (not bool) >= ``minimum``, else raise ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class HostBlockManager:
    """Allocates host-pool chunks to offload keys and tracks their write/read state (vLLM 0.33 semantics).

    ``num_chunks`` is the pool size; ``policy`` names a registered cache policy ("lru", "arc");
    ``enable_events`` collects :class:`OffloadEvent` for :meth:`take_events`; ``store_threshold >= 2``
    only stores keys offered at least that many times (counted per ``prepare_store`` offer in an LRU
    tracker of ``max_tracker_size`` keys, as vLLM 0.33.0 does); 0 and 1 store on first offer.

    Chunk ids come fresh in increasing order until the pool has been used once, then from a LIFO free
    list. ``prepare_store`` returns ``None`` when room cannot be made; it never evicts a key of its own
    offer nor a pending or pinned chunk.
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
        self._num_chunks = _check_int("num_chunks", num_chunks, 0)
        self._store_threshold = _check_int("store_threshold", store_threshold, 0)
        self._max_tracker_size = _check_int("max_tracker_size", max_tracker_size, 1)
        if not isinstance(enable_events, bool):
            raise ConfigError(f"enable_events must be a bool, got {enable_events!r}")
        if not isinstance(policy, str):
            raise ConfigError(f"policy must be a str, got {policy!r}")
        self._policy: CachePolicy = make_policy(policy, num_chunks)
        self._policy_name = policy
        # key -> vLLM ref_cnt: -1 pending write, 0 ready, n > 0 pinned by n loads. Presence == resident.
        self._ref: dict[bytes, int] = {}
        self._cid: dict[bytes, int] = {}  # key -> chunk id (mirrors the policy, for fast loads)
        self._next_fresh = 0  # vLLM _num_allocated_chunks: ids below it have been handed out once
        self._free: list[int] = []  # LIFO stack of freed chunk ids
        self._evictable = 0  # resident chunks with ref_cnt == 0
        self._write_pending = 0  # resident chunks with ref_cnt == -1
        self._events: list[OffloadEvent] | None = [] if enable_events else None
        self._counts: OrderedDict[bytes, int] | None = OrderedDict() if store_threshold >= 2 else None
        self._store_misses: dict[str, set[bytes]] = {}  # request id -> keys already reported
        self._alloc_sizes: list[int] = []
        self._stores_skipped = 0
        self._hits = 0
        self._misses = 0
        self._stored_total = 0
        self._evicted_total = 0
        self._load_pins = 0
        self._dead: set[bytes] = set()  # pinned keys dropped as corrupt: freed at their last unpin
        self._dropped_total = 0
        # Observability: why a key left (bounded, oldest forgotten first), so a later miss can say so.
        self._max_departures = _check_int("max_departures", max_departures, 1)
        self._departed: OrderedDict[bytes, MissReason] = OrderedDict()

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
    def store_counts(self) -> dict[bytes, int]:
        """Return a copy of the store-threshold tracker (offer counts, oldest first); empty when disabled."""
        return dict(self._counts) if self._counts is not None else {}

    def __len__(self) -> int:
        """Return the number of resident keys (pending, ready or pinned)."""
        return len(self._ref)

    def __contains__(self, key: object) -> bool:
        """Tell whether ``key`` is resident in any state."""
        return key in self._ref

    def chunk_id(self, key: bytes) -> int | None:
        """Return the chunk id holding ``key``, or ``None`` if it is not resident."""
        return self._cid.get(key)

    def is_ready(self, key: bytes) -> bool:
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

    def lookup(self, key: bytes) -> LookupResult:
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

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pin ``keys`` for reading and return their chunk ids in key order.

        Every key must be stored and ready, else :class:`InvalidStateError` names it and nothing stays
        pinned. A key may be pinned several times; each pin needs one :meth:`complete_load`.
        """
        ref = self._ref
        first_pins: list[bytes] = []
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

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Release one pin per key taken by :meth:`prepare_load`; a chunk becomes evictable at zero pins.

        A key that is not pinned raises :class:`InvalidStateError` naming it, and no pin is released.
        """
        ref = self._ref
        released: list[bytes] = []
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

    def touch(self, keys: Sequence[bytes]) -> None:
        """Record an access to resident ``keys`` for the policy; ``keys[0]`` ends most recent."""
        self._policy.touch(keys)

    # ------------------------------------------------------------------ stores

    def _record_offer(self, keys: Sequence[bytes], counts: OrderedDict[bytes, int]) -> None:
        """Count one offer of each key in the store-threshold tracker without dropping offered keys.

        Known keys move to the recent end; a new key evicts the oldest tracked key that is not part of
        this offer, or is not tracked when only offered keys remain (vLLM 0.33.0 ``_record_accesses``).
        """
        protected: set[bytes] = set()
        move = counts.move_to_end
        for key in keys:
            count = counts.get(key)
            if count is not None:
                move(key)
                counts[key] = count + 1
                protected.add(key)
        unprotected = len(counts) - len(protected)
        limit = self._max_tracker_size
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= limit:
                if unprotected <= 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    def prepare_store(self, keys: Sequence[bytes], *, request_id: str | None = None) -> StorePlan | None:
        """Allocate chunks for the offered keys that are not resident, evicting if needed.

        Returns a :class:`StorePlan` (possibly empty) or ``None`` when not enough ready, unpinned chunks
        outside this offer can be evicted; ``None`` changes no chunk. Resident keys of the offer are left
        as they are and protected from eviction. ``request_id`` lets the policy observe each store miss
        once per request across retries, as vLLM does per request context (the memory is dropped by
        ``on_request_finished(..., request_id=...)`` or :meth:`reset`); without it every call counts as
        its own request. Follow with :meth:`complete_store` for ``keys_to_store``.
        """
        counts = self._counts
        if counts is not None:
            self._record_offer(keys, counts)
        ref = self._ref
        to_store = [key for key in keys if key not in ref]
        if counts is not None and to_store:
            candidates = len(to_store)
            threshold = self._store_threshold
            get = counts.get
            to_store = [key for key in to_store if get(key, 0) >= threshold]
            self._stores_skipped += candidates - len(to_store)
        if not to_store:
            return StorePlan([], [], [])
        n = len(to_store)
        if n > 1 and len(set(to_store)) != n:
            to_store = list(dict.fromkeys(to_store))
            n = len(to_store)

        policy = self._policy
        if request_id is None:
            policy.on_store_miss(to_store)
        else:
            seen = self._store_misses.get(request_id)
            if seen is None:
                seen = self._store_misses[request_id] = set()
            new_misses = [key for key in to_store if key not in seen]
            if new_misses:
                policy.on_store_miss(new_misses)
                seen.update(new_misses)

        self._alloc_sizes.append(n)
        free = self._free
        num_chunks = self._num_chunks
        need = n - (len(free) + num_chunks - self._next_fresh)
        evicted_keys: list[bytes] = []
        if need > 0:
            if need > self._evictable:
                return None
            evicted = policy.evict(need, set(keys))
            if evicted is None:
                return None
            cid = self._cid
            for key, chunk_id in evicted:
                del ref[key]
                del cid[key]
                free.append(chunk_id)
                evicted_keys.append(key)
            self._remember(evicted_keys, MissReason.EVICTED)
            self._evictable -= len(evicted)
            self._evicted_total += len(evicted)
            if self._events is not None:
                self._events.append(OffloadEvent(tuple(evicted_keys), True))

        fresh = min(n, num_chunks - self._next_fresh)
        start = self._next_fresh
        chunk_ids = list(range(start, start + fresh))
        self._next_fresh = start + fresh
        if fresh < n:
            reused = free[fresh - n :]
            del free[fresh - n :]
            reused.reverse()
            chunk_ids += reused

        ref.update(dict.fromkeys(to_store, -1))
        self._cid.update(zip(to_store, chunk_ids, strict=True))
        policy.insert_many(to_store, chunk_ids)
        self._write_pending += n
        return StorePlan(to_store, chunk_ids, evicted_keys)

    def complete_store(self, keys: Collection[bytes], success: bool = True) -> None:
        """Finish the writes of ``keys``: on success they turn ready (HIT), on failure their chunks are freed.

        Only keys whose write is pending are affected; ready, pinned or absent keys are ignored. A success
        emits one stored event; a failure emits one ``metadata_only`` removal (vLLM 0.33.0 emits removals
        before stored events, and one call never has both).
        """
        ref = self._ref
        policy = self._policy
        changed: list[bytes] = []
        if success:
            for key in keys:
                if ref.get(key) == -1:
                    ref[key] = 0
                    changed.append(key)
            if changed:
                policy.mark_evictable_many(changed)
                self._evictable += len(changed)
                self._stored_total += len(changed)
        else:
            cid = self._cid
            free = self._free
            for key in keys:
                if ref.get(key) == -1:
                    del ref[key]
                    policy.remove(key)
                    free.append(cid.pop(key))
                    changed.append(key)
            if changed:
                self._remember(changed, MissReason.STORE_FAILED)
        self._write_pending -= len(changed)
        if changed and self._events is not None:
            self._events.append(OffloadEvent(tuple(changed), not success, metadata_only=not success))

    def _free_key(self, key: bytes) -> None:
        """Forget a resident key and free its chunk (no event, no counters)."""
        del self._ref[key]
        self._policy.remove(key)
        self._free.append(self._cid.pop(key))

    def drop(self, keys: Sequence[bytes], reason: MissReason = MissReason.CORRUPT) -> list[bytes]:
        """Remove stored keys whose chunks were found corrupt (or unusable for ``reason``), so they are never
        served again; the reason is remembered for :meth:`miss_reason`.

        A ready, unpinned key is freed now; a key pinned by loads turns dead at once (lookups MISS,
        ``prepare_load`` refuses it, offers skip it) and its chunk is freed when its last pin is released.
        Absent and pending keys are ignored. Returns the keys dropped, announced in one removal event.
        """
        ref = self._ref
        dropped: list[bytes] = []
        for key in dict.fromkeys(keys):
            count = ref.get(key)
            if count is None or count < 0 or key in self._dead:
                continue
            if count == 0:
                self._evictable -= 1
                self._free_key(key)
            else:
                self._dead.add(key)
            dropped.append(key)
        self._dropped_total += len(dropped)
        if dropped:
            self._remember(dropped, reason)
        if dropped and self._events is not None:
            self._events.append(OffloadEvent(tuple(dropped), True))
        return dropped

    # ------------------------------------------------------------------ request lifecycle and events

    def on_request_finished(
        self, keys: Sequence[bytes], reused_keys: Collection[bytes], *, request_id: str | None = None
    ) -> None:
        """Tell the policy a request finished: ``keys`` it stored or reused in prefix order, of which
        ``reused_keys`` were hits (loaded or already stored when offered).

        Without position hints LRU refreshes all ``keys`` (``keys[0]`` most recent) and ARC promotes
        reused keys, as vLLM 0.33. ``request_id`` also drops the request's store-miss memory.
        """
        if request_id is not None:
            self._store_misses.pop(request_id, None)
        reused: AbstractSet[bytes] = reused_keys if isinstance(reused_keys, AbstractSet) else set(reused_keys)
        self._policy.on_request_finished(keys, reused)

    def take_events(self) -> list[OffloadEvent]:
        """Return and forget the events collected since the last call (always empty when disabled).

        A ``metadata_only`` removal only keeps keys that are still absent, because a retried store may
        have allocated them again meanwhile (as vLLM); an event left with no keys is dropped.
        """
        events = self._events
        if not events:
            return []
        self._events = []
        if not any(event.metadata_only for event in events):
            return events
        ref = self._ref
        out: list[OffloadEvent] = []
        for event in events:
            if event.metadata_only:
                keys = tuple(key for key in event.keys if key not in ref)
                if not keys:
                    continue
                if len(keys) != len(event.keys):
                    event = OffloadEvent(keys, event.removed, event.medium, metadata_only=True)
            out.append(event)
        return out

    def reset(self) -> None:
        """Drop every chunk and the policy's learned state, as vLLM's ``reset_cache``.

        In-flight stores and loads are forgotten: their later ``complete_*`` calls must not be made.
        Pending events, the store-threshold tracker and the cumulative counters are kept.
        """
        self._policy.clear()
        self._ref.clear()
        self._cid.clear()
        self._free.clear()
        self._next_fresh = 0
        self._evictable = 0
        self._write_pending = 0
        self._store_misses.clear()
        self._dead.clear()

    # ------------------------------------------------------------------ miss explanations (observability)

    def _remember(self, keys: Sequence[bytes], reason: MissReason) -> None:
        """Record why ``keys`` left the pool (or are unavailable), forgetting the oldest beyond the bound."""
        departed = self._departed
        for key in keys:
            departed[key] = reason
            departed.move_to_end(key)
        while len(departed) > self._max_departures:
            departed.popitem(last=False)

    def miss_reason(self, key: bytes) -> MissReason | None:
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

    def remove(self, keys: Sequence[bytes], reason: MissReason) -> list[bytes]:
        """Drop ``keys`` from the pool for ``reason`` (CORRUPT after a checksum failure, TIER_UNAVAILABLE, ...)
        and remember it, so later misses on them are explained; returns the resident keys dropped.

        Resident keys go as with :meth:`drop` (a pinned one turns dead at once and is freed at its last unpin);
        an absent key only has its reason remembered. A key whose store is in flight cannot be removed (fail its
        store instead): :class:`InvalidStateError` names it and nothing changes.
        """
        if not isinstance(reason, MissReason):
            raise ConfigError(f"reason must be a MissReason, got {reason!r}")
        ref = self._ref
        for key in keys:
            if ref.get(key, 0) < 0:
                raise InvalidStateError(f"cannot remove key {key!r}: its store is in flight (fail the store instead)")
        absent = [key for key in dict.fromkeys(keys) if key not in ref]
        if absent:
            self._remember(absent, reason)
        return self.drop([key for key in keys if key in ref], reason)

    def stats(self) -> ManagerStats:
        """Return usage gauges and counters; allocation sizes and skipped stores restart from zero."""
        num_chunks = self._num_chunks
        if num_chunks > 0:
            used = self._next_fresh - len(self._free) - self._evictable
            usage = used / num_chunks
            write_usage = self._write_pending / num_chunks
        else:
            usage = write_usage = 0.0
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
