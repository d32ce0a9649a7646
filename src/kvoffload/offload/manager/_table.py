"""The host pool's chunk table: which chunk holds which key, in which state, and the reads on it.

A key's chunk is *pending* while its write is in flight (vLLM ``ref_cnt == -1``), *ready* once the store
completed (``0``) and *pinned* while loads read it (``> 0``). :class:`ChunkTable` answers lookups, takes and
releases load pins and performs the writes :class:`~kvoffload.offload.manager.HostBlockManager` decides on.

A load may also pin a pending key when its caller orders the load after the write (an *early* pin: a promotion
and its load in one step plan); the pins carry over when the write seals, and a failed write leaves the key dead
until they are released.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from collections.abc import Set as AbstractSet

from kvoffload.errors import InvalidStateError
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager._results import LookupResult
from kvoffload.offload.manager.policies import CachePolicy, RequestContext

__all__ = ["ChunkTable"]

_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING


class ChunkTable:
    """Which host chunk holds which key, and in which state; the pool's lookups and load pins.

    Chunk ids come fresh in increasing order until the pool has been used once, then from a LIFO free list.
    The table keeps the cache policy in step with every state change (insertions, evictability, removals); the
    manager (:class:`~kvoffload.offload.manager.HostBlockManager`) decides when a store, drop or reset happens.
    """

    __slots__ = (
        "_cid",
        "_dead",
        "_early",
        "_evictable",
        "_free",
        "_next_fresh",
        "_num_chunks",
        "_policy",
        "_ref",
        "_write_pending",
        "hits",
        "load_pins",
        "misses",
    )

    def __init__(self, num_chunks: int, policy: CachePolicy) -> None:
        self._num_chunks = num_chunks
        self._policy = policy
        # key -> vLLM ref_cnt: -1 pending write, 0 ready, n > 0 pinned by n loads. Presence == resident.
        self._ref: dict[OffloadKey, int] = {}
        self._cid: dict[OffloadKey, int] = {}  # key -> chunk id (mirrors the policy, for fast loads)
        self._next_fresh = 0  # vLLM _num_allocated_chunks: ids below it have been handed out once
        self._free: list[int] = []  # LIFO stack of freed chunk ids
        self._evictable = 0  # resident chunks with ref_cnt == 0
        self._write_pending = 0  # resident chunks with ref_cnt == -1
        self._dead: set[OffloadKey] = set()  # pinned keys dropped as corrupt: freed at their last unpin
        self._early: dict[OffloadKey, int] = {}  # pending key -> load pins taken before its write sealed
        self.hits = 0
        """Lookups answered HIT or HIT_PENDING."""
        self.misses = 0
        """Lookups answered MISS."""
        self.load_pins = 0
        """Keys pinned by :meth:`prepare_load`."""

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
    def num_free_chunks(self) -> int:
        """Return the number of chunks not holding any key (never used plus freed)."""
        return len(self._free) + self._num_chunks - self._next_fresh

    @property
    def num_evictable_chunks(self) -> int:
        """Return the number of ready, unpinned chunks (eviction candidates before protection)."""
        return self._evictable

    def __len__(self) -> int:
        """Return the number of resident keys (pending, ready or pinned)."""
        return len(self._ref)

    def __contains__(self, key: object) -> bool:
        """Tell whether ``key`` is resident in any state."""
        return key in self._ref

    def chunk_id(self, key: OffloadKey) -> int | None:
        """Return the chunk id holding ``key``, or ``None`` if it is not resident."""
        return self._cid.get(key)

    def absent(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """The keys of ``keys`` that are not resident, in order."""
        ref = self._ref
        return [key for key in keys if key not in ref]

    def ready_among(self, keys: Sequence[OffloadKey], also: AbstractSet[OffloadKey] = frozenset()) -> list[OffloadKey]:
        """The keys of ``keys`` that are stored and readable, or in ``also``, in order."""
        get = self._ref.get
        dead = self._dead
        if dead:
            return [key for key in keys if key in also or ((get(key, -1) >= 0) and key not in dead)]
        return [key for key in keys if key in also or get(key, -1) >= 0]

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
            self.misses += 1
            return _MISS
        self.hits += 1
        return _HIT if ref >= 0 else _HIT_PENDING

    def prepare_load(self, keys: Sequence[OffloadKey], pending_ok: Collection[OffloadKey] = ()) -> list[int]:
        """Pin ``keys`` for reading and return their chunk ids in key order.

        Every key must be stored and ready, or pending and in ``pending_ok`` (an early pin: the caller orders the
        load after the write), else :class:`InvalidStateError` names it and nothing stays pinned. A key may be
        pinned several times; each pin needs one :meth:`complete_load`.
        """
        ref = self._ref
        first_pins: list[OffloadKey] = []
        early: list[OffloadKey] = []
        for i, key in enumerate(keys):
            count = ref.get(key)
            if count == -1 and pending_ok and key in pending_ok:
                early.append(key)
                continue
            if count is None or count < 0 or key in self._dead:
                for done in keys[:i]:
                    if ref[done] >= 0:
                        ref[done] -= 1
                state = "not stored" if count is None or count > 0 else "not ready (its store is in flight)"
                raise InvalidStateError(f"cannot load key {key!r}: {state}")
            if count == 0:
                first_pins.append(key)
            ref[key] = count + 1
        for key in early:
            self._early[key] = self._early.get(key, 0) + 1
        if first_pins:
            self._evictable -= len(first_pins)
            self._policy.mark_non_evictable_many(first_pins)
        self.load_pins += len(keys)
        cid = self._cid
        return [cid[key] for key in keys]

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Release one pin per key taken by :meth:`prepare_load`; a chunk becomes evictable at zero pins.

        A key that is not pinned raises :class:`InvalidStateError` naming it, and no pin is released.
        """
        ref, early = self._ref, self._early
        released: list[OffloadKey] = []
        for i, key in enumerate(keys):
            count = ref.get(key)
            if count == -1 and early.get(key, 0) > 0:
                early[key] -= 1  # an early pin released before the write sealed (a load that failed first)
                if not early[key]:
                    del early[key]
                continue
            if count is None or count <= 0:
                for done in keys[:i]:
                    if ref[done] == -1:
                        early[done] = early.get(done, 0) + 1
                    else:
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

    def touch(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        """Record an access to resident ``keys`` for the policy; ``keys[0]`` ends most recent."""
        if ctx is None:
            self._policy.touch(keys)  # a policy written for 1.4 takes no context
        else:
            self._policy.touch(keys, ctx)

    def _free_key(self, key: OffloadKey) -> None:
        """Forget a resident key and free its chunk (no event, no counters)."""
        del self._ref[key]
        self._policy.remove(key)
        self._free.append(self._cid.pop(key))

    # ------------------------------------------------------------------ state of one key

    def ref_count(self, key: OffloadKey) -> int | None:
        """vLLM's ``ref_cnt`` of a resident key (-1 pending, 0 ready, n pinned), None when absent."""
        return self._ref.get(key)

    def is_dead(self, key: OffloadKey) -> bool:
        """Whether ``key`` was dropped while pinned (freed at its last unpin)."""
        return key in self._dead

    @property
    def write_pending(self) -> int:
        """Resident chunks whose write is in flight."""
        return self._write_pending

    @property
    def usage(self) -> float:
        """Share of chunks that cannot be evicted (pending or pinned): vLLM's ``cpu_cache_usage_perc``."""
        num_chunks = self._num_chunks
        if num_chunks <= 0:
            return 0.0
        return (self._next_fresh - len(self._free) - self._evictable) / num_chunks

    # ------------------------------------------------------------------ writes (the manager decides when)

    def evict_for(self, n: int, protected: Sequence[OffloadKey]) -> list[OffloadKey] | None:
        """Make room for ``n`` new chunks, evicting ready, unpinned keys outside ``protected`` as the policy
        chooses; the evicted keys, or None (nothing changed) when not enough can be evicted."""
        need = n - (len(self._free) + self._num_chunks - self._next_fresh)
        if need <= 0:
            return []
        if need > self._evictable:
            return None
        evicted = self._policy.evict(need, set(protected))  # the set only when something must go
        if evicted is None:
            return None
        ref, cid, free = self._ref, self._cid, self._free
        keys: list[OffloadKey] = []
        for key, chunk_id in evicted:
            del ref[key]
            del cid[key]
            free.append(chunk_id)
            keys.append(key)
        self._evictable -= len(keys)
        return keys

    def allocate(self, keys: list[OffloadKey], ctx: RequestContext | None = None) -> list[int]:
        """Give each of ``keys`` (absent, distinct, room made) a chunk, its write pending; their chunk ids.

        ``ctx``: the request storing them, for the policy."""
        n = len(keys)
        free = self._free
        fresh = min(n, self._num_chunks - self._next_fresh)
        start = self._next_fresh
        chunk_ids = list(range(start, start + fresh))
        self._next_fresh = start + fresh
        if fresh < n:
            reused = free[fresh - n :]
            del free[fresh - n :]
            reused.reverse()
            chunk_ids += reused
        self._ref.update(dict.fromkeys(keys, -1))
        self._cid.update(zip(keys, chunk_ids, strict=True))
        if ctx is None:
            self._policy.insert_many(keys, chunk_ids)
        else:
            self._policy.insert_many(keys, chunk_ids, ctx)
        self._write_pending += n
        return chunk_ids

    def seal(self, keys: Collection[OffloadKey]) -> list[OffloadKey]:
        """The pending keys of ``keys`` turn ready (pinned by their early pins, if any); returns them."""
        ref, early = self._ref, self._early
        changed: list[OffloadKey] = []
        evictable: list[OffloadKey] = []
        for key in keys:  # one by one: a key listed twice changes once
            if ref.get(key) == -1:
                pins = early.pop(key, 0) if early else 0
                ref[key] = pins
                changed.append(key)
                if not pins:
                    evictable.append(key)
        if evictable:
            self._policy.mark_evictable_many(evictable)
            self._evictable += len(evictable)
        self._write_pending -= len(changed)
        return changed

    def fail(self, keys: Collection[OffloadKey]) -> list[OffloadKey]:
        """The pending keys of ``keys`` are forgotten and their chunks freed (a key with early pins turns dead and
        is freed at its last unpin: it is never served); returns them."""
        ref, early = self._ref, self._early
        changed: list[OffloadKey] = []
        for key in keys:  # one by one: a key listed twice changes once
            if ref.get(key) == -1:
                pins = early.pop(key, 0) if early else 0
                if pins:
                    ref[key] = pins
                    self._dead.add(key)
                else:
                    self._free_key(key)
                changed.append(key)
        self._write_pending -= len(changed)
        return changed

    def drop(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Drop the stored keys of ``keys``: a ready one is freed now, a pinned one turns dead (freed at its last
        unpin); absent, pending and already dead keys are ignored. Returns the keys dropped."""
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
        return dropped

    def clear(self) -> None:
        """Forget every chunk and the policy's learned state (vLLM's ``reset_cache``)."""
        self._policy.clear()
        self._ref.clear()
        self._cid.clear()
        self._free.clear()
        self._next_fresh = 0
        self._evictable = 0
        self._write_pending = 0
        self._dead.clear()
        self._early.clear()
