"""Per-request key positions in the cache policies (vLLM 0.33 ``ReqContext`` hints), on the policies alone.

The rules (the spec's section 4.5): LRU ranks are ``(major, minor)``, lower evicted first; an insert of a key whose
position the request recorded takes ``(request_rank, -position)`` (``request_rank`` allocated once per request),
any other insert or touch ``(++next_rank, 0)``; ``on_request_access`` raises a positioned, present key to at
least ``(request_rank, -position)``; ``on_request_finished`` touches ``reversed(order_request_keys(...))``;
eviction takes the lowest ``(rank, key)``. ARC's finish moves insertion-only keys within their list and promotes
reused ones, in reverse ``order_request_keys`` order.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError
from kvoffload.offload.manager.policies import ARCPolicy, LRUPolicy, RequestContext, order_request_keys


def key(i: int, group: int = 0) -> bytes:
    return b"h%03d" % i + group.to_bytes(4, "big")


def keys(ids: Sequence[int], group: int = 0) -> list[bytes]:
    return [key(i, group) for i in ids]


def ctx_with(req: str, positions: dict[bytes, int]) -> RequestContext:
    ctx = RequestContext(req)
    ctx.set_offload_key_positions(positions)
    return ctx


def chunked(req: str, ids: Sequence[int], tpc: int = 16, group: int = 0) -> RequestContext:
    """A request whose chunk ``j`` (key ``ids[j]``) ends at token ``(j + 1) * tpc``, as the connector records."""
    return ctx_with(req, {key(i, group): (j + 1) * tpc for j, i in enumerate(ids)})


def ready(policy: LRUPolicy | ARCPolicy, ids: Sequence[int], ctx: RequestContext | None = None) -> None:
    for i in ids:
        policy.insert(key(i), i, ctx)
    policy.mark_evictable_many(keys(ids))


def victims(policy: LRUPolicy | ARCPolicy, n: int, protected: Sequence[int] = ()) -> list[int]:
    out = policy.evict(n, set(keys(protected)))
    assert out is not None
    return [chunk for _, chunk in out]


# --------------------------------------------------------------------------- order_request_keys


def test_order_request_keys_flattens_then_sorts_by_position_only_when_all_are_known() -> None:
    g0, g1 = keys([1, 2, 3]), keys([2, 4], group=1)
    ctx = ctx_with("r", {g0[0]: 16, g0[1]: 32, g0[2]: 48, g1[0]: 32, g1[1]: 64})
    # stable: equal positions keep the group order (group 0's key at 32 before group 1's)
    assert order_request_keys([g0[::-1], g1], ctx) == [g0[0], g0[1], g1[0], g0[2], g1[1]]
    partial = ctx_with("r", {g0[0]: 16, g0[1]: 32})
    assert order_request_keys([g0[::-1]], partial) == g0[::-1]  # one key without a position: left as given
    assert order_request_keys([g0[::-1]], None) == g0[::-1]
    assert order_request_keys([[g0[1], g0[0], g0[1]]], ctx) == [g0[1], g0[0], g0[1]]  # a repeat: as vLLM, unsorted
    assert ctx.get_offload_key_position(key(99)) is None


def test_request_context_state_is_keyed_by_type() -> None:
    ctx = RequestContext("r")
    ctx.set_state(3)
    ctx.set_state("x")
    assert (ctx.get_state(int), ctx.get_state(str), ctx.get_state(float)) == (3, "x", None)
    assert "r" in repr(ctx)


# --------------------------------------------------------------------------- LRU with positions


def test_lru_positioned_inserts_evict_a_requests_tail_first() -> None:
    """Without positions the head of a request goes first (insertion order); with them the tail does."""
    plain = LRUPolicy(8)
    ready(plain, [1, 2, 3, 4])
    assert victims(plain, 2) == [1, 2]
    hinted = LRUPolicy(8)
    ready(hinted, [1, 2, 3, 4], chunked("a", [1, 2, 3, 4]))
    assert [hinted.rank(k) for k in keys([1, 2, 3, 4])] == [(1, -16), (1, -32), (1, -48), (1, -64)]
    assert victims(hinted, 2) == [4, 3]


def test_lru_request_rank_is_allocated_once_per_request_and_orders_requests() -> None:
    lru = LRUPolicy(16)
    a = chunked("a", [1, 2, 3])
    lru.insert(key(1), 1, a)  # a's rank: 1
    lru.insert(key(9), 9)  # a plain insert: (2, 0)
    b = chunked("b", [5, 6])
    lru.insert(key(5), 5, b)  # b's rank: 3
    lru.insert(key(2), 2, a)  # later store of a: still a's rank
    lru.insert(key(3), 3, a)
    lru.insert(key(6), 6, b)
    lru.mark_evictable_many(keys([1, 2, 3, 5, 6, 9]))
    assert lru.rank(key(3)) == (1, -48) and lru.rank(key(9)) == (2, 0) and lru.rank(key(6)) == (3, -32)
    # all of a (tail first), then the plain key, then b (tail first)
    assert victims(lru, 6) == [3, 2, 1, 9, 6, 5]


def test_lru_key_without_position_in_a_request_gets_a_fresh_rank() -> None:
    lru = LRUPolicy(8)
    ctx = chunked("a", [1])
    ready(lru, [1, 2], ctx)  # key 2 has no position in a's context
    assert lru.rank(key(1)) == (1, -16) and lru.rank(key(2)) == (2, 0)
    assert victims(lru, 2) == [1, 2]


def test_lru_equal_ranks_evict_in_key_order() -> None:
    """One position in two groups gives one rank: the heap breaks the tie by key, as vLLM's ``(rank, key)``."""
    lru = LRUPolicy(8)
    hi, lo = key(1, group=1), key(1, group=0)
    ctx = ctx_with("r", {hi: 32, lo: 32})
    lru.insert(hi, 10, ctx)
    lru.insert(lo, 20, ctx)
    lru.mark_evictable_many([hi, lo])
    assert victims(lru, 2) == [20, 10]
    assert lru.lru_order() == []


