"""Scheduler lookups and finish ordering that a held-out run of vLLM 0.33's own tests found different.

The scans follow ``_maximal_prefix_lookup`` / ``_sliding_window_lookup`` (vLLM 0.33's scans, and the
``test_scheduler.py`` cases), the group loop follows ``_lookup``, and a finished request hands the policy
every key it loaded, stored or reused in position order, so a shared prefix outlives its tails.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import cast

import pytest

from kvoffload import JobResult, StepPlan, WorkerReport
from kvoffload._packed import unpack_int32, unpack_int64
from kvoffload.errors import ConfigError
from kvoffload.offload.keys import make_offload_key
from kvoffload.offload.manager import HostBlockManager, LookupResult
from kvoffload.offload.manager.policies import make_policy
from kvoffload.offload.scheduler import OffloadScheduler, maximal_prefix_lookup, sliding_window_lookup
from tests.helpers import offloading_config

H = LookupResult.HIT
P = LookupResult.HIT_PENDING
M = LookupResult.MISS
R = cast(LookupResult, object())  # a tier's RETRY ("ask again"): neither present nor missing
TPH = 16


class Answers:
    """A lookup over keys 0..n-1 that answers from a list and counts the calls."""

    def __init__(self, results: Sequence[LookupResult]) -> None:
        self.results = list(results)
        self.keys = [bytes([i]) for i in range(len(results))]
        self.calls = 0

    def __call__(self, key: bytes) -> LookupResult:
        self.calls += 1
        return self.results[key[0]]


def window(results: Sequence[LookupResult], size: int, initial: int | None = None) -> tuple[int | None, int]:
    answers = Answers(results)
    return sliding_window_lookup(answers, answers.keys, size, initial), answers.calls


def prefix(results: Sequence[LookupResult]) -> tuple[int | None, int]:
    answers = Answers(results)
    return maximal_prefix_lookup(answers, answers.keys), answers.calls


# -- the scans (vLLM's unit cases) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "expected"),
    [(H, (3, 1)), (P, (None, 1)), (R, (None, 3)), (M, (0, 3))],
)
def test_window_of_one_over_three_keys(result: LookupResult, expected: tuple[int | None, int]) -> None:
    assert window([result] * 3, 1) == expected


def test_window_positions() -> None:
    assert window([M, H, H], 2) == (3, 2)  # at the end
    assert window([M, H, H, M], 2) == (3, 3)  # in the middle
    assert window([H, H, M, H, H, M], 2) == (5, 3)  # the rightmost window wins
    assert window([H, M, H], 2) == (1, 3)  # no full window: the run reaching the left edge
    assert window([M, H, M], 2) == (0, 3)


@pytest.mark.parametrize(("middle", "expected"), [(M, 2), (R, None), (P, None), (H, 5)])
def test_unaligned_initial_window(middle: LookupResult, expected: int | None) -> None:
    assert window([H, H, middle, H, H], 2, initial=3)[0] == expected


def test_pending_chunk_behind_a_gap_does_not_defer_the_window_left_of_it() -> None:
    assert window([H, H, M, P], 2) == (2, 4)  # the case: vLLM loads chunks 1-2 now
    assert window([H, P, M, H], 2) == (None, 4)  # a pending chunk inside the returned window defers
    assert window([P, M, H], 2) == (None, 3)  # ... also in the run reaching the left edge
    assert window([H, H, R, P], 2) == (None, 4)  # a RETRY anywhere defers


def test_prefix_scan_continues_past_pending_until_the_first_miss() -> None:
    assert prefix([H, H, H]) == (3, 3)
    assert prefix([H, H, M, H]) == (2, 3)
    assert prefix([M, H]) == (0, 1)
    assert prefix([H, P, H, H, M, H]) == (None, 5)
    assert prefix([R, H, M]) == (None, 3)


# -- the scheduler ----------------------------------------------------------------------------------------


def hashes(tag: str, n: int, *, shared: int = 0) -> list[bytes]:
    out: list[bytes] = []
    prev = b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{'p' if i < shared else tag}:{i}".encode()).digest()
        out.append(prev)
    return out


def keys_of(hs: list[bytes], group: int = 0) -> list[bytes]:
    return [make_offload_key(h, group) for h in hs]


def scheduler(groups: list[tuple[int, int, int | None]], chunks: int = 16, policy: str = "lru") -> OffloadScheduler:
    config = offloading_config(
        [(gid, tpb, (f"l{gid}",), w) for gid, tpb, w in groups], tokens_per_hash=TPH, world_size=1
    )
    return OffloadScheduler(config, HostBlockManager(chunks, policy, enable_events=True))


def stored(manager: HostBlockManager, keys: list[bytes]) -> None:
    plan = manager.prepare_store(keys)
    assert plan is not None and plan.keys_to_store == keys
    manager.complete_store(keys)


def done(plan: StepPlan) -> list[WorkerReport]:
    results = [
        JobResult(job_id=j.job_id, success=True, is_store=store, num_bytes=1, seconds=0.0)
        for jobs, store in ((plan.load_jobs, False), (plan.store_jobs, True))
        for j in jobs
    ]
    return [WorkerReport(rank=0, step=plan.step, results=tuple(results))]


def test_sliding_window_loads_the_window_left_of_a_gap_and_a_pending_chunk() -> None:
    sched = scheduler([(0, 16, 2)])
    manager = sched.manager
    hs = hashes("a", 5)
    keys = keys_of(hs)
    stored(manager, keys[:2])
    assert manager.prepare_store([keys[3]]) is not None  # chunk 4 is being written
    sched.add_request("r", hs, 80)
    assert sched.lookup("r", 0) == 32  # the old scan deferred at the pending chunk
    sched.on_blocks_allocated("r", [[10, 11, 12, 13, 14]], num_external_tokens=32)
    (load,) = sched.build_step_plan().load_jobs
    assert unpack_int64(load.block_ids) == [10, 11] and unpack_int32(load.block_indices) == [0]
    assert unpack_int64(load.chunk_ids) == [manager.chunk_id(k) for k in keys[:2]]


def test_sliding_window_scan_starts_at_the_first_uncomputed_chunk() -> None:
    sched = scheduler([(0, 16, 2)])
    hs = hashes("a", 4)
    keys = keys_of(hs)
    stored(sched.manager, [keys[1]])  # chunk 0 is computed locally and not on the host
    sched.add_request("r", hs, 64)
    assert sched.lookup("r", 16) == 16  # vLLM: the run reaching the first uncomputed chunk is a hit


def test_prefix_lookup_asks_the_manager_up_to_the_first_miss() -> None:
    sched = scheduler([(0, 16, None)])
    manager = sched.manager
    hs = hashes("a", 7)
    keys = keys_of(hs)
    stored(manager, [keys[0], keys[2], keys[3], keys[5]])
    assert manager.prepare_store([keys[1]]) is not None  # pending
    sched.add_request("r", hs, 7 * 16)
    before = manager.stats().lookups
    assert sched.lookup("r", 0) is None
    assert manager.stats().lookups - before == 5  # chunks 0-4: past the pending chunk 1, up to the miss at 4


def test_a_deferring_group_does_not_hide_a_miss_in_another_group() -> None:
    sched = scheduler([(0, 16, None), (1, 16, 1)])
    manager = sched.manager
    hs = hashes("a", 5)
    full = keys_of(hs, 0)
    stored(manager, [full[0], full[2], full[3]])
    assert manager.prepare_store([full[1]]) is not None  # pending in the full-attention group
    sched.add_request("r", hs, 80)
    assert sched.lookup("r", 0) == 0  # the window group has nothing: vLLM answers 0, not "later"
    assert sched.stats().lookup_misses == 1


def _run_request(
    sched: OffloadScheduler, req: str, hs: list[bytes], blocks: list[int], *, hit: int | None = None
) -> None:
    tokens = len(hs) * TPH
    sched.add_request(req, hs, tokens)
    assert sched.lookup(req, 0) == (hit or 0)
    sched.on_blocks_allocated(req, [blocks], num_external_tokens=hit or 0)
    plan = sched.build_step_plan()
    sched.on_worker_reports(done(plan))
    sched.on_tokens_computed(req, tokens)
    plan = sched.build_step_plan()
    sched.on_worker_reports(done(plan))
    sched.finish_request(req)


def test_shared_prefix_outlives_the_tail_of_a_request_that_loaded_it() -> None:
    sched = scheduler([(0, 16, None)], chunks=5)
    manager = sched.manager
    prefix_hashes = hashes("b", 4, shared=2)[:2]
    _run_request(sched, "a", prefix_hashes, [0, 1])  # stores the prefix P0 P1
    b = hashes("b", 4, shared=2)
    _run_request(sched, "b", b, [10, 11, 12, 13], hit=32)  # loads P0 P1, stores its tail T2 T3
    p0, p1, t2, t3 = keys_of(b)
    assert manager.policy.lru_order() == [t3, t2, p1, p0]  # type: ignore[attr-defined]
    sched.take_events()
    _run_request(sched, "c", hashes("c", 2), [20, 21])  # needs one eviction: the tail goes first
    assert [manager.lookup(k) for k in (p0, p1, t2, t3)] == [H, H, H, M]


def test_finish_orders_keys_by_position_then_group() -> None:
    sched = scheduler([(0, 16, None), (1, 32, None)], chunks=8)
    manager = sched.manager
    hs = hashes("a", 4)
    sched.add_request("r", hs, 64)
    assert sched.lookup("r", 0) == 0
    sched.on_blocks_allocated("r", [[0, 1, 2, 3], [4, 5]])
    sched.on_tokens_computed("r", 64)
    sched.on_worker_reports(done(sched.build_step_plan()))
    sched.finish_request("r")
    g0, g1 = keys_of(hs, 0), keys_of(hs, 1)[1::2]  # a group-1 chunk is keyed by its last hash block
    # positions: g0 chunks end at 16, 32, 48, 64; g1 chunks (2 hash blocks each) at 32, 64
    expected_mru_first = [g0[0], g0[1], g1[0], g0[2], g0[3], g1[1]]
    assert manager.policy.lru_order() == expected_mru_first[::-1]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["mru", "LRU", ""])
def test_unknown_policy_text_is_vllms(name: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(f"Unknown cache policy: {name!r}")):
        make_policy(name, 4)
    with pytest.raises(ValueError, match=r"^Unknown cache policy: "):
        HostBlockManager(4, name)
