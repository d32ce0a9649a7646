"""HostBlockManager against the vLLM 0.33 CPUOffloadingManager scenarios.

Expected chunk ids, evictions and events are derived by hand from the documented rules: fresh ids in
increasing order, then the LIFO free list; offered keys are protected; LRU touch is applied reversed.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.keys import make_offload_key
from kvoffload.offload.manager import HostBlockManager, LookupResult, ManagerStats, OffloadEvent, StorePlan
from kvoffload.offload.manager.policies import ARCPolicy, LRUPolicy

MISS = LookupResult.MISS
HIT = LookupResult.HIT
PENDING = LookupResult.HIT_PENDING


def k(i: int) -> bytes:
    """Key ``i`` as vLLM's tests build it: ``make_offload_key(str(i).encode(), 0)``."""
    return make_offload_key(str(i).encode(), 0)


def ks(ids: Sequence[int]) -> list[bytes]:
    return [k(i) for i in ids]


def plan(manager: HostBlockManager, ids: Sequence[int], **kwargs: str) -> StorePlan:
    result = manager.prepare_store(ks(ids), **kwargs)
    assert result is not None
    return result


def check_plan(result: StorePlan | None, to_store: list[int], chunk_ids: list[int], evicted: list[int]) -> None:
    assert result is not None
    assert result.keys_to_store == ks(to_store)
    assert result.chunk_ids == chunk_ids
    assert result.evicted_keys == ks(evicted)


def stored(ids: Sequence[int]) -> OffloadEvent:
    return OffloadEvent(tuple(ks(ids)), removed=False)


def removed(ids: Sequence[int], *, metadata_only: bool = False) -> OffloadEvent:
    return OffloadEvent(tuple(ks(ids)), removed=True, metadata_only=metadata_only)


def arc_of(manager: HostBlockManager) -> ARCPolicy:
    policy = manager.policy
    assert isinstance(policy, ARCPolicy)
    return policy


# --------------------------------------------------------------------------- the LRU scenario