def test_lru_on_request_access_raises_but_never_lowers() -> None:
    lru = LRUPolicy(16)
    ready(lru, [1, 2, 3])  # (1,0) (2,0) (3,0)
    lru.touch(keys([3]))  # (4, 0)
    b = chunked("b", [1, 2, 3, 4])
    lru.on_request_access(keys([1, 3, 4, 7]), b)  # 4 and 7 are absent: ignored; b's rank is 5
    assert lru.rank(key(1)) == (5, -16)  # raised: b's head is no older than b itself
    assert lru.rank(key(3)) == (5, -48)  # (4, 0) < (5, -48): raised too
    assert lru.rank(key(2)) == (2, 0)  # not accessed
    lru.touch(keys([1]))  # (6, 0)
    lru.on_request_access(keys([1]), b)
    assert lru.rank(key(1)) == (6, 0)  # max keeps the fresher rank
    lru.on_request_access(keys([2]), None)  # no context: nothing
    lru.on_request_access(keys([2]), RequestContext("c"))  # no position: nothing
    assert lru.rank(key(2)) == (2, 0)
    assert victims(lru, 3) == [2, 3, 1]


def test_lru_request_takes_its_rank_at_its_first_access() -> None:
    lru = LRUPolicy(8)
    b = chunked("b", [1, 2])
    lru.on_request_access(keys([1, 2]), b)  # nothing resident, but b takes rank 1 here (vLLM 0.33)
    lru.insert(key(5), 5)
    assert lru.rank(key(5)) == (2, 0)
    lru.insert(key(1), 1, b)
    assert lru.rank(key(1)) == (1, -16)  # b's rank: older than the key stored after b's access


def test_lru_request_takes_its_rank_at_insert_without_an_access() -> None:
    lru = LRUPolicy(8)
    b = chunked("b", [1, 2])
    lru.insert(key(5), 5)
    lru.insert(key(1), 1, b)
    assert lru.rank(key(5)) == (1, 0)
    assert lru.rank(key(1)) == (2, -16)


