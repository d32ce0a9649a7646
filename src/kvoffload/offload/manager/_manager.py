"""Scheduler-side bookkeeping of the host pool: which chunk holds which key, in which state.

:class:`HostBlockManager` reproduces vLLM 0.33's ``CPUOffloadingManager``: chunk ids,
evicted keys, lookup results and event order are identical for the same call sequence (without vLLM's
per-request position hints). A key's chunk is *pending* while its write is in flight (vLLM
``ref_cnt == -1``), *ready* once the store completed (``0``) and *pinned* while loads read it (``> 0``).
Only ready, unpinned chunks are evicted, never a key of the current offer, and never partially.

The manager is not thread-safe; callers serialize access (vLLM's callers hold the manager lock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from collections.abc import Set as AbstractSet

from kvoffload._generated import MissReason
from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager._results import OffloadEvent, StorePlan
from kvoffload.offload.manager._state import ManagerState

__all__ = ["HostBlockManager"]


class HostBlockManager(ManagerState):
    """Allocates host-pool chunks to offload keys and tracks their write/read state (vLLM 0.33 semantics).

    ``num_chunks`` is the pool size; ``policy`` names a registered cache policy ("lru", "arc");
    ``enable_events`` collects :class:`OffloadEvent` for :meth:`take_events`; ``store_threshold >= 2``
    only stores keys offered at least that many times (counted per ``prepare_store`` offer in an LRU
    tracker of ``max_tracker_size`` keys, as vLLM 0.33.0 does); 0 and 1 store on first offer.

    Chunk ids come fresh in increasing order until the pool has been used once, then from a LIFO free
    list. ``prepare_store`` returns ``None`` when room cannot be made; it never evicts a key of its own
    offer nor a pending or pinned chunk.
    """

    __slots__ = ()

    # ------------------------------------------------------------------ stores

    def _record_offer(self, keys: Sequence[OffloadKey], counts: OrderedDict[OffloadKey, int]) -> None:
        """Count one offer of each key in the store-threshold tracker without dropping offered keys.

        Known keys move to the recent end; a new key evicts the oldest tracked key that is not part of
        this offer, or is not tracked when only offered keys remain (vLLM 0.33.0 ``_record_accesses``).
        """
        protected: set[OffloadKey] = set()
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

    def prepare_store(self, keys: Sequence[OffloadKey], *, request_id: str | None = None) -> StorePlan | None:
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
        evicted_keys: list[OffloadKey] = []
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

    def complete_store(self, keys: Collection[OffloadKey], success: bool = True) -> None:
        """Finish the writes of ``keys``: on success they turn ready (HIT), on failure their chunks are freed.

        Only keys whose write is pending are affected; ready, pinned or absent keys are ignored. A success
        emits one stored event; a failure emits one ``metadata_only`` removal (vLLM 0.33.0 emits removals
        before stored events, and one call never has both).
        """
        ref = self._ref
        policy = self._policy
        changed: list[OffloadKey] = []
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

    def drop(self, keys: Sequence[OffloadKey], reason: MissReason = MissReason.CORRUPT) -> list[OffloadKey]:
        """Remove stored keys whose chunks were found corrupt (or unusable for ``reason``), so they are never
        served again; the reason is remembered for :meth:`miss_reason`.

        A ready, unpinned key is freed now; a key pinned by loads turns dead at once (lookups MISS,
        ``prepare_load`` refuses it, offers skip it) and its chunk is freed when its last pin is released.
        Absent and pending keys are ignored. Returns the keys dropped, announced in one removal event.
        """
        ref = self._ref
        dropped: list[OffloadKey] = []
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
        self, keys: Sequence[OffloadKey], reused_keys: Collection[OffloadKey], *, request_id: str | None = None
    ) -> None:
        """Tell the policy a request finished: ``keys`` it stored or reused in prefix order, of which
        ``reused_keys`` were hits (loaded or already stored when offered).

        Without position hints LRU refreshes all ``keys`` (``keys[0]`` most recent) and ARC promotes
        reused keys, as vLLM 0.33. ``request_id`` also drops the request's store-miss memory.
        """
        if request_id is not None:
            self._store_misses.pop(request_id, None)
        reused: AbstractSet[OffloadKey] = reused_keys if isinstance(reused_keys, AbstractSet) else set(reused_keys)
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

    def remove(self, keys: Sequence[OffloadKey], reason: MissReason) -> list[OffloadKey]:
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