def test_lru_capacity_4_scenario() -> None:
    m = HostBlockManager(4, "lru", enable_events=True)

    check_plan(m.prepare_store(ks([1, 2])), [1, 2], [0, 1], [])
    assert [m.lookup(k(1)), m.lookup(k(2))] == [PENDING, PENDING]
    assert m.take_events() == []

    m.complete_store(ks([1, 2]))
    assert m.take_events() == [stored([1, 2])]
    assert [m.lookup(k(1)), m.lookup(k(2)), m.lookup(k(3))] == [HIT, HIT, MISS]

    # 2 is already stored (and protected); 3, 4, 5 need one eviction: 1 is the LRU key.
    check_plan(m.prepare_store(ks([2, 3, 4, 5])), [3, 4, 5], [2, 3, 0], [1])
    assert m.take_events() == [removed([1])]

    # No room: 3, 4, 5 are pending and 2 is the only evictable chunk.
    assert m.prepare_store(ks([1, 6])) is None

    m.complete_store(ks([2, 3, 4, 5]))
    assert [m.lookup(k(i)) for i in (1, 2, 3, 4, 5, 0)] == [MISS, HIT, HIT, HIT, HIT, MISS]

    assert m.prepare_load(ks([2, 3])) == [1, 2]
    assert m.prepare_store(ks([6, 7, 8])) is None  # 2 and 3 are pinned: only 4, 5 evictable
    m.complete_load(ks([2, 3]))

    # The free list is a stack: freed 1, 2, 3 (chunk ids of 2, 3, 4) are handed out as 3, 2, 1.
    check_plan(m.prepare_store(ks([6, 7, 8])), [6, 7, 8], [3, 2, 1], [2, 3, 4])
    m.complete_store(ks([6, 7, 8]))

    m.touch(ks([5, 6, 7]))  # LRU order becomes 8, 7, 6, 5
    check_plan(m.prepare_store(ks([9])), [9], [1], [8])

    m.complete_store(ks([7, 9]), success=False)  # 7 is ready: untouched; 9 is dropped
    assert m.lookup(k(7)) == HIT
    assert m.lookup(k(9)) == MISS
    assert m.take_events() == [
        stored([3, 4, 5]),
        removed([2, 3, 4]),
        stored([6, 7, 8]),
        removed([8]),
        removed([9], metadata_only=True),
    ]
    assert m.take_events() == []
    # chunk 1 (key 9's) went back to the free list
    assert m.num_free_chunks == 1
    check_plan(m.prepare_store(ks([10])), [10], [1], [])


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_offered_stored_key_is_protected_from_eviction(policy: str) -> None:
    m = HostBlockManager(4, policy, enable_events=True)
    m.prepare_store(ks([1, 2]))
    m.complete_store(ks([1, 2]))
    m.touch(ks([1]))  # 2 becomes the first eviction candidate
    check_plan(m.prepare_store(ks([2, 3, 4, 5])), [3, 4, 5], [2, 3, 0], [1])
    m.complete_store(ks([2, 3, 4, 5]))
    assert m.lookup(k(2)) == HIT
    assert m.lookup(k(1)) == MISS
    assert m.take_events() == [stored([1, 2]), removed([1]), stored([3, 4, 5])]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_protection_can_make_eviction_fail_without_side_effects(policy: str) -> None:
    m = HostBlockManager(2, policy, enable_events=True)
    m.prepare_store(ks([1, 2]))
    m.complete_store(ks([1, 2]))
    m.prepare_load(ks([2]))
    m.take_events()
    # need 1 eviction, 1 evictable chunk (key 1), but key 1 is part of the offer
    assert m.num_evictable_chunks == 1
    assert m.prepare_store(ks([1, 3])) is None
    assert [m.lookup(k(1)), m.lookup(k(2)), m.lookup(k(3))] == [HIT, HIT, MISS]
    assert len(m) == 2
    assert m.num_evictable_chunks == 1
    assert m.take_events() == []
    check_plan(m.prepare_store(ks([3])), [3], [0], [1])


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_prepare_load_preserves_key_order(policy: str) -> None:
    m = HostBlockManager(4, policy)
    m.prepare_store(ks([0, 1, 2, 3]))
    m.complete_store(ks([0, 1, 2, 3]))
    m.prepare_store(ks([9]))  # evicts 0 (chunk 0) and takes its chunk
    m.complete_store(ks([9]))
    assert m.prepare_load(ks([1, 2, 3])) == [1, 2, 3]
    m.complete_load(ks([3, 2, 1]))  # release order is irrelevant
    assert m.prepare_load(ks([2, 9, 3, 1])) == [2, 0, 3, 1]
    m.complete_load(ks([1, 2, 3, 9]))
    assert m.prepare_load([]) == []
    assert not m.has_pending_work()


# --------------------------------------------------------------------------- ARC scenarios


def test_arc_basic() -> None:
    m = HostBlockManager(4, "arc", enable_events=True)
    arc = arc_of(m)
    check_plan(m.prepare_store(ks([1, 2])), [1, 2], [0, 1], [])
    assert [m.lookup(k(1)), m.lookup(k(2))] == [PENDING, PENDING]
    assert m.take_events() == []
    m.complete_store(ks([1, 2]))
    assert m.take_events() == [stored([1, 2])]
    assert [m.lookup(k(1)), m.lookup(k(2)), m.lookup(k(3))] == [HIT, HIT, MISS]
    assert list(arc.t1) == ks([1, 2])
    assert list(arc.t2) == []


def test_arc_touch_promotes_t1_to_t2_only_when_ready() -> None:
    m = HostBlockManager(4, "arc")
    arc = arc_of(m)
    m.prepare_store(ks([1]))
    m.complete_store(ks([1]))
    assert k(1) in arc.t1
    m.touch(ks([1]))
    assert k(1) not in arc.t1
    assert list(arc.t2) == ks([1])
    m.prepare_store(ks([2, 3]))
    m.touch(ks([2]))  # pending: a store in flight is not a second access
    assert list(arc.t1) == ks([3, 2])
    assert list(arc.t2) == ks([1])


