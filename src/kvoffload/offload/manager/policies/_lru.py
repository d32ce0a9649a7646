"""Least-recently-used eviction, behaviour-compatible with vLLM 0.33's ``lru`` cache policy."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from collections.abc import Set as AbstractSet
from typing import ClassVar

from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager.policies._base import CachePolicy, check_evict_count

__all__ = ["LRUPolicy"]


class LRUPolicy(CachePolicy):
    """Exact least-recently-used order by insertion and touch (vLLM 0.33 ``lru`` without position hints).

    One OrderedDict holds every resident key, least recent first; eviction scans from the front,
    skipping pending, pinned and protected keys, which equals vLLM's lazy rank heap over evictable keys.
    """

    __slots__ = ("_blocked", "_order")

    name: ClassVar[str] = "lru"

    def __init__(self, capacity: int) -> None:
        """Create an empty LRU policy for ``capacity`` chunks."""
        super().__init__(capacity)
        self._order: OrderedDict[OffloadKey, int] = OrderedDict()
        self._blocked: set[OffloadKey] = set()  # resident keys that are pending or pinned

    def __len__(self) -> int:
        """Return the number of resident keys."""
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        """Tell whether ``key`` is resident."""
        return key in self._order

    def lru_order(self) -> list[OffloadKey]:
        """Return the resident keys, least recently used first (for inspection and tests)."""
        return list(self._order)

    def get(self, key: OffloadKey) -> int | None:
        """Return the chunk id of ``key`` or ``None``."""
        return self._order.get(key)

    def insert(self, key: OffloadKey, chunk_id: int) -> None:
        """Add ``key`` (pending) as the most recently used entry."""
        order = self._order
        order[key] = chunk_id
        order.move_to_end(key)
        self._blocked.add(key)

    def insert_many(self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int]) -> None:
        """Insert new keys in order with one C-level update when none of them is resident yet."""
        order = self._order
        if len(keys) != len(chunk_ids) or not order.keys().isdisjoint(keys):
            super().insert_many(keys, chunk_ids)
            return
        order.update(zip(keys, chunk_ids, strict=True))
        self._blocked.update(keys)

    def remove(self, key: OffloadKey) -> int | None:
        """Drop ``key`` and return its chunk id."""
        self._blocked.discard(key)
        return self._order.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Make resident ``keys`` most recent, ``keys[0]`` last (iterates the list reversed, as vLLM)."""
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        """Evict the ``n`` least recent evictable, unprotected keys, or nothing."""
        if n <= 0:
            check_evict_count(n)
            return []
        blocked = self._blocked
        victims: list[tuple[OffloadKey, int]] = []
        append = victims.append
        for item in self._order.items():
            key = item[0]
            if key in blocked or key in protected:
                continue
            append(item)
            if len(victims) == n:
                break
        else:
            return None
        order = self._order
        for key, _ in victims:
            del order[key]
        return victims

    def clear(self) -> None:
        """Forget every key."""
        self._order.clear()
        self._blocked.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        """Make ``key`` an eviction candidate again; its recency is unchanged (as vLLM's rank)."""
        self._blocked.discard(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Exclude resident ``key`` from eviction while it is pinned."""
        if key in self._order:
            self._blocked.add(key)

    def mark_evictable_many(self, keys: Collection[OffloadKey]) -> None:
        """Make ``keys`` eviction candidates again with one set operation."""
        self._blocked.difference_update(keys)

    def mark_non_evictable_many(self, keys: Collection[OffloadKey]) -> None:
        """Exclude the resident ``keys`` from eviction with one set operation."""
        self._blocked.update(self._order.keys() & keys)
