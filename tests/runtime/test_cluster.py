"""The multi-process runtime: verified round trips, a killed worker, a corrupted frame, clean shutdown."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest

from kvoffload import (
    ConfigError,
    DeadlineError,
    HostMemoryError,
    Int64Array,
    Shutdown,
    StepPlan,
    TransferJob,
    WireError,
    WorkerError,
    WorkerReport,
)
from kvoffload._packed import pack_int64
from kvoffload.demo import DemoOptions, default_snapshot, run_demo, snapshot_with_overrides
from kvoffload.demo.worker_hook import HOOK, DemoHook
from kvoffload.offload.manager import HostBlockManager, LookupResult
from kvoffload.offload.pool import (
    HostPool,
    available_host_memory_bytes,
    check_pools_fit,
    owned_pool_id,
    plan_host_pool,
    plan_host_pool_from_config,
    sweep_stale_pools,
)
from kvoffload.offload.scheduler import OffloadScheduler
from kvoffload.runtime._channel import Channel
from kvoffload.runtime.cluster import WorkerCluster
from kvoffload.runtime.hooks import WorkerContext
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
    with WorkerCluster(small_snapshot(), hook=HOOK, step_timeout_s=60) as cluster:
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
    cluster = WorkerCluster(snapshot, hook=HOOK, step_timeout_s=30, shared_pool=True)
    # A segment whose owner died without removing it (SIGKILL) is swept when a cluster starts.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = Path("/dev/shm") / f"kvoffload_{owned_pool_id('stale-test', int(dead.stdout))}.mmap"
    stale.write_bytes(b"\0" * 4096)
    cluster.start()
    assert not stale.exists()
    # Workers answer the handshake once they mapped the pool; its file is unlinked right then. (Only this
    # cluster's files are checked: other processes on the machine may own kvoffload segments meanwhile.)
    assert cluster.pool_id is not None
    assert not [p for p in Path("/dev/shm").glob("kvoffload_*") if cluster.pool_id in p.name]
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
        stale.unlink(missing_ok=True)
    assert not [p for p in Path("/dev/shm").glob("kvoffload_*") if cluster.pool_id in p.name], "file left behind"
    assert not mp.active_children()


def test_corrupted_frame_ends_only_that_worker() -> None:
    with WorkerCluster(small_snapshot(), hook=HOOK, step_timeout_s=30) as cluster:
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
    with pytest.raises(TimeoutError) as info:
        receiver.recv(0.05)
    assert isinstance(info.value, DeadlineError)


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


# -- faults: one clear error within a deadline, nothing left behind ------------------------------------------


def test_worker_failure_reaches_the_scheduler_with_its_cause() -> None:
    """A ConfigError only a worker can see (its hook refuses its options when the worker starts) names rank and
    cause. Both workers refuse the same options; the start-up waits on all of them at once, so whichever reports
    first is named. (A snapshot whose tensors are too small for its layers no longer gets that far: it is refused
    before spawning, see below.)"""
    cluster = WorkerCluster(small_snapshot(), hook=HOOK, hook_options={"memcpy_probe_bytes": -1}, start_timeout_s=60)
    with pytest.raises(WorkerError, match=r"worker [01] failed at step 0: ConfigError: memcpy_probe_bytes=-1 must be"):
        cluster.start()
    assert not mp.active_children()


def test_stopped_worker_is_given_up_by_heartbeat_and_a_failing_one_names_its_cause() -> None:
    """A SIGSTOPped worker sends no heartbeat: it is marked dead by worker_timeout_s, not the step timeout."""
    with WorkerCluster(small_snapshot(), hook=HOOK, step_timeout_s=600, worker_timeout_s=1.0) as cluster:
        cluster.step(plan(0), attachments())
        os.kill(cluster.pids[1], signal.SIGSTOP)
        r = cluster.step(plan(1), attachments())
        assert r.newly_dead == (1,)
        assert "worker 1 sent no heartbeat for 1s (worker_timeout_s): stopped or frozen" in r.errors[1]
        assert [rep.rank for rep in r.reports] == [0]
        # The live worker kept its heartbeats going while the scheduler was busy with the stopped one.
        r = cluster.step(plan(2), attachments())
        assert r.newly_dead == () and [rep.rank for rep in r.reports] == [0]
        # A failure inside a step reaches the scheduler with its cause (a simulated step needs 2 attachments).
        r = cluster.step(plan(3), [])
        assert r.newly_dead == (0,)
        assert r.errors[0].startswith("worker 0 failed at step 3: WireError: a simulated step needs 2 attachments")
    assert not mp.active_children()


def test_combined_host_pools_beyond_available_memory_are_refused_before_spawning() -> None:
    # Each rank's pool alone fits in available memory (3/4 of it); both together do not.
    budget = int(available_host_memory_bytes() * 1.5)
    cluster = WorkerCluster(default_snapshot(workers=2, num_blocks=32, cpu_bytes=budget), hook=HOOK)
    with pytest.raises(HostMemoryError, match=r"host pools need \d+ bytes \(2 ranks x \d+ bytes\) but only \d+"):
        cluster.start()
    assert not mp.active_children()
    with pytest.raises(HostMemoryError, match="one shared pool"):
        check_pools_fit([plan_host_pool_from_config(translate_snapshot(small_snapshot()))], shared=True, available=1)


def test_unrunnable_rank_config_is_refused_before_spawning() -> None:
    snapshot = snapshot_with_overrides(small_snapshot(), cpu_bytes=None, policy="mru")
    with pytest.raises(ConfigError, match=r"eviction_policy.*'mru'"):
        WorkerCluster(snapshot, hook=HOOK).start()
    assert not mp.active_children()
    # Tensors too small for their layers: the workers' own layout check, made before any of them starts.
    snapshot = small_snapshot()
    kv = snapshot.kv_cache_config
    tensor = kv.kv_cache_tensors[0]
    small = msgspec.structs.replace(tensor, size=tensor.size // 2)
    broken = msgspec.structs.replace(snapshot, kv_cache_config=msgspec.structs.replace(kv, kv_cache_tensors=(small,)))
    with pytest.raises(ConfigError, match=r"kv_cache_config cannot run: .* beyond kv_cache_tensors\[0\]\.size="):
        WorkerCluster(broken, hook=HOOK).start()
    assert not mp.active_children()


def test_segment_of_a_killed_owner_is_swept(tmp_path: Path) -> None:
    """SIGKILL right after the shared pool file is created leaves it behind; the next sweep removes it."""
    code = (
        "import sys, time\n"
        "from kvoffload.offload.pool._host_pool import HostPool\n"
        "from kvoffload.offload.pool._files import owned_pool_id\n"
        "from kvoffload.offload.pool._plan import plan_host_pool\n"
        "plan = plan_host_pool(worker_kv_bytes_per_block=4096, world_size=1, blocks_per_chunk=1,\n"
        "                      cpu_bytes_to_use=1 << 20, replicated=False, rank=0)\n"
        "pool = HostPool(plan, engine_id=owned_pool_id('leak'), shm_dir=sys.argv[1])\n"
        "print(pool.path, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        leaked = Path(proc.stdout.readline().strip())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert leaked.name == f"kvoffload_leak.pid{proc.pid}.mmap" and leaked.exists()
    mine = HostPool(
        plan_host_pool(
            worker_kv_bytes_per_block=4096,
            world_size=1,
            blocks_per_chunk=1,
            cpu_bytes_to_use=1 << 20,
            replicated=False,
            rank=0,
        ),
        engine_id=owned_pool_id("live"),
        shm_dir=tmp_path,
    )
    unowned = tmp_path / "kvoffload_someone-else.mmap"
    unowned.write_bytes(b"")
    try:
        assert sweep_stale_pools(tmp_path) == [leaked]
        assert not leaked.exists() and mine.path is not None and mine.path.exists() and unowned.exists()
    finally:
        mine.close()


def test_channel_caps_attachments_and_frame_0_per_message() -> None:
    left, right = mp.Pipe()
    sender = Channel(left)
    receiver = Channel(right, max_body_bytes=1000, max_attachments=2, max_attachment_bytes=10_000)
    sender.send(Shutdown(), [b"a", b"b"])
    assert len(receiver.recv(1.0).attachments) == 2
    sender.send(Shutdown(), [b"x"] * 3)
    with pytest.raises(WireError, match="max_attachments=2"):
        receiver.recv(1.0)
    left, right = mp.Pipe()
    sender, receiver = Channel(left), Channel(right, max_attachment_bytes=10_000)
    sender.send(Shutdown(), [b"x" * 6000, b"y" * 6000])  # each fits, together they do not
    with pytest.raises(WireError, match="max_attachment_bytes=10000"):
        receiver.recv(1.0)
    left, right = mp.Pipe()
    sender, receiver = Channel(left), Channel(right, max_body_bytes=100)
    sender.send(Shutdown(reason="r" * 5000))  # frame 0 is refused from its length, before it is read
    with pytest.raises(WireError, match="max_body_bytes=100"):
        receiver.recv(1.0)


def test_demo_request_that_outgrows_the_engine_pool_is_refused_not_livelocked() -> None:
    # The up-front bound passes (it counts one reply per conversation), but the 6th turn needs 34 of 32 blocks.
    options = DemoOptions(
        requests=6,
        conversations=1,
        system_prompt_tokens=64,
        turn_tokens=(16, 16),
        decode_tokens=64,
        memcpy_probe_bytes=0,
    )
    with pytest.raises(ConfigError, match=r"request conv0-turn6 needs 34 engine blocks \(544 tokens\).*num_blocks=32"):
        run_demo(small_snapshot(), options, progress=False, max_steps=5000)
    assert not mp.active_children()


class FailsOnItsWayOut(DemoHook):
    """The demo hook, failing where its options say for this rank (``"rank0": "finish"``): in ``finish`` (the
    drain) or in ``close`` (after the final report went out)."""

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self._fails_in = str(context.options.get(f"rank{context.rank}", ""))

    def finish(self, report: WorkerReport) -> Sequence[bytes]:
        if self._fails_in == "finish":
            raise RuntimeError("the drain's probe failed on purpose")
        return super().finish(report)

    def close(self) -> None:
        super().close()
        if self._fails_in == "close":
            raise RuntimeError("the hook's close failed on purpose")


def test_close_reports_a_worker_that_fails_its_drain_and_one_that_fails_after_its_final_report() -> None:
    """Failures at close reach the scheduler as failures in a step do: in newly_dead, with the reason."""
    options = {"rank0": "finish", "rank1": "close"}
    cluster = WorkerCluster(small_snapshot(), hook=f"{__name__}:FailsOnItsWayOut", hook_options=options)
    cluster.start()
    try:
        r = cluster.step(plan(0), attachments())
        assert r.newly_dead == ()
    finally:
        final = cluster.close()
    assert final.newly_dead == (0, 1)
    assert final.errors[0] == "worker 0 failed at step 0: RuntimeError: the drain's probe failed on purpose"
    assert final.errors[1].startswith("worker 1 ") and "after its final report" in final.errors[1], final.errors
    assert [rep.rank for rep in final.reports] == [1], "the final report sent before the failure is kept"
    assert cluster.errors == final.errors
    assert not mp.active_children()


@pytest.mark.parametrize("duplex", [True, False], ids=["socket", "pipe"])
def test_channel_send_with_a_deadline_gives_up_on_a_peer_that_reads_nothing(duplex: bool) -> None:
    first, second = mp.Pipe(duplex=duplex)  # one-way: (read end, write end)
    receiver, sender = Channel(first), Channel(second)
    big = bytes(range(256)) * (12 * 1024)  # 3 MiB: far more than the pipe or socket buffers hold
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(receiver.recv(30.0)))
    reader.start()
    sender.send(Shutdown(reason="with a deadline"), [big, b"small"], timeout=30.0)  # framed as send_bytes does
    reader.join(30.0)
    (decoded,) = got
    assert decoded.message == Shutdown(reason="with a deadline")  # type: ignore[attr-defined]
    assert [bytes(a) for a in decoded.attachments] == [big, b"small"]  # type: ignore[attr-defined]
    start = time.monotonic()
    with pytest.raises(DeadlineError, match=r"the peer took no byte of Shutdown for 0\.5s"):
        sender.send(Shutdown(), [big], timeout=0.5)  # nobody reads now
    assert time.monotonic() - start < 30, "a hang test: the bound is generous"
    with pytest.raises(WorkerError, match="an earlier send timed out mid-message"):
        sender.send(Shutdown(), timeout=0.5)
    for channel in (sender, receiver):
        channel.close()


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_a_stopped_worker_that_cannot_take_a_large_plan_is_given_up_by_worker_timeout_s() -> None:
    """A plan whose attachments exceed the socket buffers of a SIGSTOPped worker: the send gives up after
    worker_timeout_s, as the heartbeat would, instead of blocking until the worker is continued."""
    with WorkerCluster(small_snapshot(), step_timeout_s=600, worker_timeout_s=2.0) as cluster:  # no hook
        cluster.step(plan(0))
        stopped = cluster.pids[1]
        os.kill(stopped, signal.SIGSTOP)
        wake = threading.Timer(30.0, _resume, (stopped,))  # a send without deadline fails this test, never hangs it
        wake.start()
        try:
            start = time.monotonic()
            r = cluster.step(plan(1), [bytes(2 * MiB)])
            took = time.monotonic() - start
        finally:
            wake.cancel()
        assert r.newly_dead == (1,), r.errors
        assert r.errors[1] == "worker 1 took no byte of step 1's plan for 2s (worker_timeout_s): stopped or frozen"
        assert took < 25, f"step took {took:.1f}s"
        assert [rep.rank for rep in r.reports] == [0]
        r = cluster.step(plan(2), [bytes(2 * MiB)])  # the live worker still takes large plans
        assert r.newly_dead == () and [rep.rank for rep in r.reports] == [0]
        assert cluster.close().newly_dead == ()
    assert not mp.active_children()