def test_lru_access_while_pinned_counts_when_it_becomes_evictable() -> None:
    lru = LRUPolicy(8)
    ready(lru, [1, 2])
    lru.mark_non_evictable(key(1))  # pinned by a load
    lru.on_request_access(keys([1]), chunked("b", [1]))
    lru.mark_evictable(key(1))
    assert victims(lru, 2) == [2, 1]


def test_lru_finish_refreshes_in_position_order() -> None:
    lru = LRUPolicy(16)
    a = chunked("a", [1, 2, 3])
    # stored out of order (a sliding-window backfill): 3, then 1, 2
    ready(lru, [3], a)
    ready(lru, [1, 2], a)
    lru.on_request_finished([keys([3, 1, 2])], set(keys([3, 1, 2])), set(), a)
    assert lru.lru_order() == keys([3, 2, 1])  # the head ends most recent
    # a key without a position: the groups are flattened in the given order
    lru.on_request_finished([keys([3, 1, 2]), keys([4])], set(), set(), a)
    assert lru.lru_order() == keys([2, 1, 3])


def test_lru_clear_starts_ranks_and_request_ranks_over() -> None:
    lru = LRUPolicy(8)
    a = chunked("a", [1, 2])
    ready(lru, [1], a)
    ready(lru, [7])
    lru.clear()
    ready(lru, [7])
    ready(lru, [2], a)  # a's rank from before the clear is not reused
    assert lru.rank(key(7)) == (1, 0) and lru.rank(key(2)) == (2, -32)


def test_lru_two_policies_share_one_context() -> None:
    a = chunked("a", [1])
    first, second = LRUPolicy(4), LRUPolicy(4)
    first.insert(key(9), 9)
    first.insert(key(1), 1, a)
    second.insert(key(1), 1, a)
    assert first.rank(key(1)) == (2, -16) and second.rank(key(1)) == (1, -16)


@pytest.mark.parametrize("position", [-1, 1 << 40, 1.5, "16"])
def test_lru_rejects_a_position_that_is_not_a_token_count(position: object) -> None:
    lru = LRUPolicy(4)
    with pytest.raises(ConfigError, match="position"):
        lru.insert(key(1), 1, ctx_with("r", {key(1): position}))  # type: ignore[dict-item]
    assert len(lru) == 0


# --------------------------------------------------------------------------- ARC with positions


def test_arc_finish_distinguishes_insertion_only_reused_and_neither() -> None:
    arc = ARCPolicy(8)
    ready(arc, [1, 2, 3, 4, 5])
    arc.touch(keys([5]))  # T1 = [1, 2, 3, 4], T2 = [5]
    ctx = chunked("r", [1, 2, 3, 4, 5])
    # given out of order: the positions restore 1..5; reversed: 5 reused (T2 tail), 4 neither (left alone),
    # 3 insertion-only (T1 tail), 2 reused (T1 -> T2 tail), 1 insertion-only (T1 tail)
    arc.on_request_finished([keys([4, 2, 5, 1, 3])], set(keys([1, 3])), set(keys([2, 5])), ctx)
    assert list(arc.t1) == keys([4, 3, 1])
    assert list(arc.t2) == keys([5, 2])


def test_arc_insertion_only_wins_over_reused_and_ignores_pins() -> None:
    arc = ARCPolicy(8)
    ready(arc, [1, 2])
    arc.mark_non_evictable(key(1))  # pinned: the finish does not look
    arc.on_request_finished([keys([1, 2])], set(keys([2])), set(keys([1, 2])), None)
    assert list(arc.t1) == keys([2])
    assert list(arc.t2) == keys([1])


def test_arc_inserts_ignore_positions() -> None:
    arc = ARCPolicy(8)
    ready(arc, [1, 2, 3], chunked("r", [1, 2, 3]))
    assert list(arc.t1) == keys([1, 2, 3])
    arc.on_request_access(keys([1, 2]), chunked("r", [1, 2]))  # ARC: the default hook does nothing
    assert victims(arc, 1) == [1]


