"""Least-recently-used eviction, behaviour-compatible with vLLM 0.33's ``lru`` cache policy.

vLLM's LRU orders chunks by a logical rank, independent of when transfers complete: a rank is a pair
``(major, minor)``, lower ranks are evicted first. Inserts and touches take a fresh rank ``(next_rank, 0)``; a
request's keys with a recorded end-token position (:class:`~kvoffload.offload.manager.policies.RequestContext`)
are ranked ``(request_rank, -position)`` instead, ``request_rank`` allocated once per request, so that inside a
running request the tail goes before the head and all of it before the chunks of requests that came later.

A fresh rank is above every rank handed out before, so the keys whose rank is fresh are kept in one
insertion-ordered dict, oldest first, moved to its end when they take a fresh rank again: without positions
this is the whole order, as cheap as a plain LRU list. Only the evictable keys ranked by position (those of
running requests) sit in a lazily invalidated min-heap of ``(rank, key)``; eviction merges the two, so equal ranks
(one position in two groups) are evicted in key order.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter
from typing import ClassVar, cast

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

_drain: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend
"""Run an iterator of calls to its end at C speed (``map`` of a bound method over many keys)."""


@dataclass(slots=True)
class _RequestRank:
    """The rank major of one request's positioned keys, kept in its :class:`RequestContext`."""

    owner: LRUPolicy
    generation: int
    rank: int