def test_arc_eviction_with_load() -> None:
    m = HostBlockManager(4, "arc", enable_events=True)
    arc = arc_of(m)
    check_plan(m.prepare_store(ks([1, 2, 3, 4])), [1, 2, 3, 4], [0, 1, 2, 3], [])
    m.complete_store(ks([1, 2, 3, 4]))
    assert m.prepare_load(ks([2, 3])) == [1, 2]
    assert m.prepare_store(ks([5, 6, 7])) is None  # 2, 3 pinned
    m.complete_load(ks([2, 3]))
    check_plan(m.prepare_store(ks([5, 6, 7])), [5, 6, 7], [2, 1, 0], [1, 2, 3])
    assert list(arc.b1) == ks([1, 2, 3])
    assert list(arc.t1) == ks([4, 5, 6, 7])


def test_arc_b1_ghost_touch_raises_target() -> None:
    m = HostBlockManager(2, "arc")
    arc = arc_of(m)
    m.prepare_store(ks([1, 2]))
    m.complete_store(ks([1, 2]))
    assert arc.target_t1_size == 0.0
    check_plan(m.prepare_store(ks([3])), [3], [0], [1])
    m.complete_store(ks([3]))
    assert list(arc.b1) == ks([1])
    m.touch(ks([1]))  # ghost hit in B1: + max(1, 0 / 1)
    assert arc.target_t1_size == 1.0
    assert m.lookup(k(1)) == MISS


def test_arc_store_miss_adapts_before_insert_forgets_the_ghost() -> None:
    m = HostBlockManager(4, "arc")
    arc = arc_of(m)
    m.prepare_store(ks([1, 2, 3, 4]))
    m.complete_store(ks([1, 2, 3, 4]))
    check_plan(m.prepare_store(ks([5])), [5], [0], [1])
    m.complete_store(ks([5]))
    assert list(arc.b1) == ks([1])
    # offering ghost 1 again: target 0 -> 1 (so |T1| = 4 >= 1 still evicts from T1: key 2)
    check_plan(m.prepare_store(ks([1])), [1], [1], [2])
    assert arc.target_t1_size == 1.0
    assert list(arc.b1) == ks([2])
    assert list(arc.t1) == ks([3, 4, 5, 1])


def test_arc_store_miss_is_observed_once_per_request() -> None:
    m = HostBlockManager(4, "arc")
    arc = arc_of(m)
    m.prepare_store(ks([1, 2, 3, 4]))
    m.complete_store(ks([1, 2, 3, 4]))
    m.prepare_store(ks([5]))  # evicts 1 into B1
    m.complete_store(ks([5]))
    m.prepare_load(ks([2, 3, 4, 5]))  # nothing evictable any more
    assert m.prepare_store(ks([1]), request_id="r") is None
    assert arc.target_t1_size == 1.0
    assert m.prepare_store(ks([1]), request_id="r") is None  # retry of the same request
    assert arc.target_t1_size == 1.0
    assert m.prepare_store(ks([1]), request_id="other") is None
    assert arc.target_t1_size == 2.0
    assert m.prepare_store(ks([1])) is None  # no request id: every call is its own request
    assert arc.target_t1_size == 3.0
    m.on_request_finished([], [], request_id="r")  # forgets what "r" reported
    assert m.prepare_store(ks([1]), request_id="r") is None
    assert arc.target_t1_size == 4.0


