"""LRU and ARC cache policies on their own, plus the policy registry."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvoffload.offload.manager.policies._registry as policy_module
from kvoffload.errors import ConfigError
from kvoffload.offload.manager.policies import (
    ARCPolicy,
    CachePolicy,
    LRUPolicy,
    available_policies,
    make_policy,
    register_policy,
)


def k(i: int) -> bytes:
    """Key ``i`` (vLLM's tests use ``str(i).encode()`` + group 0)."""
    return str(i).encode() + b"\x00\x00\x00\x00"


def ks(ids: Sequence[int]) -> list[bytes]:
    return [k(i) for i in ids]


def fill(policy: CachePolicy, ids: Sequence[int], *, ready: bool = True) -> None:
    """Insert keys ``ids`` with chunk id == 10 * key, ready (evictable) unless told otherwise."""
    for i in ids:
        policy.insert(k(i), 10 * i)
        if ready:
            policy.mark_evictable(k(i))


# --------------------------------------------------------------------------- LRU


def test_lru_evicts_in_insertion_order() -> None:
    lru = LRUPolicy(8)
    fill(lru, [1, 2, 3, 4])
    assert lru.lru_order() == ks([1, 2, 3, 4])
    assert lru.evict(2, set()) == [(k(1), 10), (k(2), 20)]
    assert lru.lru_order() == ks([3, 4])
    assert len(lru) == 2
    assert k(1) not in lru
    assert lru.get(k(1)) is None
    assert lru.get(k(3)) == 30


def test_lru_touch_is_applied_in_reverse() -> None:
    lru = LRUPolicy(8)
    fill(lru, [1, 2, 3, 4, 5])
    lru.touch(ks([2, 4, 9]))  # 9 is absent and ignored
    # reversed: 9 (absent), 4 -> end, 2 -> end: the first key of the list ends most recent
    assert lru.lru_order() == ks([1, 3, 5, 4, 2])
    assert lru.evict(3, set()) == [(k(1), 10), (k(3), 30), (k(5), 50)]


def test_lru_skips_pending_pinned_and_protected() -> None:
    lru = LRUPolicy(8)
    fill(lru, [1, 2, 3, 4])
    lru.insert(k(5), 50)  # pending
    lru.mark_non_evictable(k(1))  # pinned
    assert lru.evict(2, {k(2)}) == [(k(3), 30), (k(4), 40)]
    assert lru.lru_order() == ks([1, 2, 5])
    assert lru.evict(1, {k(2)}) is None  # 1 pinned, 2 protected, 5 pending
    lru.mark_evictable(k(5))
    assert lru.evict(1, {k(2)}) == [(k(5), 50)]
    lru.mark_evictable(k(1))  # unpinned: keeps its old recency
    assert lru.evict(2, set()) == [(k(1), 10), (k(2), 20)]


def test_lru_evict_is_all_or_nothing() -> None:
    lru = LRUPolicy(8)
    fill(lru, [1, 2, 3])
    lru.mark_non_evictable(k(2))
    assert lru.evict(3, set()) is None
    assert lru.lru_order() == ks([1, 2, 3])
    assert lru.evict(0, set()) == []
    with pytest.raises(ConfigError, match="-1"):
        lru.evict(-1, set())


def test_lru_remove_insert_many_and_clear() -> None:
    lru = LRUPolicy(8)
    lru.insert_many(ks([1, 2, 3]), [7, 8, 9])
    assert lru.lru_order() == ks([1, 2, 3])
    assert lru.evict(1, set()) is None  # all pending
    assert lru.remove(k(2)) == 8
    assert lru.remove(k(2)) is None
    lru.mark_evictable_many(ks([1, 3]))
    lru.insert(k(1), 70)  # re-insert: most recent again, pending
    assert lru.lru_order() == ks([3, 1])
    assert lru.evict(1, set()) == [(k(3), 9)]
    assert lru.evict(1, set()) is None
    lru.insert_many(ks([4, 1]), [40, 10])  # overlaps a resident key: falls back to one-by-one
    assert lru.lru_order() == ks([4, 1])
    assert lru.get(k(1)) == 10
    lru.clear()
    assert len(lru) == 0
    assert lru.lru_order() == []


def test_lru_mark_non_evictable_ignores_absent_keys() -> None:
    lru = LRUPolicy(4)
    lru.mark_non_evictable(k(1))
    lru.mark_non_evictable_many(ks([2]))
    fill(lru, [1, 2])  # insert + mark_evictable: nothing stale remains blocked
    assert lru.evict(2, set()) == [(k(1), 10), (k(2), 20)]


def test_lru_default_hooks_touch() -> None:
    lru = LRUPolicy(8)
    fill(lru, [1, 2, 3])
    lru.on_store_miss(ks([7, 8]))  # store misses are absent keys: no effect
    assert lru.lru_order() == ks([1, 2, 3])
    lru.on_request_finished(ks([1, 2]), {k(2)})
    assert lru.lru_order() == ks([3, 2, 1])


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "ready", "pin", "touch", "evict", "remove"]),
            st.lists(st.integers(0, 9), max_size=4),
        ),
        max_size=40,
    )
)
def test_lru_matches_list_model(ops: list[tuple[str, list[int]]]) -> None:
    """Compare with the obvious model: a Python list in recency order plus an evictable set."""
    lru = LRUPolicy(10)
    order: list[int] = []
    evictable: set[int] = set()
    for op, ids in ops:
        if op == "insert":
            for i in ids:
                if i in order:
                    order.remove(i)
                order.append(i)
                evictable.discard(i)
                lru.insert(k(i), i)
        elif op == "ready":
            for i in ids:
                if i in order:
                    evictable.add(i)
                    lru.mark_evictable(k(i))
        elif op == "pin":
            for i in ids:
                evictable.discard(i)
                lru.mark_non_evictable(k(i))
        elif op == "touch":
            for i in reversed(ids):
                if i in order:
                    order.remove(i)
                    order.append(i)
            lru.touch(ks(ids))
        elif op == "remove":
            for i in ids:
                assert lru.remove(k(i)) == (i if i in order else None)
                if i in order:
                    order.remove(i)
                evictable.discard(i)
        else:
            n, protected = (ids[0] if ids else 0), set(ids[1:])
            candidates = [i for i in order if i in evictable and i not in protected]
            result = lru.evict(n, {k(i) for i in protected})
            if len(candidates) < n:
                assert result is None
            else:
                assert result == [(k(i), i) for i in candidates[:n]]
                for i in candidates[:n]:
                    order.remove(i)
                    evictable.discard(i)
        assert lru.lru_order() == ks(order)


