"""Scheduler-side bookkeeping of the host pool: which chunk holds which key, in which state.

:class:`HostBlockManager` reproduces vLLM 0.33's ``CPUOffloadingManager``: chunk ids,
evicted keys, lookup results and event order are identical for the same call sequence, with or without vLLM's
per-request position hints (a request's :class:`~kvoffload.offload.manager.policies.RequestContext`, see
:meth:`HostBlockManager.request_context`). A key's chunk is *pending* while its write is in flight (vLLM
``ref_cnt == -1``), *ready* once the store completed (``0``) and *pinned* while loads read it (``> 0``).
Only ready, unpinned chunks are evicted, never a key of the current offer, and never partially.

The manager composes three parts with their own state: the chunk table (``_table``: which chunk holds which key,
lookups, pins), the offer tracker and departure log (``_offers``: the store threshold, each request's store
misses, why keys left) and its own events and totals.

The manager is not thread-safe; callers serialize access (vLLM's callers hold the manager lock).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from collections.abc import Set as AbstractSet

from kvoffload._generated import MissReason
from kvoffload._ints import check_int
from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager._offers import DepartureLog, OfferTracker
from kvoffload.offload.manager._requests import request_key_groups
from kvoffload.offload.manager._results import LookupResult, ManagerStats, OffloadEvent, StorePlan
from kvoffload.offload.manager._table import ChunkTable
from kvoffload.offload.manager.policies import CachePolicy, RequestContext, make_policy

__all__ = ["HostBlockManager"]


class HostBlockManager:
    """Allocates host-pool chunks to offload keys and tracks their write/read state (vLLM 0.33 semantics).

    ``num_chunks`` is the pool size; ``policy`` names a registered cache policy ("lru", "arc");
    ``enable_events`` collects :class:`OffloadEvent` for :meth:`take_events`; ``store_threshold >= 2``
    only stores keys offered at least that many times (counted per ``prepare_store`` offer in an LRU
    tracker of ``max_tracker_size`` keys, as vLLM 0.33.0 does); 0 and 1 store on first offer.
    ``max_departures`` bounds the memory of why keys left the pool (see :meth:`miss_reason`).
    ``cache_policy_module_path`` (vLLM's key) makes an unregistered ``policy`` the name of a
    :class:`CachePolicy` subclass in that module (an out-of-tree policy).

    Chunk ids come fresh in increasing order until the pool has been used once, then from a LIFO free
    list. ``prepare_store`` returns ``None`` when room cannot be made; it never evicts a key of its own
    offer nor a pending or pinned chunk. Invalid arguments raise :class:`ConfigError` naming field and value.
    """

    __slots__ = (
        "_alloc_sizes",
        "_contexts",
        "_departures",
        "_dropped_total",
        "_events",
        "_evicted_total",
        "_offers",
        "_policy_name",
        "_stored_total",
        "_table",
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
        cache_policy_module_path: str | None = None,
    ) -> None:
        num_chunks = check_int("num_chunks", num_chunks, 0)
        store_threshold = check_int("store_threshold", store_threshold, 0)
        max_tracker_size = check_int("max_tracker_size", max_tracker_size, 1)
        if not isinstance(enable_events, bool):
            raise ConfigError(f"enable_events must be a bool, got {enable_events!r}")
        if not isinstance(policy, str):
            raise ConfigError(f"policy must be a str, got {policy!r}")
        self._table = ChunkTable(num_chunks, make_policy(policy, num_chunks, cache_policy_module_path))
        self._policy_name = policy
        self._offers = OfferTracker(store_threshold, max_tracker_size)
        self._departures = DepartureLog(check_int("max_departures", max_departures, 1))
        self._events: list[OffloadEvent] | None = [] if enable_events else None
        self._alloc_sizes = _SizeSamples()
        self._stored_total = 0
        self._evicted_total = 0
        self._dropped_total = 0
        self._contexts: dict[str, RequestContext] = {}  # request id -> its context, until it finishes

    # ------------------------------------------------------------------ introspection

    @property
    def num_chunks(self) -> int:
        """Return the pool size in chunks."""
        return self._table.num_chunks

    @property
    def policy(self) -> CachePolicy:
        """Return the cache policy instance (for inspection; do not mutate it directly)."""
        return self._table.policy

    @property
    def policy_name(self) -> str:
        """Return the registry name of the cache policy."""
        return self._policy_name

    @property
    def num_free_chunks(self) -> int:
        """Return the number of chunks not holding any key (never used plus freed)."""
        return self._table.num_free_chunks

    @property
    def num_evictable_chunks(self) -> int:
        """Return the number of ready, unpinned chunks (eviction candidates before protection)."""
        return self._table.num_evictable_chunks

    @property
    def store_counts(self) -> dict[OffloadKey, int]:
        """Return a copy of the store-threshold tracker (offer counts, oldest first); empty when disabled."""
        return self._offers.counts

    @property
    def usage(self) -> float:
        """Share of chunks that cannot be evicted (pending or pinned): vLLM's ``cpu_cache_usage_perc``."""
        return self._table.usage

    def __len__(self) -> int:
        """Return the number of resident keys (pending, ready or pinned)."""
        return len(self._table)

    def __contains__(self, key: object) -> bool:
        """Tell whether ``key`` is resident in any state."""
        return key in self._table

    def chunk_id(self, key: OffloadKey) -> int | None:
        """Return the chunk id holding ``key``, or ``None`` if it is not resident."""
        return self._table.chunk_id(key)

    def ready_keys(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """The keys of ``keys`` that are stored and readable (:meth:`is_ready`), in order; one call for many."""
        return self._table.ready_among(keys)

    def is_ready(self, key: OffloadKey) -> bool:
        """Tell whether ``key`` is stored and readable (ready or pinned), without counting a lookup."""
        return self._table.is_ready(key)

    def has_pending_work(self) -> bool:
        """Tell whether any store is in flight or any load pin is held.

        vLLM's CPU manager always answers False (its connector tracks transfers); here the answer lets a
        caller check that every ``prepare_*`` was matched by its ``complete_*`` before shutting down.
        """
        return self._table.has_pending_work()

    def request_context(self, request_id: str) -> RequestContext:
        """The context of request ``request_id``, created on first use: record its keys' end-token positions there
        (``set_offload_key_position``, as vLLM's connector does for every chunk key it derives).

        Calls that name the request (``request_id=``) hand the context to the policy: LRU ranks a stored key
        with a position at ``(request rank, -position)`` and raises the keys the request loads or finds stored
        (tails before heads, the whole request before later requests), and a finish refreshes the keys in
        position order. :meth:`on_request_finished` with the request id drops it.
        """
        ctx = self._contexts.get(request_id)
        if ctx is None:
            if not isinstance(request_id, str):
                raise ConfigError(f"request_id must be a str, got {request_id!r}")
            ctx = self._contexts[request_id] = RequestContext(request_id)
        return ctx

    def _context(self, request_id: str | None) -> RequestContext | None:
        return None if request_id is None else self._contexts.get(request_id)

    # ------------------------------------------------------------------ lookups and loads

    def lookup(self, key: OffloadKey) -> LookupResult:
        """Return whether ``key`` is stored (HIT), being written (HIT_PENDING) or absent (MISS).

        Read-only apart from statistics: recency is only changed by :meth:`touch`, and offers, not
        lookups, count towards ``store_threshold`` (as in vLLM 0.33.0).
        """
        return self._table.lookup(key)

    def prepare_load(
        self,
        keys: Sequence[OffloadKey],
        *,
        request_id: str | None = None,
        pending_ok: Collection[OffloadKey] = (),
    ) -> list[int]:
        """Pin ``keys`` for reading and return their chunk ids in key order.

        Every key must be stored and ready, else :class:`InvalidStateError` names it and nothing stays
        pinned. A key may be pinned several times; each pin needs one :meth:`complete_load`. With the
        ``request_id`` of a request with a context, the policy observes the access (``on_request_access``).
        Keys in ``pending_ok`` may also be pending: for a caller that orders the load after their write (a tier
        promotion and its load in one step); the pin holds once the write succeeds, and a failed write leaves
        the chunk unserved until the pin is released.
        """
        chunk_ids = self._table.prepare_load(keys, pending_ok)
        ctx = self._context(request_id)
        if ctx is not None and keys:
            self._table.policy.on_request_access(keys, ctx)
        return chunk_ids

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Release one pin per key taken by :meth:`prepare_load`; a chunk becomes evictable at zero pins.

        A key that is not pinned raises :class:`InvalidStateError` naming it, and no pin is released.
        """
        self._table.complete_load(keys)

    def touch(self, keys: Sequence[OffloadKey], *, request_id: str | None = None) -> None:
        """Record an access to resident ``keys`` for the policy; ``keys[0]`` ends most recent."""
        self._table.touch(keys, self._context(request_id))

    def prepare_store(self, keys: Sequence[OffloadKey], *, request_id: str | None = None) -> StorePlan | None:
        """Allocate chunks for the offered keys that are not resident, evicting if needed.

        Returns a :class:`StorePlan` (possibly empty) or ``None`` when not enough ready, unpinned chunks
        outside this offer can be evicted; ``None`` changes no chunk. Resident keys of the offer are left
        as they are and protected from eviction. ``request_id`` lets the policy observe each store miss
        once per request across retries, as vLLM does per request context (the memory is dropped by
        ``on_request_finished(..., request_id=...)`` or :meth:`reset`); without it every call counts as
        its own request. With a :meth:`request_context`, the policy also sees the request's positions: it observes
        the offered keys already stored (``on_request_access``) and inserts the new ones by position.
        Follow with :meth:`complete_store` for ``keys_to_store``.
        """
        table = self._table
        to_store = self._offers.filter(keys, table.absent(keys))
        ctx = self._context(request_id)
        if not to_store:
            if ctx is not None and (ready := table.ready_among(keys)):
                table.policy.on_request_access(ready, ctx)
            return StorePlan([], [], [])
        n = len(to_store)
        if n > 1 and len(set(to_store)) != n:
            to_store = list(dict.fromkeys(to_store))
            n = len(to_store)
        misses = self._offers.new_store_misses(request_id, to_store)
        policy = table.policy
        if misses:
            if ctx is None:
                policy.on_store_miss(misses)  # a policy written for 1.4 takes no context
            else:
                policy.on_store_miss(misses, ctx)
        if ctx is not None:  # vLLM: the offer's store candidates and stored keys, in offer order
            policy.on_request_access(table.ready_among(keys, set(to_store)), ctx)  # not empty: to_store is not
        self._alloc_sizes.add(n)
        evicted_keys = table.evict_for(n, keys)
        if evicted_keys is None:
            return None
        if evicted_keys:
            self._departures.remember(evicted_keys, MissReason.EVICTED)
            self._evicted_total += len(evicted_keys)
            if self._events is not None:
                self._events.append(OffloadEvent(tuple(evicted_keys), True))
        chunk_ids = table.allocate(to_store, ctx)
        return StorePlan(to_store, chunk_ids, evicted_keys)

    def complete_store(self, keys: Collection[OffloadKey], success: bool = True) -> None:
        """Finish the writes of ``keys``: on success they turn ready (HIT), on failure their chunks are freed.

        Only keys whose write is pending are affected; ready, pinned or absent keys are ignored. A success
        emits one stored event; a failure emits one ``metadata_only`` removal (vLLM 0.33.0 emits removals
        before stored events, and one call never has both).
        """
        if success:
            changed = self._table.seal(keys)
            self._stored_total += len(changed)
        else:
            changed = self._table.fail(keys)
            if changed:
                self._departures.remember(changed, MissReason.STORE_FAILED)
        if changed and self._events is not None:
            self._events.append(OffloadEvent(tuple(changed), not success, metadata_only=not success))

    def drop(self, keys: Sequence[OffloadKey], reason: MissReason = MissReason.CORRUPT) -> list[OffloadKey]:
        """Remove stored keys whose chunks were found corrupt (or unusable for ``reason``), so they are never
        served again; the reason is remembered for :meth:`miss_reason`.

        A ready, unpinned key is freed now; a key pinned by loads turns dead at once (lookups MISS,
        ``prepare_load`` refuses it, offers skip it) and its chunk is freed when its last pin is released.
        Absent and pending keys are ignored. Returns the keys dropped, announced in one removal event.
        """
        dropped = self._table.drop(keys)
        self._dropped_total += len(dropped)
        if dropped:
            self._departures.remember(dropped, reason)
            if self._events is not None:
                self._events.append(OffloadEvent(tuple(dropped), True))
        return dropped

    # ------------------------------------------------------------------ request lifecycle and events

    def on_request_finished(
        self, keys: Sequence[OffloadKey], reused_keys: Collection[OffloadKey], *, request_id: str | None = None
    ) -> None:
        """Tell the policy a request finished: ``keys`` it stored or reused in prefix order, of which
        ``reused_keys`` were hits (loaded or already stored when offered); the others it only inserted.

        Without a context LRU refreshes all ``keys`` (``keys[0]`` most recent) and ARC promotes reused keys,
        as vLLM 0.33 without positions. With the ``request_id`` of a request with a :meth:`request_context`,
        the policy gets vLLM's key groups: per KV-cache group (ascending group id), the keys in the given order,
        sorted by recorded position when each has one; the context is dropped, as is the request's store-miss
        memory.
        """
        ctx = None
        if request_id is not None:
            self._offers.forget_request(request_id)
            ctx = self._contexts.pop(request_id, None)
        reused: AbstractSet[OffloadKey] = reused_keys if isinstance(reused_keys, AbstractSet) else set(reused_keys)
        policy = self._table.policy
        if ctx is None:
            policy.on_request_finished(keys, reused)  # the 1.4 form: one group, the keys not reused are insertions
            return
        insertion_only = set(keys).difference(reused)
        policy.on_request_finished(request_key_groups(keys, ctx), insertion_only, reused, ctx)

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
        table = self._table
        out: list[OffloadEvent] = []
        for event in events:
            if event.metadata_only:
                keys = tuple(key for key in event.keys if key not in table)
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
        self._table.clear()
        self._offers.forget_requests()

    def remove(self, keys: Sequence[OffloadKey], reason: MissReason) -> list[OffloadKey]:
        """Drop ``keys`` from the pool for ``reason`` (CORRUPT after a checksum failure, TIER_UNAVAILABLE, ...)
        and remember it, so later misses on them are explained; returns the resident keys dropped.

        Resident keys go as with :meth:`drop` (a pinned one turns dead at once and is freed at its last unpin);
        an absent key only has its reason remembered. A key whose store is in flight cannot be removed (fail its
        store instead): :class:`InvalidStateError` names it and nothing changes.
        """
        if not isinstance(reason, MissReason):
            raise ConfigError(f"reason must be a MissReason, got {reason!r}")
        table = self._table
        for key in keys:
            if (table.ref_count(key) or 0) < 0:
                raise InvalidStateError(f"cannot remove key {key!r}: its store is in flight (fail the store instead)")
        absent = [key for key in dict.fromkeys(keys) if key not in table]
        if absent:
            self._departures.remember(absent, reason)
        return self.drop([key for key in keys if key in table], reason)

    # ------------------------------------------------------------------ miss explanations and statistics

    def miss_reason(self, key: OffloadKey) -> MissReason | None:
        """Why ``key`` is not loadable now, or ``None`` when it is stored and ready (no statistics change).

        A pending write answers STORE_PENDING; a dropped key (absent, or dead until its last unpin) answers the
        remembered reason it left (evicted, store failed, corrupt, or whatever :meth:`remove` was told); else
        BELOW_STORE_THRESHOLD when it was offered fewer than ``store_threshold`` times, else NEVER_STORED. The
        memory is bounded by ``max_departures`` (oldest forgotten first) and survives :meth:`reset`.
        """
        ref = self._table.ref_count(key)
        if ref is not None:
            if ref < 0:
                return MissReason.STORE_PENDING
            if not self._table.is_dead(key):
                return None
        reason = self._departures.reason(key)
        if reason is not None:
            return reason
        if ref is not None:
            return MissReason.CORRUPT  # dead, its reason forgotten: only corrupt chunks turn dead on their own
        if self._offers.below_threshold(key):
            return MissReason.BELOW_STORE_THRESHOLD
        return MissReason.NEVER_STORED

    def stats(self) -> ManagerStats:
        """Return usage gauges and counters; allocation sizes and skipped stores restart from zero."""
        table = self._table
        num_chunks = table.num_chunks
        usage = table.usage
        write_usage = table.write_pending / num_chunks if num_chunks > 0 else 0.0
        sizes = self._alloc_sizes.take()
        return ManagerStats(
            num_chunks=num_chunks,
            usage=usage,
            write_usage=write_usage,
            read_usage=max(usage - write_usage, 0.0),
            allocation_sizes=sizes,
            stores_skipped=self._offers.take_skipped(),
            lookups=table.hits + table.misses,
            hits=table.hits,
            misses=table.misses,
            stored=self._stored_total,
            evicted=self._evicted_total,
            load_pins=table.load_pins,
            dropped=self._dropped_total,
        )


class _SizeSamples:
    """Allocation sizes since the last take, in memory bounded by the distinct sizes seen: the first
    ``keep`` samples in order, every later one only counted per size (a caller that never takes them, such as
    an engine without metrics, does not grow a list by one entry per store offer)."""

    __slots__ = ("_first", "_keep", "_more")

    def __init__(self, keep: int = 4096) -> None:
        self._keep = keep
        self._first: list[int] = []
        self._more: dict[int, int] = {}

    def add(self, size: int) -> None:
        if len(self._first) < self._keep:
            self._first.append(size)
        else:
            self._more[size] = self._more.get(size, 0) + 1

    def take(self) -> tuple[int, ...]:
        """The samples (the first ``keep`` in order, then the rest by size) and a fresh start."""
        out = self._first + [size for size in sorted(self._more) for _ in range(self._more[size])]
        self._first, self._more = [], {}
        return tuple(out)