def test_arc_b2_ghost_touch_lowers_target() -> None:
    m = HostBlockManager(2, "arc")
    arc = arc_of(m)
    m.prepare_store(ks([1, 2]))
    m.complete_store(ks([1, 2]))
    m.touch(ks([1, 2]))  # T2 = [2, 1]
    check_plan(m.prepare_store(ks([3])), [3], [1], [2])  # T1 empty: evict T2's LRU (2)
    m.complete_store(ks([3]))
    check_plan(m.prepare_store(ks([4])), [4], [1], [3])  # |T1| = 1 >= 0: evict 3 into B1
    m.complete_store(ks([4]))
    assert (list(arc.b1), list(arc.b2)) == (ks([3]), ks([2]))
    m.touch(ks([3]))  # B1 hit: + max(1, 1 / 1)
    assert arc.target_t1_size == 1.0
    m.touch(ks([2]))  # B2 hit: - max(1, 1 / 1)
    assert arc.target_t1_size == 0.0


def test_arc_target_decides_between_t1_and_t2() -> None:
    m = HostBlockManager(4, "arc")
    arc = arc_of(m)
    m.prepare_store(ks([1, 2, 3, 4]))
    m.complete_store(ks([1, 2, 3, 4]))
    m.touch(ks([3, 4]))
    assert (list(arc.t1), list(arc.t2)) == (ks([1, 2]), ks([4, 3]))
    arc.target_t1_size = 1
    check_plan(m.prepare_store(ks([5])), [5], [0], [1])
    m.complete_store(ks([5]))
    assert list(arc.b1) == ks([1])
    assert list(arc.t1) == ks([2, 5])
    arc.target_t1_size = 3.0  # |T1| = 2 < 3: evict T2's LRU (4)
    check_plan(m.prepare_store(ks([6])), [6], [3], [4])
    assert list(arc.b2) == ks([4])


def test_arc_ghost_lists_bounded_by_capacity() -> None:
    m = HostBlockManager(2, "arc")
    arc = arc_of(m)
    m.prepare_store(ks([1, 2]))
    m.complete_store(ks([1, 2]))
    for i in range(3, 20):
        result = plan(m, [i])
        assert result.evicted_keys == ks([i - 2])
        m.complete_store(ks([i]))
        assert len(arc.b1) <= 2
        assert len(arc.b2) <= 2
    assert list(arc.b1) == ks([16, 17])
    assert list(arc.t1) == ks([18, 19])


def test_arc_touch_ordering() -> None:
    m = HostBlockManager(4, "arc")
    arc = arc_of(m)
    m.prepare_store(ks([1, 2, 3, 4]))
    m.complete_store(ks([1, 2, 3, 4]))
    m.touch(ks([3, 4]))
    m.touch(ks([1, 3, 4]))  # reversed: 4, 3 to the T2 tail, then 1 promoted: T2 = [4, 3, 1]
    assert list(arc.t1) == ks([2])
    assert list(arc.t2) == ks([4, 3, 1])
    check_plan(m.prepare_store(ks([5])), [5], [1], [2])  # 2's chunk is reused


def test_arc_failed_store() -> None:
    m = HostBlockManager(4, "arc", enable_events=True)
    arc = arc_of(m)
    m.prepare_store(ks([1, 2, 3, 4]))
    m.complete_store(ks([1, 2, 3, 4]))
    check_plan(m.prepare_store(ks([5])), [5], [0], [1])
    m.complete_store(ks([5]), success=False)
    assert m.lookup(k(5)) == MISS
    assert k(5) not in arc.t1
    assert k(5) not in arc.t2
    assert k(1) in arc.b1
    assert k(5) not in arc.b1
    assert m.take_events() == [stored([1, 2, 3, 4]), removed([1]), removed([5], metadata_only=True)]
    check_plan(m.prepare_store(ks([6])), [6], [0], [])  # the freed chunk, no eviction


def test_arc_full_scenario() -> None:
    m = HostBlockManager(4, "arc", enable_events=True)
    arc = arc_of(m)
    check_plan(m.prepare_store(ks([1, 2])), [1, 2], [0, 1], [])
    m.complete_store(ks([1, 2]))
    check_plan(m.prepare_store(ks([3, 4, 5])), [3, 4, 5], [2, 3, 0], [1])
    m.complete_store(ks([3, 4, 5]))
    m.touch(ks([2, 3]))
    assert (list(arc.t1), list(arc.t2)) == (ks([4, 5]), ks([3, 2]))
    check_plan(m.prepare_store(ks([6])), [6], [3], [4])
    m.complete_store(ks([6]))
    assert [m.lookup(k(i)) for i in (2, 3, 4, 5, 6)] == [HIT, HIT, MISS, HIT, HIT]
    assert m.take_events() == [
        stored([1, 2]),
        removed([1]),
        stored([3, 4, 5]),
        removed([4]),
        stored([6]),
    ]