# --------------------------------------------------------------------------- ARC


def test_arc_inserts_into_t1_and_touch_promotes_ready_keys() -> None:
    arc = ARCPolicy(4)
    fill(arc, [1, 2])
    arc.insert(k(3), 30)  # pending
    assert list(arc.t1) == ks([1, 2, 3])
    arc.touch(ks([3, 1]))
    # reversed: 1 (ready) -> T2; 3 (pending) stays in T1 but moves to its tail
    assert list(arc.t1) == ks([2, 3])
    assert list(arc.t2) == ks([1])
    arc.touch(ks([2]))
    arc.touch(ks([1]))  # T2 hit: move to the T2 tail
    assert list(arc.t2) == ks([2, 1])
    assert arc.get(k(1)) == 10
    assert arc.get(k(3)) == 30
    assert arc.target_t1_size == 0.0


def test_arc_get_handles_chunk_id_zero() -> None:
    arc = ARCPolicy(2)
    arc.insert(k(1), 0)
    arc.mark_evictable(k(1))
    assert arc.get(k(1)) == 0
    arc.touch(ks([1]))
    assert arc.get(k(1)) == 0
    assert arc.remove(k(1)) == 0


def test_arc_ghost_hits_adapt_target() -> None:
    arc = ARCPolicy(4)
    fill(arc, [1, 2, 3, 4])
    arc.touch(ks([1, 2, 3, 4]))  # T2 = [4, 3, 2, 1], T1 empty
    assert list(arc.t2) == ks([4, 3, 2, 1])
    assert arc.evict(3, set()) == [(k(4), 40), (k(3), 30), (k(2), 20)]  # T1 empty: from T2
    assert list(arc.b2) == ks([4, 3, 2])
    fill(arc, [5, 6])
    assert arc.evict(1, set()) == [(k(5), 50)]  # |T1| = 2 >= int(0): from T1
    assert list(arc.b1) == ks([5])
    arc.touch(ks([5]))  # B1 hit: target += max(1, |B2| / |B1|) = 3
    assert arc.target_t1_size == 3.0
    arc.touch(ks([4]))  # B2 hit: target -= max(1, |B1| / |B2|) = 1
    assert arc.target_t1_size == 2.0
    assert list(arc.b2) == ks([3, 2, 4])  # the ghost moved to the recent end
    arc.touch(ks([3]))
    arc.touch(ks([2]))
    arc.touch(ks([4]))
    assert arc.target_t1_size == 0.0  # clamped at 0
    for _ in range(5):
        arc.touch(ks([5]))
    assert arc.target_t1_size == 4.0  # clamped at capacity


