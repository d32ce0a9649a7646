"""OffloadScheduler flows: hits, partial hits, deferral, stores, failures, out-of-order reports, aborts."""

from __future__ import annotations

import hashlib

import pytest

from kvoffload import (
    BlockRemoved,
    BlockStored,
    ConfigError,
    InvalidStateError,
    JobResult,
    OffloadingConfig,
    StepPlan,
    TransferJob,
    WorkerReport,
)
from kvoffload._packed import unpack_int32, unpack_int64
from kvoffload.offload.keys import make_offload_key
from kvoffload.offload.manager import HostBlockManager, LookupResult
from kvoffload.offload.scheduler import OffloadScheduler
from tests.helpers import offloading_config

TPH = 16


def make_config(
    groups: list[tuple[int, int, int | None]] | None = None, *, bpc: int = 1, world_size: int = 2
) -> OffloadingConfig:
    return offloading_config(
        [(gid, tpb, (f"l{gid}",), w) for gid, tpb, w in groups or [(0, 16, None)]],
        tokens_per_hash=TPH,
        blocks_per_chunk=bpc,
        world_size=world_size,
        events=True,
    )


def hashes(prefix: str, n: int, *, shared: int = 0, base: str = "p") -> list[bytes]:
    """n prefix-chained fake block hashes; the first `shared` come from `base`."""
    out: list[bytes] = []
    prev = b""
    for i in range(n):
        tag = base if i < shared else prefix
        prev = hashlib.sha256(prev + f"{tag}:{i}".encode()).digest()
        out.append(prev)
    return out


def report(plan_jobs: list[TransferJob], rank: int, *, success: bool = True, store: bool = True) -> WorkerReport:
    return WorkerReport(
        rank=rank,
        step=0,
        results=tuple(
            JobResult(job_id=j.job_id, success=success, is_store=store, num_bytes=100, seconds=0.01) for j in plan_jobs
        ),
    )


def make(world_size: int = 2, chunks: int = 16, **kw: object) -> tuple[OffloadScheduler, HostBlockManager]:
    manager = HostBlockManager(chunks, enable_events=True)
    return OffloadScheduler(make_config(world_size=world_size, **kw), manager), manager  # type: ignore[arg-type]


def store_prefix(sched: OffloadScheduler, req: str, hs: list[bytes], blocks: list[int]) -> StepPlan:
    tokens = len(hs) * TPH
    sched.add_request(req, hs, tokens)
    assert sched.lookup(req, 0) == 0
    sched.on_blocks_allocated(req, [blocks])
    sched.on_tokens_computed(req, tokens)
    return sched.build_step_plan()


def test_store_then_full_prefix_hit_and_load() -> None:
    sched, manager = make()
    hs = hashes("a", 4)
    plan = store_prefix(sched, "a", hs, [10, 11, 12, 13])
    assert plan.load_jobs == () and len(plan.store_jobs) == 1
    job = plan.store_jobs[0]
    assert unpack_int64(job.block_ids) == [10, 11, 12, 13]
    assert unpack_int32(job.group_sizes) == [4] and unpack_int32(job.block_indices) == [0]
    keys = [make_offload_key(h, 0) for h in hs]
    assert unpack_int64(job.chunk_ids) == [manager.chunk_id(k) for k in keys] == [0, 1, 2, 3]

    # While the store is in flight a second request with the same prefix must wait, not recompute.
    sched.add_request("b", hs, 64)
    assert sched.lookup("b", 0) is None
    sched.on_worker_reports([report([job], rank=0)])
    assert manager.lookup(keys[0]) is LookupResult.HIT_PENDING  # one of two workers reported
    sched.on_worker_reports([report([job], rank=1)])
    assert manager.lookup(keys[0]) is LookupResult.HIT

    # 64 tokens: the last chunk is left to compute so the engine gets logits for the last token.
    assert sched.lookup("b", 0) == 48
    sched.on_blocks_allocated("b", [[20, 21, 22, 23]], num_external_tokens=48)
    plan = sched.build_step_plan()
    (load,) = plan.load_jobs
    assert unpack_int64(load.block_ids) == [20, 21, 22] and unpack_int64(load.chunk_ids) == [0, 1, 2]
    assert unpack_int32(load.group_sizes) == [3] and unpack_int32(load.block_indices) == [0]
    outcome = sched.on_worker_reports([report([load], 0, store=False), report([load], 1, store=False)])
    assert outcome.finished_loads == ("b",)
    stats = sched.stats()
    assert stats.tokens_loaded == 48 and stats.tokens_stored == 64
    assert stats.bytes_loaded == 200 and stats.bytes_stored == 200