def test_on_request_finished_feeds_the_policy() -> None:
    lru = HostBlockManager(4, "lru")
    lru.prepare_store(ks([1, 2, 3]))
    lru.complete_store(ks([1, 2, 3]))
    lru.on_request_finished(ks([3, 1]), {k(1)})  # LRU: like touch, keys[0] most recent
    policy = lru.policy
    assert isinstance(policy, LRUPolicy)
    assert policy.lru_order() == ks([2, 1, 3])

    arc_manager = HostBlockManager(4, "arc")
    arc_manager.prepare_store(ks([1, 2, 3]))
    arc_manager.complete_store(ks([1, 2, 3]))
    arc_manager.on_request_finished(ks([1, 2]), [k(1)])  # a list of reused keys works too
    arc = arc_of(arc_manager)
    assert list(arc.t1) == ks([3, 2])  # 2 was the request's own store: recency only
    assert list(arc.t2) == ks([1])  # 1 was reused: one more access


# --------------------------------------------------------------------------- store threshold


def test_store_threshold_counts_offers() -> None:
    m = HostBlockManager(4, "lru", store_threshold=2, max_tracker_size=3, enable_events=True)
    check_plan(m.prepare_store(ks([1, 2])), [], [], [])  # first offer: counted, not stored
    assert m.store_counts == {k(1): 1, k(2): 1}
    assert m.lookup(k(1)) == MISS  # lookups do not count in 0.33.0
    assert m.store_counts == {k(1): 1, k(2): 1}
    check_plan(m.prepare_store(ks([1])), [1], [0], [])  # second offer of 1
    assert m.store_counts == {k(2): 1, k(1): 2}
    # tracker is full at 3: 4 evicts the oldest tracked key (2), never a key of this offer
    check_plan(m.prepare_store(ks([3, 4])), [], [], [])
    assert m.store_counts == {k(1): 2, k(3): 1, k(4): 1}
    check_plan(m.prepare_store(ks([2])), [], [], [])  # 2 starts over at 1
    assert m.store_counts == {k(3): 1, k(4): 1, k(2): 1}
    # all tracked keys are in this offer: 5 cannot be tracked (count 0) and is skipped
    check_plan(m.prepare_store(ks([3, 4, 2, 5])), [3, 4, 2], [1, 2, 3], [])
    assert m.store_counts == {k(3): 2, k(4): 2, k(2): 2}
    stats = m.stats()
    assert stats.stores_skipped == 2 + 2 + 1 + 1
    assert stats.allocation_sizes == (1, 3)
    assert m.stats().stores_skipped == 0
    m.complete_store(ks([1]))
    check_plan(m.prepare_store(ks([1])), [], [], [])  # resident: neither stored nor skipped
    assert m.stats().stores_skipped == 0
    assert m.take_events() == [stored([1])]


def test_store_threshold_skipped_counter_vllm_case() -> None:
    m = HostBlockManager(4, "lru", store_threshold=2)
    check_plan(m.prepare_store(ks([1, 2, 3])), [], [], [])
    assert m.stats().stores_skipped == 3
    assert m.stats().stores_skipped == 0


@pytest.mark.parametrize("threshold", [0, 1])
def test_threshold_below_two_stores_on_first_offer(threshold: int) -> None:
    m = HostBlockManager(4, "lru", store_threshold=threshold)
    check_plan(m.prepare_store(ks([1, 2])), [1, 2], [0, 1], [])
    assert m.store_counts == {}
    assert m.stats().stores_skipped == 0


