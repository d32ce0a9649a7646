"""OffloadWorker: stores deferred one step, flushes honoured, loads submitted, bad jobs reported failed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvoffload import StepPlan, TransferJob
from kvoffload._packed import pack_int64
from kvoffload.offload.pool import HostPool, plan_host_pool
from kvoffload.offload.worker import OffloadWorker
from kvoffload.offload.worker.copy import CopyEngine, build_transfer_layout
from tests.helpers import Placement, transfer_job

PAGE = 256
BLOCKS = 8


@pytest.fixture
def worker() -> Iterator[tuple[OffloadWorker, torch.Tensor]]:
    layout = build_transfer_layout(
        [Placement(size=2 * BLOCKS * PAGE, layers=("a", "b"), layer_stride=BLOCKS * PAGE, block_stride=PAGE)],
        [[("a", PAGE), ("b", PAGE)]],
        num_blocks=BLOCKS,
        worker_kv_bytes_per_block=2 * PAGE,
    )
    plan = plan_host_pool(
        worker_kv_bytes_per_block=2 * PAGE,
        world_size=1,
        blocks_per_chunk=1,
        cpu_bytes_to_use=16 * 4096,
        replicated=False,
        rank=0,
    )
    memory = torch.arange(2 * BLOCKS * PAGE, dtype=torch.int64).to(torch.uint8)
    with HostPool(plan, check_memory=False) as pool:
        w = OffloadWorker(CopyEngine(memory, layout, pool), rank=0)
        yield w, memory
        w.close()


def step(
    n: int,
    *,
    loads: tuple[TransferJob, ...] = (),
    stores: tuple[TransferJob, ...] = (),
    flush: list[int] = (),
) -> StepPlan:  # type: ignore[assignment]
    return StepPlan(step=n, load_jobs=loads, store_jobs=stores, flush=pack_int64(flush))


def test_store_is_deferred_to_the_next_step_then_loaded_back(
    worker: tuple[OffloadWorker, torch.Tensor],
) -> None:
    w, memory = worker
    original = memory.clone()
    plan0 = step(0, stores=(transfer_job(1, [2, 3], [0, 1]),))
    w.start_step(plan0)
    w.end_step(plan0)
    assert w.in_flight == frozenset()  # not submitted during the step it was planned in
    plan1 = step(1, flush=[1])
    w.start_step(plan1)  # submits the deferred store, then waits for it (flush)
    report = w.report(1)
    assert [(r.job_id, r.success, r.is_store, r.num_bytes) for r in report.results] == [(1, True, True, 4 * PAGE)]
    memory.zero_()
    plan2 = step(2, loads=(transfer_job(2, [5, 6], [0, 1]),))
    w.start_step(plan2)
    w.wait_for_loads(plan2, timeout=10)
    report = w.report(2)
    assert [(r.job_id, r.success, r.is_store) for r in report.results] == [(2, True, False)]
    for layer in range(2):
        for src, dst in ((2, 5), (3, 6)):
            got = memory[layer * BLOCKS * PAGE + dst * PAGE :][:PAGE]
            want = original[layer * BLOCKS * PAGE + src * PAGE :][:PAGE]
            assert torch.equal(got, want)


def test_bad_job_is_reported_failed_and_the_worker_keeps_going(
    worker: tuple[OffloadWorker, torch.Tensor],
) -> None:
    w, _ = worker
    plan = step(0, loads=(transfer_job(7, [1], [999]),))  # chunk id outside the pool
    w.start_step(plan)
    report = w.report(0)
    assert [(r.job_id, r.success, r.num_bytes) for r in report.results] == [(7, False, 0)]
    assert report.results[0].error.startswith("ConfigError: chunk_ids contains 999")
    stored = step(1, stores=(transfer_job(6, [1], [0]),))  # chunk 0 must hold a completed store to load it
    w.start_step(stored)
    w.end_step(stored)
    assert [(r.job_id, r.success) for r in w.drain(1, timeout=10).results] == [(6, True)]
    plan = step(1, loads=(transfer_job(8, [1], [0]),))
    w.start_step(plan)
    w.wait_for_loads(plan, timeout=10)
    assert [(r.job_id, r.success) for r in w.report(1).results] == [(8, True)]


def test_drain_submits_deferred_stores_and_waits(worker: tuple[OffloadWorker, torch.Tensor]) -> None:
    w, _ = worker
    plan = step(0, stores=(transfer_job(3, [0], [2]), transfer_job(4, [1], [3])))
    w.start_step(plan)
    w.end_step(plan)
    report = w.drain(0, timeout=10)
    assert sorted(r.job_id for r in report.results) == [3, 4]
    assert all(r.success for r in report.results)
    assert w.in_flight == frozenset()
