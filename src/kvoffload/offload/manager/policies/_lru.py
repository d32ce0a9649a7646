"""Least-recently-used eviction, behaviour-compatible with vLLM 0.33's ``lru`` cache policy.

vLLM's LRU orders chunks by a logical rank, independent of when transfers complete: a rank is a pair
``(major, minor)``, lower ranks are evicted first. Inserts and touches take a fresh rank ``(next_rank, 0)``; a
request's keys with a recorded end-token position (:class:`~kvoffload.offload.manager.policies.RequestContext`)
are ranked ``(request_rank, -position)`` instead, ``request_rank`` allocated once per request, so that inside a
running request the tail goes before the head and all of it before the chunks of requests that came later. Only
evictable keys (ready, unpinned) are eviction candidates; they live in a lazily invalidated min-heap of
``(rank, key)``, so equal ranks (one position in two groups) are evicted in key order.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import ClassVar

from kvoffload.errors import ConfigError
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager.policies._base import CachePolicy, check_evict_count, request_finished_args
from kvoffload.offload.manager.policies._context import RequestContext, order_request_keys

__all__ = ["LRUPolicy"]

Rank = tuple[int, int]
"""An LRU rank ``(major, minor)``: lower is evicted first."""

_SPAN = 1 << 40
"""Ranks are kept as one int, ``major x _SPAN + _TOP + minor`` (the same order, cheaper heap comparisons): a
position must lie in ``[0, _TOP]``."""
_TOP = _SPAN - 1


@dataclass(slots=True)
class _RequestRank:
    """The rank major of one request's positioned keys, kept in its :class:`RequestContext`."""

    owner: LRUPolicy
    generation: int
    rank: int