# --------------------------------------------------------------------------- gauges and counters


def test_usage_gauges() -> None:
    assert HostBlockManager(0).stats().usage == 0.0
    m = HostBlockManager(4)
    assert m.stats().usage == 0.0
    m.prepare_store(ks([1, 2]))
    s = m.stats()
    assert (s.usage, s.write_usage, s.read_usage) == (0.5, 0.5, 0.0)
    assert s.allocation_sizes == (2,)
    m.prepare_store(ks([3, 4]))
    assert m.stats().usage == 1.0
    m.complete_store(ks([1, 2, 3, 4]))
    s = m.stats()
    assert (s.usage, s.write_usage, s.read_usage, s.allocation_sizes) == (0.0, 0.0, 0.0, ())
    m.prepare_load(ks([1]))
    s = m.stats()
    assert (s.usage, s.write_usage, s.read_usage) == (0.25, 0.0, 0.25)
    assert s.num_chunks == 4


def test_counters() -> None:
    m = HostBlockManager(2, "lru")
    m.lookup(k(1))
    m.prepare_store(ks([1, 2]))
    m.lookup(k(1))
    m.complete_store(ks([1, 2]))
    m.lookup(k(2))
    m.prepare_load(ks([1, 1, 2]))
    m.complete_load(ks([1, 1, 2]))
    m.prepare_store(ks([3]))
    m.complete_store(ks([3]), success=False)
    m.reset()  # keeps the cumulative counters
    s = m.stats()
    assert s == ManagerStats(
        num_chunks=2,
        usage=0.0,
        write_usage=0.0,
        read_usage=0.0,
        allocation_sizes=(2, 1),
        stores_skipped=0,
        lookups=3,
        hits=2,  # one HIT_PENDING, one HIT
        misses=1,
        stored=2,
        evicted=1,
        load_pins=3,
    )


# --------------------------------------------------------------------------- evictable bookkeeping


def test_evictable_bookkeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    m = HostBlockManager(4, "lru")
    assert m.num_evictable_chunks == 0
    m.prepare_store(ks([1, 2, 3]))
    assert m.num_evictable_chunks == 0
    m.complete_store(ks([1, 2, 3]))
    assert m.num_evictable_chunks == 3

    m.prepare_load(ks([1]))
    assert m.num_evictable_chunks == 2
    m.prepare_load(ks([1]))  # second concurrent load: no double decrement
    assert m.num_evictable_chunks == 2
    m.complete_load(ks([1]))
    assert m.num_evictable_chunks == 2
    m.complete_load(ks([1]))
    assert m.num_evictable_chunks == 3

    # 1 free chunk, 3 keys: evict 2; the pins did not refresh 1's recency, so 1 and 2 go
    check_plan(m.prepare_store(ks([4, 5, 6])), [4, 5, 6], [3, 1, 0], [1, 2])
    assert m.num_evictable_chunks == 1

    m.complete_store(ks([4, 5, 6]), success=False)
    assert m.num_evictable_chunks == 1
    assert m.num_free_chunks == 3

    m.reset()
    assert m.num_evictable_chunks == 0
    assert m.num_free_chunks == 4
    assert m.lookup(k(3)) == MISS

    check_plan(m.prepare_store(ks([10, 11, 12])), [10, 11, 12], [0, 1, 2], [])
    m.complete_store(ks([10, 11, 12]))
    m.prepare_load(ks([10, 11, 12]))
    assert m.num_evictable_chunks == 0

    calls: list[int] = []
    original = LRUPolicy.evict

    def spy(self: LRUPolicy, n: int, protected: object) -> object:
        calls.append(n)
        return original(self, n, protected)  # type: ignore[arg-type]

    monkeypatch.setattr(LRUPolicy, "evict", spy)
    assert m.prepare_store(ks([14, 15])) is None
    assert calls == []  # nothing evictable: refused before asking the policy

    m.complete_load(ks([10, 11, 12]))
    assert m.num_evictable_chunks == 3
    check_plan(m.prepare_store(ks([14, 15])), [14, 15], [3, 0], [10])
    assert calls == [1]
    assert m.num_evictable_chunks == 2
    m.complete_store(ks([14, 15]))
    assert m.num_evictable_chunks == 4