class LRUPolicy(CachePolicy):
    """vLLM 0.33's LRU: logical ranks, request positions honoured, the n lowest evictable ranks evicted.

    Eviction skips pending, pinned and protected keys; recency can change while a key is pinned, and the key
    competes with the rank it has when it becomes evictable again.
    """

    __slots__ = ("_blocked", "_chunks", "_fresh", "_generation", "_heap", "_next_rank", "_placed")

    name: ClassVar[str] = "lru"

    def __init__(self, capacity: int) -> None:
        """Create an empty LRU policy for ``capacity`` chunks."""
        super().__init__(capacity)
        self._chunks: dict[OffloadKey, int] = {}  # resident key -> chunk id
        self._blocked: set[OffloadKey] = set()  # resident keys that are pending or pinned
        self._fresh: dict[OffloadKey, int] = {}  # key -> its fresh rank (encoded, see _SPAN), in rank order
        self._placed: dict[OffloadKey, int] = {}  # key -> its rank by position (encoded)
        # (rank, key) of the unblocked keys of _placed; lazy: an entry whose key is blocked or has another rank now
        # is stale.
        self._heap: list[tuple[int, OffloadKey]] = []
        self._next_rank = 0
        self._generation = 0  # bumped by clear(): request ranks from before are not reused

    def __len__(self) -> int:
        """Return the number of resident keys."""
        return len(self._chunks)

    def __contains__(self, key: object) -> bool:
        """Tell whether ``key`` is resident."""
        return key in self._chunks

    def _rank(self, key: OffloadKey) -> int | None:
        rank = self._fresh.get(key)
        return self._placed.get(key) if rank is None else rank

    def lru_order(self) -> list[OffloadKey]:
        """Return the resident keys in eviction order by rank, least recently used first (for inspection)."""
        return sorted(self._chunks, key=lambda key: (self._rank(key), key))

    def rank(self, key: OffloadKey) -> Rank | None:
        """The rank ``(major, minor)`` of a resident key (lower is evicted first), or None (for inspection)."""
        rank = self._rank(key)
        return None if rank is None else (rank // _SPAN, rank % _SPAN - _TOP)

    def get(self, key: OffloadKey) -> int | None:
        """Return the chunk id of ``key`` or ``None``."""
        return self._chunks.get(key)

    # ------------------------------------------------------------------ ranks

    def _request_rank(self, ctx: RequestContext) -> int:
        """The request's rank major, allocated from the rank counter the first time the request needs one."""
        state = ctx.get_state(_RequestRank)
        if state is None or state.owner is not self or state.generation != self._generation:
            self._next_rank += 1
            state = _RequestRank(self, self._generation, self._next_rank)
            ctx.set_state(state)
        return state.rank

    def _request_base(self, ctx: RequestContext) -> int:
        """The encoded rank of position 0 of the request: a key at ``position`` ranks ``base - position``."""
        return self._request_rank(ctx) * _SPAN + _TOP

    def _fresh_ranks(self, keys: Iterable[OffloadKey]) -> None:
        """Give the resident keys of ``keys`` fresh ranks in iteration order (a key listed twice keeps its later
        rank)."""
        chunks, fresh, placed = self._chunks, self._fresh, self._placed
        pop = fresh.pop
        rank = self._next_rank * _SPAN + _TOP
        for key in keys:
            if key in chunks:
                rank += _SPAN
                pop(key, None)
                if placed:
                    placed.pop(key, None)
                fresh[key] = rank
        self._next_rank = (rank - _TOP) // _SPAN

    def _place(self, ranked: list[tuple[OffloadKey, int]]) -> None:
        """Give resident keys the ranks by position in ``ranked``; the unblocked ones enter the heap."""
        keys = list(map(itemgetter(0), ranked))
        _drain(map(self._fresh.pop, keys, repeat(None)))
        self._placed.update(ranked)
        blocked = self._blocked
        self._push([(rank, key) for key, rank in ranked if key not in blocked])

    def _push(self, entries: list[tuple[int, OffloadKey]]) -> None:
        if not entries:
            return
        heap = self._heap
        if len(entries) >= max(64, len(heap) // 4):
            heap.extend(entries)
            heapq.heapify(heap)
        else:
            for entry in entries:
                heapq.heappush(heap, entry)
        if len(heap) >= max(64, 2 * len(self._placed)):
            placed, blocked = self._placed, self._blocked
            self._heap = [(rank, key) for key, rank in placed.items() if key not in blocked]
            heapq.heapify(self._heap)

    def _check_rank(self, key: OffloadKey, ctx: RequestContext | None) -> int | None:
        """``(request_rank, -position)`` encoded, or None without a recorded position."""
        if ctx is None:
            return None
        position = ctx.get_offload_key_position(key)
        if position is None:
            return None
        _check_positions([position])
        return self._request_base(ctx) - position

    # ------------------------------------------------------------------ the CachePolicy interface

    def insert(self, key: OffloadKey, chunk_id: int, ctx: RequestContext | None = None) -> None:
        """Add ``key`` (pending) at rank ``(request_rank, -position)`` when ``ctx`` records its position, else at
        a fresh rank (the most recent)."""
        rank = self._check_rank(key, ctx)
        self._chunks[key] = chunk_id
        self._blocked.add(key)
        if rank is None:
            self._fresh_ranks([key])
        else:
            self._fresh.pop(key, None)
            self._placed[key] = rank

    def insert_many(
        self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int], ctx: RequestContext | None = None
    ) -> None:
        """Insert distinct ``keys`` as :meth:`insert` one by one would, in bulk when all or none have a position."""
        n = len(keys)
        positions = None if ctx is None else list(map(ctx.positions.get, keys))
        if positions is not None and None in positions:
            if positions.count(None) != n:
                super().insert_many(keys, chunk_ids, ctx)  # mixed: rank order depends on the interleaving
                return
            positions = None
        self._chunks.update(zip(keys, chunk_ids, strict=True))
        self._blocked.update(keys)
        if positions is None or ctx is None:
            self._fresh_ranks(keys)
            return
        _check_positions(positions)
        fresh = self._fresh
        if not fresh.keys().isdisjoint(keys):
            _drain(map(fresh.pop, keys, repeat(None)))
        self._placed.update(zip(keys, map(self._request_base(ctx).__sub__, positions), strict=True))  # type: ignore[arg-type]

    def remove(self, key: OffloadKey) -> int | None:
        """Drop ``key`` and return its chunk id."""
        self._fresh.pop(key, None)
        self._placed.pop(key, None)
        self._blocked.discard(key)
        return self._chunks.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        """Give resident ``keys`` fresh ranks, ``keys[0]`` last (iterates the list reversed, as vLLM)."""
        self._fresh_ranks(reversed(keys))

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        """Raise each resident key with a recorded position to at least ``(request_rank, -position)``: a key
        the request uses is no older than the request's own chunks there (tails still precede heads). The request
        takes its rank here if it has none yet (vLLM)."""
        if ctx is None:
            return
        base = self._request_base(ctx)
        fresh_rank, placed_rank = self._fresh.get, self._placed.get
        get = ctx.positions.get
        raised: list[tuple[OffloadKey, int]] = [
            (key, wanted)
            for key in keys
            if (position := get(key)) is not None
            and ((rank := fresh_rank(key)) is not None or (rank := placed_rank(key)) is not None)
            and (wanted := base - position) > rank
        ]
        if raised:
            _check_positions([base - wanted for _, wanted in raised])
            self._place(raised)

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        """Nothing: vLLM touches the missed keys, and a touch leaves keys that are not resident alone."""
        return

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
        self.touch(order_request_keys(groups, ctx))

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        """Evict the ``n`` evictable, unprotected keys of lowest ``(rank, key)``, or nothing."""
        if n <= 0:
            check_evict_count(n)
            return []
        blocked, fresh = self._blocked, self._fresh
        selected: list[OffloadKey] = []
        if not self._heap:  # no key ranked by position is evictable: the fresh order alone
            for key in fresh:
                if key in blocked or key in protected:
                    continue
                selected.append(key)
                if len(selected) == n:
                    break
            else:
                return None
        elif not self._merge(n, protected, selected):
            return None
        _drain(map(fresh.pop, selected, repeat(None)))
        if self._placed:
            _drain(map(self._placed.pop, selected, repeat(None)))
        return list(zip(selected, map(self._chunks.pop, selected), strict=True))

    def _merge(self, n: int, protected: AbstractSet[OffloadKey], selected: list[OffloadKey]) -> bool:
        """Select the ``n`` lowest unprotected, unblocked keys of the fresh order and the heap into ``selected``;
        False (and nothing changed) when there are fewer."""
        heap, placed, blocked, fresh = self._heap, self._placed, self._blocked, self._fresh
        heappop = heapq.heappop
        deferred: list[tuple[int, OffloadKey]] = []
        from_heap: list[tuple[int, OffloadKey]] = []
        oldest = (item for item in fresh.items() if item[0] not in blocked and item[0] not in protected)
        a, a_rank = next(oldest, (None, 0))
        while len(selected) < n:
            while heap:  # the heap's lowest current, unprotected entry, if any
                b_rank, b = heap[0]
                if b not in blocked and placed.get(b) == b_rank:
                    if b not in protected:
                        break
                    deferred.append(heappop(heap))
                else:
                    heappop(heap)  # stale (or a duplicate of a selected key)
            if heap and (a is None or heap[0][0] < a_rank):
                entry = heappop(heap)
                key = entry[1]
                from_heap.append(entry)
            elif a is not None:
                key = a
                a, a_rank = next(oldest, (None, 0))
            else:
                break
            blocked.add(key)  # selected: later duplicates are stale
            selected.append(key)
        for entry in deferred:
            heapq.heappush(heap, entry)
        blocked.difference_update(selected)
        if len(selected) < n:
            for entry in from_heap:
                heapq.heappush(heap, entry)
            return False
        return True

    def clear(self) -> None:
        """Forget every key; ranks start over."""
        self._chunks.clear()
        self._blocked.clear()
        self._fresh.clear()
        self._placed.clear()
        self._heap.clear()
        self._next_rank = 0
        self._generation += 1

    def mark_evictable(self, key: OffloadKey) -> None:
        """Make resident ``key`` an eviction candidate at its current rank."""
        self.mark_evictable_many((key,))

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Exclude resident ``key`` from eviction while it is pinned."""
        if key in self._chunks:
            self._blocked.add(key)

    def mark_evictable_many(self, keys: Collection[OffloadKey]) -> None:
        """Make the resident ``keys`` eviction candidates at their current ranks."""
        blocked = self._blocked
        placed = self._placed
        entries = [(placed[key], key) for key in keys if key in blocked and key in placed] if placed else []
        blocked.difference_update(keys)
        self._push(entries)

    def mark_non_evictable_many(self, keys: Collection[OffloadKey]) -> None:
        """Exclude the ``keys`` from eviction while they are pinned."""
        self._blocked.update(self._chunks.keys() & keys)


def _check_positions(positions: Sequence[object]) -> None:
    """Refuse a recorded position that is not a token count in ``[0, _TOP]`` (checked in bulk, named if bad)."""
    if not positions:
        return
    if set(map(type, positions)) == {int}:
        ints = cast("Sequence[int]", positions)
        if min(ints) >= 0 and max(ints) <= _TOP:
            return
    for position in positions:
        if not isinstance(position, int) or not 0 <= position <= _TOP:
            raise ConfigError(f"offload key position must be a token count in [0, {_TOP}], got {position!r}")