def test_arc_fractional_target_step() -> None:
    arc = ARCPolicy(8)
    fill(arc, [1, 2, 3])
    arc.touch(ks([1, 2, 3]))
    fill(arc, [4])
    assert arc.evict(1, set()) == [(k(4), 40)]  # B1 = [4]
    assert arc.evict(2, set()) == [(k(3), 30), (k(2), 20)]  # T1 empty: B2 = [3, 2]
    arc.touch(ks([3]))  # B2 hit: |B1| / |B2| = 0.5 -> step 1, clamped at 0
    assert arc.target_t1_size == 0.0
    fill(arc, [5])
    assert arc.evict(1, set()) == [(k(5), 50)]  # B1 = [4, 5]
    arc.touch(ks([4]))  # B1 hit: step max(1, 2 / 2) = 1
    assert arc.target_t1_size == 1.0
    arc.on_store_miss(ks([9, 2]))  # reversed; 2 is a B2 ghost: step max(1, 2 / 2) = 1
    assert arc.target_t1_size == 0.0
    arc.on_store_miss(ks([5, 4]))  # two B1 hits, applied in reverse: 4 then 5, each +1
    assert arc.target_t1_size == 2.0
    assert list(arc.b1) == ks([4, 5])
    assert arc.evict(1, set()) == [(k(1), 10)]  # virtual |T1| 0 < 2: from T2 -> B2 = [3, 2, 1]
    arc.touch(ks([5]))  # B1 hit: step max(1, 3 / 2) = 1.5
    assert arc.target_t1_size == 3.5
    assert isinstance(arc.target_t1_size, float)


def test_arc_evict_alternates_with_the_virtual_t1_size() -> None:
    arc = ARCPolicy(8)
    fill(arc, [1, 2, 3, 4, 5])
    arc.touch(ks([5, 4]))  # T2 = [4, 5], T1 = [1, 2, 3]
    assert list(arc.t2) == ks([4, 5])
    arc.target_t1_size = 2.5  # int() -> 2
    # virtual |T1|: 3 >= 2 -> 1; 2 >= 2 -> 2; 1 < 2 -> T2 head 4; 1 < 2 -> 5
    assert arc.evict(4, set()) == [(k(1), 10), (k(2), 20), (k(4), 40), (k(5), 50)]
    assert list(arc.b1) == ks([1, 2])
    assert list(arc.b2) == ks([4, 5])
    assert list(arc.t1) == ks([3])
    assert list(arc.t2) == []


def test_arc_evict_falls_back_between_lists() -> None:
    arc = ARCPolicy(8)
    fill(arc, [1, 2, 3, 4])
    arc.touch(ks([4, 3]))  # T2 = [3, 4], T1 = [1, 2]
    arc.mark_non_evictable(k(3))
    arc.mark_non_evictable(k(4))
    arc.target_t1_size = 5.0  # prefers T2, but T2 has nothing evictable: fall back to T1
    assert arc.evict(1, set()) == [(k(1), 10)]
    arc.target_t1_size = 0.0
    arc.mark_evictable(k(4))
    # prefers T1, whose only entry (2) is protected: take T2's first evictable (3 is pinned)
    assert arc.evict(1, {k(2)}) == [(k(4), 40)]
    assert list(arc.b1) == ks([1])
    assert list(arc.b2) == ks([4])


def test_arc_evict_is_all_or_nothing() -> None:
    arc = ARCPolicy(4)
    fill(arc, [1, 2, 3])
    arc.touch(ks([3]))
    arc.insert(k(4), 40)  # pending
    arc.target_t1_size = 1.0
    before = (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2), arc.target_t1_size)
    assert arc.evict(3, {k(1)}) is None  # only 2 and 3 are candidates
    assert (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2), arc.target_t1_size) == before
    assert arc.evict(0, set()) == []
    with pytest.raises(ConfigError):
        arc.evict(-2, set())


def test_arc_ghost_lists_are_trimmed_to_capacity() -> None:
    arc = ARCPolicy(2)
    for i in range(1, 20):
        fill(arc, [i])
        if len(arc) > 2:
            arc.evict(1, set())
        assert len(arc.b1) <= 2
    assert list(arc.b1) == ks([16, 17])
    assert list(arc.t1) == ks([18, 19])
    arc.insert(k(17), 170)  # re-insert forgets the ghost
    assert list(arc.b1) == ks([16])


def test_arc_on_request_finished() -> None:
    arc = ARCPolicy(8)
    fill(arc, [1, 2, 3, 4, 5])
    arc.touch(ks([5]))  # T1 = [1, 2, 3, 4], T2 = [5]
    arc.on_request_finished(ks([1, 2, 5, 4, 9]), {k(1), k(5)})
    # reversed: 9 absent; 4 own store -> T1 tail; 5 reused in T2 -> T2 tail; 2 own -> T1 tail;
    # 1 reused in T1 -> T2 tail
    assert list(arc.t1) == ks([3, 4, 2])
    assert list(arc.t2) == ks([5, 1])