class LRUPolicy(CachePolicy):
    """vLLM 0.33's LRU: logical ranks, a lazy min-heap over evictable keys, request positions honoured.

    Without positions this is exact least-recently-used order by insertion and touch. Eviction skips pending,
    pinned and protected keys; recency can change while a key is pinned, and it re-enters the heap with the rank
    it has when it becomes evictable again.
    """

    __slots__ = ("_chunks", "_evictable", "_generation", "_heap", "_next_rank", "_ranks")

    name: ClassVar[str] = "lru"

    def __init__(self, capacity: int) -> None:
        """Create an empty LRU policy for ``capacity`` chunks."""
        super().__init__(capacity)
        self._chunks: dict[OffloadKey, int] = {}  # resident key -> chunk id
        self._ranks: dict[OffloadKey, int] = {}  # encoded ranks (see _SPAN)
        self._evictable: set[OffloadKey] = set()
        self._heap: list[tuple[int, OffloadKey]] = []  # lazy: an entry not matching an evictable key's rank is stale
        self._next_rank = 0
        self._generation = 0  # bumped by clear(): request ranks from before are not reused

    def __len__(self) -> int:
        """Return the number of resident keys."""
        return len(self._chunks)

    def __contains__(self, key: object) -> bool:
        """Tell whether ``key`` is resident."""
        return key in self._chunks

    def lru_order(self) -> list[OffloadKey]:
        """Return the resident keys in eviction order by rank, least recently used first (for inspection)."""
        ranks = self._ranks
        return sorted(self._chunks, key=lambda key: (ranks[key], key))

    def rank(self, key: OffloadKey) -> Rank | None:
        """The rank ``(major, minor)`` of a resident key (lower is evicted first), or None (for inspection)."""
        rank = self._ranks.get(key)
        return None if rank is None else (rank // _SPAN, rank % _SPAN - _TOP)

    def get(self, key: OffloadKey) -> int | None:
        """Return the chunk id of ``key`` or ``None``."""
        return self._chunks.get(key)

    # ------------------------------------------------------------------ ranks

    def _fresh_rank(self) -> int:
        self._next_rank += 1
        return self._next_rank * _SPAN + _TOP

    def _request_rank(self, ctx: RequestContext) -> int:
        """The request's rank major, allocated from the rank counter the first time the request needs one."""
        state = ctx.get_state(_RequestRank)
        if state is None or state.owner is not self or state.generation != self._generation:
            self._next_rank += 1
            state = _RequestRank(self, self._generation, self._next_rank)
            ctx.set_state(state)
        return state.rank

    def _position_rank(self, key: OffloadKey, ctx: RequestContext | None) -> int | None:
        """``(request_rank, -position)`` encoded, or None without a recorded position."""
        if ctx is None:
            return None
        position = ctx.get_offload_key_position(key)
        if position is None:
            return None
        if not isinstance(position, int) or not 0 <= position <= _TOP:
            raise ConfigError(f"offload key position must be a token count in [0, {_TOP}], got {position!r}")
        return self._request_rank(ctx) * _SPAN + _TOP - position

    def _rebuild_heap(self) -> None:
        ranks = self._ranks
        self._heap = [(ranks[key], key) for key in self._evictable]
        heapq.heapify(self._heap)

    def _maybe_compact_heap(self) -> None:
        if len(self._heap) >= max(64, 2 * len(self._evictable)):
            self._rebuild_heap()

    def _pushed(self, updated_evictable: list[OffloadKey]) -> None:
        """Evictable keys whose rank changed: rebuilding is cheaper than pushing a long prefix (vLLM)."""
        if len(updated_evictable) >= max(64, len(self._evictable) // 4):
            self._rebuild_heap()
            return
        ranks = self._ranks
        heap = self._heap
        for key in updated_evictable:
            heapq.heappush(heap, (ranks[key], key))
        self._maybe_compact_heap()

    def _update_recency(self, keys: Iterable[OffloadKey]) -> None:
        """Give every resident key of ``keys`` a fresh rank, in iteration order (the last ends most recent)."""
        ranks = self._ranks
        chunks = self._chunks
        evictable = self._evictable
        updated: list[OffloadKey] = []
        for key in keys:
            if key in chunks:
                self._next_rank += 1
                ranks[key] = self._next_rank * _SPAN + _TOP
                if key in evictable:
                    updated.append(key)
        self._pushed(updated)

    # ------------------------------------------------------------------ the CachePolicy interface

    def insert(self, key: OffloadKey, chunk_id: int, ctx: RequestContext | None = None) -> None:
        """Add ``key`` (pending) at rank ``(request_rank, -position)`` when ``ctx`` records its position, else at
        a fresh rank (the most recent)."""
        rank = self._position_rank(key, ctx)
        self._chunks[key] = chunk_id
        self._ranks[key] = self._fresh_rank() if rank is None else rank
        self._evictable.discard(key)

    def remove(self, key: OffloadKey) -> int | None:
        """Drop ``key`` and return its chunk id."""
        self._ranks.pop(key, None)
        self._evictable.discard(key)
        return self._chunks.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        """Give resident ``keys`` fresh ranks, ``keys[0]`` last (iterates the list reversed, as vLLM)."""
        self._update_recency(reversed(keys))

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        """Raise each resident key with a recorded position to at least ``(request_rank, -position)``: a key
        the request uses is no older than the request's own chunks there (tails still precede heads)."""
        if ctx is None:
            return
        ranks = self._ranks
        evictable = self._evictable
        updated: list[OffloadKey] = []
        for key in keys:
            rank = ranks.get(key)
            if rank is None:
                continue
            wanted = self._position_rank(key, ctx)
            if wanted is not None and wanted > rank:
                ranks[key] = wanted
                if key in evictable:
                    updated.append(key)
        if updated:
            self._pushed(updated)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]] | Sequence[OffloadKey],
        insertion_only: AbstractSet[OffloadKey],
        reused: AbstractSet[OffloadKey] | None = None,
        ctx: RequestContext | None = None,
    ) -> None:
        """Refresh the request's keys as a touch of :func:`order_request_keys` (position order when every key has
        one): its first chunk ends most recent."""
        groups, _, _ = request_finished_args(key_groups, insertion_only, reused)
        self._update_recency(reversed(order_request_keys(groups, ctx)))

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        """Evict the ``n`` evictable, unprotected keys of lowest ``(rank, key)``, or nothing."""
        if n <= 0:
            check_evict_count(n)
            return []
        heap = self._heap
        ranks = self._ranks
        evictable = self._evictable
        selected: list[tuple[int, OffloadKey]] = []
        selected_keys: set[OffloadKey] = set()
        deferred: list[tuple[int, OffloadKey]] = []
        while heap and len(selected) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            if key not in evictable or ranks.get(key) != rank:
                continue  # stale
            if key in selected_keys:
                continue  # a re-pin without a rank change leaves an equal entry behind
            if key in protected:
                deferred.append(entry)
                continue
            selected.append(entry)
            selected_keys.add(key)
        for entry in deferred:
            heapq.heappush(heap, entry)
        if len(selected) < n:
            for entry in selected:
                heapq.heappush(heap, entry)
            return None
        chunks = self._chunks
        victims: list[tuple[OffloadKey, int]] = []
        for _, key in selected:
            evictable.discard(key)
            del ranks[key]
            victims.append((key, chunks.pop(key)))
        self._maybe_compact_heap()
        return victims

    def clear(self) -> None:
        """Forget every key; ranks start over."""
        self._chunks.clear()
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._next_rank = 0
        self._generation += 1

    def mark_evictable(self, key: OffloadKey) -> None:
        """Make resident ``key`` an eviction candidate at its current rank."""
        if key in self._chunks and key not in self._evictable:
            self._evictable.add(key)
            heapq.heappush(self._heap, (self._ranks[key], key))
            self._maybe_compact_heap()

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Exclude resident ``key`` from eviction while it is pinned."""
        self._evictable.discard(key)

    def mark_evictable_many(self, keys: Collection[OffloadKey]) -> None:
        """Make the resident ``keys`` eviction candidates at their current ranks."""
        chunks = self._chunks
        evictable = self._evictable
        new = [key for key in keys if key in chunks and key not in evictable]
        if not new:
            return
        evictable.update(new)
        ranks = self._ranks
        heap = self._heap
        if len(new) >= max(64, len(evictable) // 4):
            self._rebuild_heap()
            return
        for key in new:
            heapq.heappush(heap, (ranks[key], key))
        self._maybe_compact_heap()

    def mark_non_evictable_many(self, keys: Collection[OffloadKey]) -> None:
        """Exclude the ``keys`` from eviction while they are pinned."""
        self._evictable.difference_update(keys)