def test_partial_prefix_hit() -> None:
    sched, _ = make(world_size=1)
    plan = store_prefix(sched, "a", hashes("a", 4), [1, 2, 3, 4])
    sched.on_worker_reports([report(list(plan.store_jobs), 0)])
    sched.add_request("b", hashes("b", 4, shared=2, base="a"), 64)
    assert sched.lookup("b", 0) == 32
    # With a local prefix hit of one block the load covers only the second chunk.
    assert sched.lookup("b", 16) == 16
    sched.on_blocks_allocated("b", [[7, 8, 9, 10]], num_external_tokens=16)
    (load,) = sched.build_step_plan().load_jobs
    assert unpack_int64(load.block_ids) == [8] and unpack_int32(load.block_indices) == [1]


def test_failed_store_never_becomes_a_hit() -> None:
    sched, manager = make()
    hs = hashes("a", 2)
    plan = store_prefix(sched, "a", hs, [1, 2])
    (job,) = plan.store_jobs
    outcome = sched.on_worker_reports([report([job], 0), report([job], 1, success=False)])
    assert outcome.failed_stores == ("a",)
    assert manager.lookup(make_offload_key(hs[0], 0)) is LookupResult.MISS
    sched.add_request("b", hs, 32)
    assert sched.lookup("b", 0) == 0
    assert sched.stats().failed_jobs == 1
    # Nothing was announced as stored, so no event is published for the rollback either.
    assert sched.take_events() == []


def test_reports_out_of_order_and_unknown_jobs() -> None:
    sched, _manager = make()
    p1 = store_prefix(sched, "a", hashes("a", 1), [1])
    p2 = store_prefix(sched, "b", hashes("b", 1), [2])
    j1, j2 = p1.store_jobs[0], p2.store_jobs[0]
    stray = JobResult(job_id=999, success=True, is_store=True, num_bytes=1, seconds=0.0)
    sched.on_worker_reports([WorkerReport(rank=1, step=5, results=(stray,))])
    sched.on_worker_reports([report([j2], 1), report([j1], 0)])
    assert sched.in_flight_job_ids() == [j1.job_id, j2.job_id]
    sched.on_worker_reports([report([j2], 0)])
    assert sched.in_flight_job_ids() == [j1.job_id]
    sched.on_worker_reports([report([j1], 1)])
    assert not sched.has_pending_work()
    events = sched.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    assert {e.block_hashes[0] for e in events} == {hashes("a", 1)[0], hashes("b", 1)[0]}


def test_abort_mid_transfer_releases_pins_and_flushes_stores() -> None:
    sched, manager = make()
    hs = hashes("a", 4)
    plan = store_prefix(sched, "a", hs, [1, 2, 3, 4])
    sched.on_worker_reports([report(list(plan.store_jobs), r) for r in (0, 1)])
    sched.add_request("b", hs, 64)
    assert sched.lookup("b", 0) == 48
    sched.on_blocks_allocated("b", [[5, 6, 7, 8]], num_external_tokens=48)
    (load,) = sched.build_step_plan().load_jobs
    assert manager.stats().usage > 0  # pinned by the load
    sched.abort_request("b")
    outcome = sched.on_worker_reports([report([load], r, store=False) for r in (0, 1)])
    assert outcome.finished_loads == ()  # aborted: the engine is not told to resume it
    assert manager.stats().usage == 0.0  # every pin released

    # A store in flight when its request aborts is flushed by the next plan.
    sched.add_request("c", hashes("c", 1), 16)
    sched.lookup("c", 0)
    sched.on_blocks_allocated("c", [[9]])
    sched.on_tokens_computed("c", 16)
    (store,) = sched.build_step_plan().store_jobs
    sched.abort_request("c")
    assert unpack_int64(sched.build_step_plan().flush) == [store.job_id]