def test_arc_remove_keeps_ghosts_and_clear_resets() -> None:
    arc = ARCPolicy(4)
    fill(arc, [1, 2])
    assert arc.evict(1, set()) == [(k(1), 10)]
    assert arc.remove(k(2)) == 20
    assert arc.remove(k(2)) is None
    assert list(arc.b1) == ks([1])
    arc.touch(ks([1]))
    assert arc.target_t1_size == 1.0
    arc.clear()
    assert (len(arc), len(arc.b1), len(arc.b2), arc.target_t1_size) == (0, 0, 0, 0.0)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "ready", "pin", "touch", "evict", "miss", "finish"]),
            st.lists(st.integers(0, 11), max_size=4),
        ),
        max_size=50,
    )
)
def test_arc_invariants(ops: list[tuple[str, list[int]]]) -> None:
    arc = ARCPolicy(6)
    resident: set[int] = set()
    evictable: set[int] = set()
    for op, ids in ops:
        if op == "insert":
            for i in ids:
                if i not in resident and len(resident) < 6:
                    arc.insert(k(i), i)
                    resident.add(i)
        elif op == "ready":
            for i in ids:
                if i in resident:
                    arc.mark_evictable(k(i))
                    evictable.add(i)
        elif op == "pin":
            for i in ids:
                arc.mark_non_evictable(k(i))
                evictable.discard(i)
        elif op == "touch":
            arc.touch(ks(ids))
        elif op == "miss":
            arc.on_store_miss(ks(ids))
        elif op == "finish":
            arc.on_request_finished(ks(ids), set(ks(ids[:1])))
        else:
            n, protected = (ids[0] % 4 if ids else 0), set(ids[1:])
            before = (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2))
            result = arc.evict(n, set(ks(sorted(protected))))
            candidates = evictable - protected
            if len(candidates) < n:
                assert result is None
                assert (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2)) == before
            else:
                assert result is not None
                victims = [int(key[:-4]) for key, _ in result]
                assert len(victims) == n == len(set(victims))
                assert set(victims) <= candidates
                assert all(chunk_id == int(key[:-4]) for key, chunk_id in result)
                resident -= set(victims)
                evictable -= set(victims)
        assert {int(key[:-4]) for key in (*arc.t1, *arc.t2)} == resident
        assert not set(arc.t1) & set(arc.t2)
        assert not (set(arc.b1) | set(arc.b2)) & (set(arc.t1) | set(arc.t2))
        assert len(arc.b1) <= 6
        assert len(arc.b2) <= 6
        assert 0.0 <= arc.target_t1_size <= 6.0


# --------------------------------------------------------------------------- registry


def test_make_policy_builds_registered_policies() -> None:
    lru = make_policy("lru", 3)
    arc = make_policy("arc", 5)
    assert isinstance(lru, LRUPolicy)
    assert lru.capacity == 3
    assert isinstance(arc, ARCPolicy)
    assert arc.capacity == 5
    assert {"lru", "arc"} <= set(available_policies())
    assert LRUPolicy.name == "lru"
    assert ARCPolicy.name == "arc"


@pytest.mark.parametrize("name", ["LRU", "fifo", "", None])
def test_unknown_policy_is_config_error_naming_it(name: object) -> None:
    with pytest.raises(ConfigError, match=r"^Unknown cache policy: ") as info:
        make_policy(name, 4)  # type: ignore[arg-type]
    assert repr(name) in str(info.value)
    assert "lru" in str(info.value)


@pytest.mark.parametrize("capacity", [-1, 1.5, True])
def test_policy_capacity_is_validated(capacity: object) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        make_policy("lru", capacity)  # type: ignore[arg-type]


def test_register_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy_module, "_REGISTRY", dict(policy_module._REGISTRY))

    class MRUPolicy(LRUPolicy):
        """Evicts the most recent keys first (only to exercise the registry)."""

        name = "mru"

    register_policy("mru", MRUPolicy)
    assert isinstance(make_policy("mru", 2), MRUPolicy)
    assert "mru" in available_policies()
    with pytest.raises(ConfigError, match="already registered"):
        register_policy("mru", LRUPolicy)
    with pytest.raises(ConfigError, match="already registered"):
        register_policy("lru", MRUPolicy)
    register_policy("mru", ARCPolicy, replace=True)
    assert isinstance(make_policy("mru", 2), ARCPolicy)
    with pytest.raises(ConfigError, match="callable"):
        register_policy("x", 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="name"):
        register_policy("", LRUPolicy)