def test_has_pending_work() -> None:
    m = HostBlockManager(4)
    assert not m.has_pending_work()
    m.prepare_store(ks([1]))
    assert m.has_pending_work()
    m.complete_store(ks([1]))
    assert not m.has_pending_work()
    m.prepare_load(ks([1]))
    assert m.has_pending_work()
    m.complete_load(ks([1]))
    assert not m.has_pending_work()


# --------------------------------------------------------------------------- events


def test_metadata_only_removals_are_filtered_to_absent_keys() -> None:
    m = HostBlockManager(4, enable_events=True)
    check_plan(m.prepare_store(ks([1, 2])), [1, 2], [0, 1], [])
    m.complete_store(ks([1, 2]), success=False)
    check_plan(m.prepare_store(ks([1])), [1], [2], [])  # retried: a never-used chunk comes first
    assert m.take_events() == [removed([2], metadata_only=True)]
    m.complete_store(ks([1]))
    assert m.take_events() == [stored([1])]

    m.prepare_store(ks([3]))
    m.complete_store(ks([3]), success=False)
    m.prepare_store(ks([3]))
    assert m.take_events() == []  # the whole removal is dropped


def test_events_disabled() -> None:
    m = HostBlockManager(1)
    m.prepare_store(ks([1]))
    m.complete_store(ks([1]))
    m.prepare_store(ks([2]))
    assert m.take_events() == []


def test_event_defaults() -> None:
    event = OffloadEvent((k(1),), removed=True)
    assert event.medium == "CPU"
    assert event.metadata_only is False
    with pytest.raises(AttributeError):
        event.removed = False  # type: ignore[misc]


# --------------------------------------------------------------------------- misuse and edges


def test_prepare_load_errors_name_the_key_and_leave_no_pins() -> None:
    m = HostBlockManager(2)
    m.prepare_store(ks([1]))
    m.complete_store(ks([1]))
    m.prepare_store(ks([2]))
    with pytest.raises(InvalidStateError, match="not stored") as info:
        m.prepare_load(ks([1, 7]))
    assert repr(k(7)) in str(info.value)
    with pytest.raises(InvalidStateError, match="not ready") as info:
        m.prepare_load(ks([1, 2]))
    assert repr(k(2)) in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert m.num_evictable_chunks == 1  # key 1 is not left pinned
    m.complete_store(ks([2]))
    check_plan(m.prepare_store(ks([3])), [3], [0], [1])


def test_complete_load_errors_name_the_key_and_release_nothing() -> None:
    m = HostBlockManager(2)
    m.prepare_store(ks([1, 2]))
    m.complete_store(ks([1, 2]))
    m.prepare_load(ks([1]))
    with pytest.raises(InvalidStateError, match="not pinned") as info:
        m.complete_load(ks([1, 1]))
    assert repr(k(1)) in str(info.value)
    with pytest.raises(InvalidStateError, match="not stored"):
        m.complete_load(ks([1, 5]))
    assert m.num_evictable_chunks == 1  # 1 is still pinned once
    m.complete_load(ks([1]))
    assert m.num_evictable_chunks == 2
    with pytest.raises(InvalidStateError, match="not pinned"):
        m.complete_load(ks([2]))


def test_complete_store_ignores_unknown_and_ready_keys() -> None:
    m = HostBlockManager(2, enable_events=True)
    m.prepare_store(ks([1]))
    m.complete_store(ks([1, 5]))
    m.complete_store(ks([1]))
    m.complete_store(ks([1, 5]), success=False)
    assert m.lookup(k(1)) == HIT
    assert m.take_events() == [stored([1])]
    assert m.num_evictable_chunks == 1


