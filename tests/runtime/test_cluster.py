"""The multi-process runtime: verified round trips, a killed worker, a corrupted frame, clean shutdown."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from kvoffload import Int64Array, StepPlan, TransferJob, WireError
from kvoffload.demo import DemoOptions, default_snapshot, run_demo
from kvoffload.offload.manager import HostBlockManager, LookupResult
from kvoffload.offload.scheduler import OffloadScheduler
from kvoffload.packed import pack_int64
from kvoffload.runtime.channel import Channel
from kvoffload.runtime.cluster import WorkerCluster
from kvoffload.translate import translate_snapshot
from tests.helpers import transfer_job

pytestmark = pytest.mark.slow

MiB = 1 << 20


def plan(
    step: int,
    loads: list[TransferJob] = (),
    stores: list[TransferJob] = (),
    flush: list[int] = (),  # type: ignore[assignment]
) -> StepPlan:
    return StepPlan(step=step, load_jobs=tuple(loads), store_jobs=tuple(stores), flush=pack_int64(flush))


def attachments(fill: list[int] = (), verify: list[int] = ()) -> list[bytes]:  # type: ignore[assignment]
    return [Int64Array(fill).tobytes(), Int64Array(verify).tobytes()]


def verified(step_result: object) -> list[list[int]]:
    return [Int64Array.from_buffer(extras[0]).tolist() for extras in step_result.attachments.values()]  # type: ignore[attr-defined]


def small_snapshot(workers: int = 2):  # type: ignore[no-untyped-def]
    return default_snapshot(workers=workers, num_blocks=32, cpu_bytes=8 * MiB)


def test_store_load_round_trip_is_verified_and_corruption_is_caught() -> None:
    with WorkerCluster(small_snapshot(), simulate=True, step_timeout_s=60) as cluster:
        r = cluster.step(plan(0), attachments(fill=[0, 3, 42]))  # forward pass writes block 3
        assert [rep.results for rep in r.reports] == [(), ()]
        cluster.step(plan(1, stores=[transfer_job(0, [3], [5])]), attachments())  # store queued (deferred one step)
        # The store starts at the beginning of step 2; the flush makes the load wait for it.
        r = cluster.step(plan(2, loads=[transfer_job(1, [7], [5])], flush=[0]), attachments(verify=[1, 0, 7, 42]))
        assert verified(r) == [[1, 0], [1, 0]]  # one block checked per worker, no mismatch
        results = {(res.job_id, res.success) for rep in r.reports for res in rep.results}
        assert results == {(0, True), (1, True)}
        # Expecting other contents than what was stored must be reported as a mismatch.
        r = cluster.step(plan(3, loads=[transfer_job(2, [8], [5])]), attachments(verify=[2, 0, 8, 43]))
        assert verified(r) == [[1, 1, 8], [1, 1, 8]]
        # A load from a chunk nobody stored fails its integrity check on every worker (nothing to verify).
        r = cluster.step(plan(4, loads=[transfer_job(3, [9], [6])]), attachments(verify=[3, 0, 9, 42]))
        assert verified(r) == [[0, 0], [0, 0]]
        failed = {(res.job_id, res.success, res.corrupt_chunk_ids) for rep in r.reports for res in rep.results}
        assert failed == {(3, False, pack_int64([6]))}
        # A job with an out-of-range chunk id fails instead of crashing the worker.
        r = cluster.step(plan(5, loads=[transfer_job(4, [9], [10_000])]), attachments())
        assert {(res.job_id, res.success) for rep in r.reports for res in rep.results} == {(4, False)}
        assert cluster.live_ranks == [0, 1]
        final = cluster.close()
        assert len(final.reports) == 2


def test_killed_worker_fails_its_jobs_and_the_scheduler_carries_on(tmp_path: Path) -> None:
    snapshot = small_snapshot()
    config = translate_snapshot(snapshot)
    manager = HostBlockManager(16)
    sched = OffloadScheduler(config, manager)
    cluster = WorkerCluster(snapshot, simulate=True, step_timeout_s=30, shared_pool=True)
    before = set(Path("/dev/shm").glob("kvoffload_*"))
    cluster.start()
    # Workers answer the handshake once they mapped the pool; its file is unlinked right then.
    assert set(Path("/dev/shm").glob("kvoffload_*")) == before
    assert cluster.handshakes[0].mode == "fast"
    try:
        sched.add_request("a", [bytes([i]) * 32 for i in range(2)], 32)
        assert sched.lookup("a", 0) == 0
        sched.on_blocks_allocated("a", [[1, 2]])
        sched.on_tokens_computed("a", 32)
        p = sched.build_step_plan()
        (store,) = p.store_jobs
        cluster.kill_worker(1)
        r = cluster.step(p, attachments(fill=[0, 1, 5, 0, 2, 6]))
        assert r.newly_dead == (1,)
        assert [rep.rank for rep in r.reports] == [0]
        sched.on_worker_reports(r.reports)
        outcome = sched.fail_jobs(sched.in_flight_job_ids())
        assert outcome.failed_stores == ("a",)
        key = bytes([1]) * 32 + (0).to_bytes(4, "big")
        assert manager.lookup(key) is LookupResult.MISS  # never marked ready
        # The next step still runs on the surviving worker.
        r = cluster.step(sched.build_step_plan(), attachments())
        assert r.newly_dead == () and [rep.rank for rep in r.reports] == [0]
        assert store.job_id not in sched.in_flight_job_ids()
    finally:
        cluster.close()
    assert set(Path("/dev/shm").glob("kvoffload_*")) == before, "no shared-memory file is left behind"
    assert not mp.active_children()


def test_corrupted_frame_ends_only_that_worker() -> None:
    with WorkerCluster(small_snapshot(), simulate=True, step_timeout_s=30) as cluster:
        cluster.send_raw(0, [b"\x00garbage that is not an envelope"])
        r = cluster.step(plan(0), attachments())
        assert r.newly_dead == (0,)
        assert [rep.rank for rep in r.reports] == [1]
        assert cluster.live_ranks == [1]
    assert not mp.active_children()


def test_channel_rejects_garbage_with_wire_error() -> None:
    left, right = mp.Pipe()
    sender, receiver = Channel(left), Channel(right)
    left.send_bytes(b"\x01\x00\x00")  # a 3-byte frame-count header
    with pytest.raises(WireError, match="frame count"):
        receiver.recv(1.0)
    left.send_bytes((1000).to_bytes(4, "little"))
    with pytest.raises(WireError, match="1000 frames"):
        receiver.recv(1.0)
    sender.send_raw([b"KVOF" + b"\xff" * 30])  # a well-framed message whose envelope is garbage
    with pytest.raises(WireError):
        receiver.recv(1.0)
    sender.send_raw([b"\x00" * 3])
    with pytest.raises(WireError, match="truncated"):
        receiver.recv(1.0)
    with pytest.raises(TimeoutError):
        receiver.recv(0.05)


def test_demo_small_run_verifies_every_reload() -> None:
    result = run_demo(
        small_snapshot(),
        DemoOptions(
            requests=6,
            conversations=2,
            system_prompt_tokens=64,
            turn_tokens=(16, 48),
            decode_tokens=4,
            memcpy_probe_bytes=1 * MiB,
        ),
        progress=False,
    )
    assert result.ok, result
    assert result.requests == 6
    assert result.tokens_loaded > 0 and result.blocks_verified == 2 * result.tokens_loaded // 16
    assert result.bytes_loaded > 0 and result.bytes_stored > 0