def test_lookup_released_when_not_loaded_and_pins_never_leak() -> None:
    sched, manager = make(world_size=1)
    plan = store_prefix(sched, "a", hashes("a", 3), [1, 2, 3])
    sched.on_worker_reports([report(list(plan.store_jobs), 0)])
    sched.add_request("b", hashes("a", 3), 48)
    assert sched.lookup("b", 0) == 32
    assert manager.stats().usage > 0
    sched.on_blocks_allocated("b", [[4, 5, 6]], num_external_tokens=0)  # the engine chose to recompute
    assert manager.stats().usage == 0.0
    with pytest.raises(InvalidStateError, match="exceeds the last lookup"):
        sched.on_blocks_allocated("b", [[]], num_external_tokens=16)


def test_fenced_blocks_are_flushed_when_reallocated() -> None:
    sched, _ = make()
    plan = store_prefix(sched, "a", hashes("a", 2), [1, 2])
    sched.finish_request("a")  # state kept until its store completes
    sched.add_request("b", hashes("b", 2), 32)
    sched.lookup("b", 0)
    sched.on_blocks_allocated("b", [[2, 3]])
    assert unpack_int64(sched.build_step_plan().flush) == [plan.store_jobs[0].job_id]


def test_prompt_only_and_max_offload_tokens() -> None:
    sched, _ = make(world_size=1)
    hs = hashes("a", 4)
    sched.add_request("a", hs[:2], 32, prompt_len=32)
    sched.lookup("a", 0)
    sched.on_blocks_allocated("a", [[1, 2]])
    sched.on_tokens_computed("a", 32)
    assert len(sched.build_step_plan().store_jobs) == 1
    sched.extend_request("a", hs[2:], 64)  # decode tokens
    sched.on_blocks_allocated("a", [[3, 4]])
    sched.on_tokens_computed("a", 64)
    assert sched.build_step_plan().store_jobs == ()  # offload_prompt_only defaults to True

    sched2, _ = make(world_size=1)
    sched2.add_request("x", hs, 64, max_offload_tokens=32)
    sched2.lookup("x", 0)
    sched2.on_blocks_allocated("x", [[1, 2, 3, 4]])
    sched2.on_tokens_computed("x", 64)
    (job,) = sched2.build_step_plan().store_jobs
    assert unpack_int64(job.block_ids) == [1, 2]