# --------------------------------------------------------------------------- a model of LRU ranks

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert"] * 3 + ["ready", "access", "finish"] * 2 + ["pin", "touch", "evict", "remove"]),
        st.sampled_from([0, 1, 1, 2]),  # request (0 = none)
        st.lists(st.sampled_from([0, 2, 4, 0, 2, 4, 1, 3, 5]), min_size=1, max_size=4),  # even keys have positions
    ),
    min_size=4,
    max_size=60,
)
_CLEAR = st.one_of(st.none(), st.integers(0, 59))  # clear() before this op (ranks and request ranks start over)


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, positions=st.lists(st.integers(1, 4), min_size=8, max_size=8), clear_at=_CLEAR)
def test_lru_matches_a_rank_model(
    ops: list[tuple[str, int, list[int]]], positions: list[int], clear_at: int | None
) -> None:
    """Random inserts, pins, touches, accesses, finishes and evictions against the spec's rules written out as
    a dictionary of ranks. Requests 1 and 2 record a position for the even keys (requests share positions, so
    equal ranks and key-order tie breaks occur); request 0 is "no context"."""
    lru = LRUPolicy(8)
    ctxs = {r: ctx_with(f"r{r}", {key(i): positions[i] * 16 for i in range(0, 8, 2)}) for r in (1, 2)}
    ranks: dict[int, tuple[int, int]] = {}
    evictable: set[int] = set()
    request_rank: dict[int, int] = {}
    counter = 0

    def fresh() -> tuple[int, int]:
        nonlocal counter
        counter += 1
        return (counter, 0)

    def positioned(r: int, i: int) -> tuple[int, int] | None:
        nonlocal counter
        if r == 0 or i % 2:
            return None
        if r not in request_rank:
            counter += 1
            request_rank[r] = counter
        return (request_rank[r], -positions[i] * 16)

    for step, (op, r, ids) in enumerate(ops):
        ctx = ctxs.get(r)
        if step == clear_at:
            lru.clear()
            ranks.clear()
            evictable.clear()
            request_rank.clear()
            counter = 0
        if op == "insert":
            for i in ids:
                ranks[i] = positioned(r, i) or fresh()
                evictable.discard(i)
                lru.insert(key(i), i, ctx)
        elif op == "ready":
            evictable.update(i for i in ids if i in ranks)
            lru.mark_evictable_many(keys(ids))
        elif op == "pin":
            evictable.difference_update(ids)
            lru.mark_non_evictable_many(keys(ids))
        elif op in ("touch", "finish"):
            # order_request_keys: sorted by position only when every key has one (and none repeats)
            sortable = op == "finish" and r and all(i % 2 == 0 for i in ids) and len(set(ids)) == len(ids)
            order = sorted(ids, key=lambda i: positions[i]) if sortable else ids
            for i in reversed(order):
                if i in ranks:
                    ranks[i] = fresh()
            if op == "touch":
                lru.touch(keys(ids), ctx)
            else:
                lru.on_request_finished([keys(ids)], set(), set(), ctx)
        elif op == "access":
            if r and r not in request_rank:  # vLLM: an access gives the request its rank, if it has none yet
                counter += 1
                request_rank[r] = counter
            for i in ids:
                if i in ranks:
                    wanted = positioned(r, i)
                    if wanted is not None:
                        ranks[i] = max(ranks[i], wanted)
            lru.on_request_access(keys(ids), ctx)
        elif op == "remove":
            for i in ids:
                assert lru.remove(key(i)) == (i if i in ranks else None)
                ranks.pop(i, None)
                evictable.discard(i)
        else:
            n, protected = (ids[0] if ids else 0), set(ids[1:])
            candidates = sorted((ranks[i], key(i), i) for i in evictable - protected)
            result = lru.evict(n, set(keys(sorted(protected))))
            if len(candidates) < n:
                assert result is None
            else:
                assert result == [(key(i), i) for _, _, i in candidates[:n]]
                for _, _, i in candidates[:n]:
                    del ranks[i]
                    evictable.discard(i)
        assert {i: lru.rank(key(i)) for i in ranks} == ranks
        assert len(lru) == len(ranks)
        assert lru.lru_order() == [k for _, k in sorted((rank, key(i)) for i, rank in ranks.items())]
