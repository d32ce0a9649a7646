"""HostBlockManager.drop: a chunk found corrupt is never served again, pinned or not, and its id is reused."""

from __future__ import annotations

import pytest

from kvoffload.errors import InvalidStateError
from kvoffload.offload.keys import make_offload_key
from kvoffload.offload.manager import HostBlockManager, LookupResult, OffloadEvent


def k(i: int) -> bytes:
    return make_offload_key(str(i).encode(), 0)


def _stored(manager: HostBlockManager, ids: list[int]) -> list[int]:
    plan = manager.prepare_store([k(i) for i in ids])
    assert plan is not None
    manager.complete_store(plan.keys_to_store)
    return plan.chunk_ids


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_dropping_a_ready_chunk_frees_it_now(policy: str) -> None:
    manager = HostBlockManager(3, policy, enable_events=True)
    chunks = _stored(manager, [1, 2, 3])
    manager.take_events()
    assert manager.drop([k(2), k(9)]) == [k(2)]  # absent keys are ignored
    assert manager.lookup(k(2)) is LookupResult.MISS
    assert k(2) not in manager and manager.chunk_id(k(2)) is None
    assert manager.take_events() == [OffloadEvent((k(2),), True)]
    assert (manager.num_free_chunks, manager.num_evictable_chunks, manager.stats().dropped) == (1, 2, 1)
    with pytest.raises(InvalidStateError, match="not stored"):
        manager.prepare_load([k(2)])
    # the key can be stored again (after a recompute) and reuses the freed chunk first
    plan = manager.prepare_store([k(2)])
    assert plan is not None and plan.keys_to_store == [k(2)] and plan.chunk_ids == [chunks[1]]
    manager.complete_store([k(2)])
    assert manager.lookup(k(2)) is LookupResult.HIT


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_dropping_a_pinned_chunk_hides_it_and_frees_it_at_the_last_unpin(policy: str) -> None:
    manager = HostBlockManager(2, policy, enable_events=True)
    chunks = _stored(manager, [1, 2])
    manager.prepare_load([k(1), k(2)])
    manager.prepare_load([k(1)])  # a second load pins key 1 again
    manager.take_events()
    assert manager.drop([k(1)]) == [k(1)]
    assert manager.drop([k(1)]) == []  # already dropped
    assert manager.take_events() == [OffloadEvent((k(1),), True)]
    assert manager.lookup(k(1)) is LookupResult.MISS
    with pytest.raises(InvalidStateError, match="not stored"):
        manager.prepare_load([k(1)])
    # offers skip it while its chunk is still read; it is not evictable either
    assert manager.prepare_store([k(1)]) is not None
    assert manager.chunk_id(k(1)) == chunks[0]
    manager.complete_load([k(1), k(2)])
    assert manager.chunk_id(k(1)) == chunks[0] and manager.num_free_chunks == 0
    manager.complete_load([k(1)])  # the last pin: the chunk is freed, no second event
    assert manager.chunk_id(k(1)) is None and manager.num_free_chunks == 1
    assert manager.num_evictable_chunks == 1 and not manager.has_pending_work()
    assert manager.take_events() == []
    plan = manager.prepare_store([k(1)])
    assert plan is not None and plan.keys_to_store == [k(1)] and plan.chunk_ids == [chunks[0]]


def test_pending_chunks_are_not_dropped() -> None:
    manager = HostBlockManager(2)
    manager.prepare_store([k(1)])
    assert manager.drop([k(1)]) == []
    assert manager.lookup(k(1)) is LookupResult.HIT_PENDING


def test_reset_forgets_dead_keys() -> None:
    manager = HostBlockManager(2)
    _stored(manager, [1])
    manager.prepare_load([k(1)])
    manager.drop([k(1)])
    manager.reset()
    _stored(manager, [1])
    assert manager.lookup(k(1)) is LookupResult.HIT
