"""Adaptive Replacement Cache eviction, behaviour-compatible with vLLM 0.33's ``arc`` cache policy.

vLLM's ARC with its T1/T2 lists, B1/B2 ghosts, float ``target_t1_size`` and single forward-scan eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import ClassVar

from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager.policies._base import CachePolicy, check_evict_count, request_finished_args
from kvoffload.offload.manager.policies._context import RequestContext, order_request_keys

__all__ = ["ARCPolicy"]


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache as in vLLM 0.33: recency list T1, frequency list T2, ghosts B1/B2.

    ``t1``/``t2`` map resident keys to chunk ids and ``b1``/``b2`` remember recently evicted keys, all
    least recent first; ghost hits move ``target_t1_size`` (a float) towards recency or frequency, and
    :meth:`evict` takes from T1 while ``|T1| >= int(target_t1_size)``. The four OrderedDicts are public
    for inspection; mutate them only through the methods.
    """

    __slots__ = ("_blocked", "_pending", "b1", "b2", "t1", "t2", "target_t1_size")

    name: ClassVar[str] = "arc"

    def __init__(self, capacity: int) -> None:
        """Create an empty ARC policy; ghost lists are each bounded by ``capacity``."""
        super().__init__(capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, int] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, int] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._pending: set[OffloadKey] = set()  # inserted, store not completed yet (vLLM ref_cnt == -1)
        self._blocked: set[OffloadKey] = set()  # pending or pinned (vLLM ref_cnt != 0)

    def __len__(self) -> int:
        """Return the number of resident keys (``|T1| + |T2|``)."""
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        """Tell whether ``key`` is resident in T1 or T2."""
        return key in self.t1 or key in self.t2

    def get(self, key: OffloadKey) -> int | None:
        """Return the chunk id of ``key`` from T1 or T2, or ``None``."""
        chunk_id = self.t1.get(key)
        return self.t2.get(key) if chunk_id is None else chunk_id

    def insert(self, key: OffloadKey, chunk_id: int, ctx: RequestContext | None = None) -> None:
        """Add ``key`` (pending) at the T1 tail and forget it from the ghost lists."""
        self.t2.pop(key, None)
        t1 = self.t1
        t1.pop(key, None)
        t1[key] = chunk_id
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        self._pending.add(key)
        self._blocked.add(key)

    def insert_many(
        self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int], ctx: RequestContext | None = None
    ) -> None:
        """Insert new keys at the T1 tail in order, batched when none of them is resident yet."""
        t1 = self.t1
        if len(keys) != len(chunk_ids) or not t1.keys().isdisjoint(keys) or not self.t2.keys().isdisjoint(keys):
            super().insert_many(keys, chunk_ids, ctx)
            return
        t1.update(zip(keys, chunk_ids, strict=True))
        for ghosts in (self.b1, self.b2):
            if ghosts:
                pop = ghosts.pop
                for key in keys:
                    pop(key, None)
        self._pending.update(keys)
        self._blocked.update(keys)

    def remove(self, key: OffloadKey) -> int | None:
        """Drop ``key`` from T1 or T2 (ghosts untouched) and return its chunk id."""
        self._pending.discard(key)
        self._blocked.discard(key)
        chunk_id = self.t1.pop(key, None)
        return self.t2.pop(key, None) if chunk_id is None else chunk_id

    def _adapt_to_ghost_hit(self, key: OffloadKey) -> None:
        """Shift ``target_t1_size`` on a ghost hit: B1 favours recency (up), B2 frequency (down)."""
        b1 = self.b1
        b2 = self.b2
        if key in b1:
            delta = max(1.0, len(b2) / len(b1))
            self.target_t1_size = float(min(self.target_t1_size + delta, self.capacity))
            b1.move_to_end(key)
        elif key in b2:
            delta = max(1.0, len(b1) / len(b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0.0)
            b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        """Learn from offered keys that are ghosts, before insertion forgets them (reverse order)."""
        if not self.b1 and not self.b2:
            return
        adapt = self._adapt_to_ghost_hit
        for key in reversed(keys):
            adapt(key)

    def touch(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        """Apply accesses in reverse: ready T1 keys move to the T2 tail, pending ones to the T1 tail, T2
        keys to the T2 tail, and absent keys adapt the target if they are ghosts."""
        t1 = self.t1
        t2 = self.t2
        pending = self._pending
        for key in reversed(keys):
            chunk_id = t1.pop(key, None)
            if chunk_id is not None:
                if key in pending:
                    t1[key] = chunk_id  # a store in flight is not a second access
                else:
                    t2[key] = chunk_id
            elif key in t2:
                t2.move_to_end(key)
            else:
                self._adapt_to_ghost_hit(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]] | Sequence[OffloadKey],
        insertion_only: AbstractSet[OffloadKey],
        reused: AbstractSet[OffloadKey] | None = None,
        ctx: RequestContext | None = None,
    ) -> None:
        """Apply a finished request tail to head (:func:`order_request_keys` reversed): an insertion-only key
        only moves to the tail of its list (a store is not a frequency hit); a reused key counts as one access
        (T1 -> T2 tail, or T2 tail); other keys are left alone. Pins are not consulted (vLLM 0.33)."""
        groups, insertion_only, reused = request_finished_args(key_groups, insertion_only, reused)
        t1 = self.t1
        t2 = self.t2
        for key in reversed(order_request_keys(groups, ctx)):
            if key in insertion_only:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused:
                chunk_id = t1.pop(key, None)
                if chunk_id is not None:
                    t2[key] = chunk_id
                elif key in t2:
                    t2.move_to_end(key)

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        """Pick ``n`` victims with vLLM's single forward scan over T1 and T2, then move them to B1/B2.

        Per victim: if the virtual ``|T1|`` is at least ``int(target_t1_size)`` take the next evictable
        T1 entry, else (or if none) the next T2 entry, else the next T1 entry; entries skipped once are
        never revisited. Ghost lists are then trimmed to ``capacity`` (oldest first).
        """
        if n <= 0:
            check_evict_count(n)
            return []
        blocked = self._blocked
        target = int(self.target_t1_size)
        virtual_t1 = len(self.t1)
        t1_items = iter(self.t1.items())
        t2_items = iter(self.t2.items())
        victims: list[tuple[OffloadKey, int]] = []
        from_t1: list[bool] = []

        def next_victim(items: Iterator[tuple[OffloadKey, int]]) -> tuple[OffloadKey, int] | None:
            # Shared forward iterators: an entry skipped once is never revisited (vLLM's single pass).
            for item in items:
                if item[0] not in blocked and item[0] not in protected:
                    return item
            return None

        for _ in range(n):
            victim = next_victim(t1_items) if virtual_t1 >= target else None
            in_t1 = victim is not None
            if victim is None:
                victim = next_victim(t2_items)
            if victim is None:
                victim = next_victim(t1_items)
                in_t1 = victim is not None
                if victim is None:
                    return None
            victims.append(victim)
            from_t1.append(in_t1)
            if in_t1:
                virtual_t1 -= 1
        t1 = self.t1
        t2 = self.t2
        b1 = self.b1
        b2 = self.b2
        for (key, _), in_t1 in zip(victims, from_t1, strict=True):
            if in_t1:
                del t1[key]
                b1[key] = None
            else:
                del t2[key]
                b2[key] = None
        capacity = self.capacity
        for ghosts in (b1, b2):
            for _ in range(len(ghosts) - capacity):
                ghosts.popitem(last=False)
        return victims

    def clear(self) -> None:
        """Forget all resident and ghost keys and reset the target to 0."""
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self._pending.clear()
        self._blocked.clear()
        self.target_t1_size = 0.0

    def mark_evictable(self, key: OffloadKey) -> None:
        """Mark ``key`` ready and unpinned (vLLM ``ref_cnt == 0``)."""
        self._pending.discard(key)
        self._blocked.discard(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Mark resident ``key`` pinned (vLLM ``ref_cnt > 0``)."""
        if key in self.t1 or key in self.t2:
            self._blocked.add(key)

    def mark_evictable_many(self, keys: Collection[OffloadKey]) -> None:
        """Mark ``keys`` ready and unpinned with two set operations."""
        self._pending.difference_update(keys)
        self._blocked.difference_update(keys)

    def mark_non_evictable_many(self, keys: Collection[OffloadKey]) -> None:
        """Mark the resident ``keys`` pinned."""
        t1 = self.t1
        t2 = self.t2
        self._blocked.update(key for key in keys if key in t1 or key in t2)