def test_allocation_failure_retries_next_step() -> None:
    sched, _manager = make(world_size=1, chunks=2)
    plan = store_prefix(sched, "a", hashes("a", 2), [1, 2])
    # Both chunks are pending writes: nothing evictable, so the next store cannot be placed.
    sched.add_request("b", hashes("b", 1), 16)
    sched.lookup("b", 0)
    sched.on_blocks_allocated("b", [[3]])
    sched.on_tokens_computed("b", 16)
    assert sched.build_step_plan().store_jobs == ()
    assert sched.stats().allocation_failures == 1
    sched.on_worker_reports([report(list(plan.store_jobs), 0)])
    (job,) = sched.build_step_plan().store_jobs  # retried, now evicting an LRU chunk
    assert unpack_int64(job.block_ids) == [3]
    removed = [e for e in sched.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 1


def test_blocks_per_chunk_two_with_unaligned_local_prefix() -> None:
    sched, _ = make(world_size=1, bpc=2)
    hs = hashes("a", 8)  # 128 tokens = 4 chunks of 2 blocks
    plan = store_prefix(sched, "a", hs, list(range(10, 18)))
    (store,) = plan.store_jobs
    assert unpack_int32(store.group_sizes) == [8] and unpack_int64(store.chunk_ids) == [0, 1, 2, 3]
    sched.on_worker_reports([report([store], 0)])
    sched.add_request("b", hs, 128)
    # Local prefix cache already holds 1 block (16 tokens): the load starts mid-chunk.
    assert sched.lookup("b", 16) == 96 - 16
    sched.on_blocks_allocated("b", [list(range(20, 28))], num_external_tokens=80)
    (load,) = sched.build_step_plan().load_jobs
    assert unpack_int32(load.block_indices) == [1] and unpack_int64(load.block_ids) == [21, 22, 23, 24, 25]
    assert unpack_int64(load.chunk_ids) == [0, 1, 2]


def test_two_groups_full_and_sliding_window() -> None:
    sched, manager = make(world_size=1, groups=[(0, 16, None), (1, 16, 1)], chunks=32)
    hs = hashes("a", 4)
    sched.add_request("a", hs, 64)
    sched.lookup("a", 0)
    sched.on_blocks_allocated("a", [[1, 2, 3, 4], [11, 12, 13, 14]])
    sched.on_tokens_computed("a", 64)
    (store,) = sched.build_step_plan().store_jobs
    assert unpack_int32(store.group_sizes) == [4, 4] and unpack_int64(store.block_ids) == [1, 2, 3, 4, 11, 12, 13, 14]
    sched.on_worker_reports([report([store], 0)])
    # Both groups stored all four chunks.
    manager_keys = [make_offload_key(h, 1) for h in hs]
    assert all(manager.lookup(k) is LookupResult.HIT for k in manager_keys)
    sched.add_request("b", hs, 64)
    assert sched.lookup("b", 0) == 48
    sched.on_blocks_allocated("b", [[5, 6, 7, 8], [15, 16, 17, 18]], num_external_tokens=48)
    (load,) = sched.build_step_plan().load_jobs
    # Full attention loads the whole prefix, the sliding-window group only its last window chunk.
    assert unpack_int32(load.group_sizes) == [3, 1]
    assert unpack_int32(load.block_indices) == [0, 2]
    assert unpack_int64(load.block_ids) == [5, 6, 7, 17]


def test_bad_input_is_rejected_with_names() -> None:
    sched, _ = make()
    with pytest.raises(ConfigError, match="num_tokens"):
        sched.add_request("a", [], -1)
    sched.add_request("a", [], 0)
    with pytest.raises(InvalidStateError, match="already registered"):
        sched.add_request("a", [], 0)
    with pytest.raises(InvalidStateError, match="unknown request 'zz'"):
        sched.lookup("zz", 0)
    with pytest.raises(ConfigError, match="max_load_tokens"):
        sched.add_request("b", [], 0, max_load_tokens=-3)
    with pytest.raises(ConfigError, match=r"2 lists|1 groups"):
        sched.on_blocks_allocated("a", [[1], [2]])


def test_abort_before_the_load_is_sent_releases_everything() -> None:
    sched, manager = make(world_size=1)
    plan = store_prefix(sched, "a", hashes("a", 3), [1, 2, 3])
    sched.on_worker_reports([report(list(plan.store_jobs), 0)])
    sched.add_request("b", hashes("a", 3), 48)
    assert sched.lookup("b", 0) == 32
    sched.on_blocks_allocated("b", [[4, 5, 6]], num_external_tokens=32)
    sched.abort_request("b")  # the load job was queued but never sent
    assert sched.build_step_plan().load_jobs == ()
    assert not sched.has_pending_work()
    assert manager.stats().usage == 0.0  # pins released
    assert sched.stats().failed_jobs == 0
    sched.add_request("c", hashes("a", 3), 48)
    assert sched.lookup("c", 0) == 32  # not deferred by a phantom in-flight load


def test_repeated_report_from_one_worker_does_not_complete_a_job() -> None:
    sched, manager = make(world_size=2)
    hs = hashes("a", 1)
    plan = store_prefix(sched, "a", hs, [1])
    (job,) = plan.store_jobs
    sched.on_worker_reports([report([job], 0), report([job], 0)])
    assert sched.in_flight_job_ids() == [job.job_id]
    assert manager.lookup(make_offload_key(hs[0], 0)) is LookupResult.HIT_PENDING
    sched.on_worker_reports([report([job], 1)])
    assert manager.lookup(make_offload_key(hs[0], 0)) is LookupResult.HIT