def test_duplicate_keys_in_one_offer_get_one_chunk() -> None:
    m = HostBlockManager(4)
    check_plan(m.prepare_store(ks([7, 8, 7])), [7, 8], [0, 1], [])
    assert m.num_free_chunks == 2


def test_zero_chunks_never_stores() -> None:
    m = HostBlockManager(0, "arc")
    assert m.prepare_store(ks([1])) is None
    check_plan(m.prepare_store([]), [], [], [])
    assert m.lookup(k(1)) == MISS


def test_reset_restarts_chunk_ids() -> None:
    m = HostBlockManager(3, "arc", enable_events=True)
    m.prepare_store(ks([1, 2, 3]))
    m.complete_store(ks([1, 2, 3]))
    m.prepare_load(ks([1]))
    m.reset()
    assert len(m) == 0
    assert not m.has_pending_work()
    assert m.lookup(k(1)) == MISS
    assert len(arc_of(m).t1) == 0
    check_plan(m.prepare_store(ks([4, 5])), [4, 5], [0, 1], [])
    assert m.take_events() == [stored([1, 2, 3])]  # events from before the reset are kept


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"num_chunks": -1}, "num_chunks", "-1"),
        ({"num_chunks": 2.5}, "num_chunks", "2.5"),
        ({"num_chunks": True}, "num_chunks", "True"),
        ({"num_chunks": 4, "store_threshold": -2}, "store_threshold", "-2"),
        ({"num_chunks": 4, "max_tracker_size": 0}, "max_tracker_size", "0"),
        ({"num_chunks": 4, "policy": "fifo"}, "policy", "fifo"),
        ({"num_chunks": 4, "enable_events": 1}, "enable_events", "1"),
    ],
)
def test_constructor_validation(kwargs: dict[str, object], field: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        HostBlockManager(**kwargs)  # type: ignore[arg-type]
    assert field in str(info.value)
    assert value in str(info.value)


def test_introspection() -> None:
    m = HostBlockManager(3, "arc")
    assert (m.num_chunks, m.policy_name, m.num_free_chunks) == (3, "arc", 3)
    m.prepare_store(ks([1]))
    assert k(1) in m
    assert k(2) not in m
    assert m.chunk_id(k(1)) == 0
    assert m.chunk_id(k(2)) is None
    assert len(m) == 1


# --------------------------------------------------------------------------- differential check


def _load_benchmark(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import ``benchmarks/manager.py`` (a script, not a package) for its trace and baseline."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "manager.py"
    spec = importlib.util.spec_from_file_location("_kvoffload_bench_manager", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends src/ to sys.path
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_matches_the_plain_baseline_on_a_serving_trace(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lookup answer, chunk id and eviction equals the benchmark's independent plain implementation."""
    bench = _load_benchmark(monkeypatch)
    trace = bench.build_trace(400, seed=7)
    ours = HostBlockManager(trace.num_chunks, policy)
    baseline = bench.BaselineManager(trace.num_chunks, policy)
    ours_record: list[object] = []
    base_record: list[object] = []
    ops = bench.replay(ours, ours.prepare_store, trace, ours_record)
    bench.replay(baseline, baseline.prepare_store, trace, base_record)
    assert ops > 10_000
    assert len(ours_record) == len(base_record)
    assert ours_record == base_record
    stats = ours.stats()
    assert stats.evicted > 1_000  # the trace does put the pool under pressure
    assert None in ours_record  # and some offers are refused


def test_allocation_sizes_stay_bounded_when_nobody_takes_them() -> None:
    """One int per store offer must not pile up in an engine that never reads the manager's stats."""
    m = HostBlockManager(4)
    for i in range(20_000):
        plan = m.prepare_store([k(i)])
        assert plan is not None
        m.complete_store(plan.keys_to_store)
    assert len(m._alloc_sizes._first) + len(m._alloc_sizes._more) <= 4097  # bounded by the distinct sizes
    sizes = m.stats().allocation_sizes
    assert len(sizes) == 20_000 and set(sizes) == {1}  # every sample still counted
    assert m.stats().allocation_sizes == ()
