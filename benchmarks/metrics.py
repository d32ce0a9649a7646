"""What metrics cost: the demo's step loop with metrics on vs off, side by side, plus per-call costs.

The demo's own step loop (``kvoffload.demo.engine.DemoEngine.step``: admission, lookups with miss explanations,
step plans, reports, the simulated forward pass that fills and verifies KV) runs against one in-process worker (an
``OffloadWorker`` over a real ``CopyEngine`` and host pool) instead of spawned processes, so the comparison
is not drowned in inter-process noise. "On" means what ``kvoffload demo --metrics-port`` does per step:
``SchedulerMetrics.observe`` after every step and ``WorkerMetrics.record`` of every worker report. By default
prometheus_client runs in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before it is imported), the slower
mode the demo's workers use. Runs alternate off/on; reported: the median of per-pair ratios of time per step
(wall and process CPU; on a shared machine these are noisy), and the time spent inside the metric calls
themselves (timed around each call in the "on" runs) over the "off" step time: the precise figure.

    python benchmarks/metrics.py [--requests 48] [--pairs 8] [--no-multiprocess]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--no-multiprocess", action="store_true", help="prometheus_client in its plain in-process mode")
    return p.parse_args()


ARGS = _parse()
if not ARGS.no_multiprocess:
    # Must happen before prometheus_client is imported: the mode is fixed at import.
    _DIR = tempfile.mkdtemp(prefix="kvoffload-bench-metrics-")
    atexit.register(shutil.rmtree, _DIR, True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _DIR

import torch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from kvoffload import WorkerReport  # noqa: E402
from kvoffload._generated import StepPlan  # noqa: E402
from kvoffload._packed import Int64Array  # noqa: E402
from kvoffload.demo import DemoOptions, default_snapshot  # noqa: E402
from kvoffload.demo.engine import DemoEngine  # noqa: E402
from kvoffload.demo.sim_engine import fill_blocks, verify_blocks  # noqa: E402
from kvoffload.metrics import SchedulerMetrics, WorkerMetrics  # noqa: E402
from kvoffload.offload.pool import HostPool, plan_host_pool_from_config  # noqa: E402
from kvoffload.offload.scheduler import OffloadScheduler  # noqa: E402
from kvoffload.offload.worker import OffloadWorker  # noqa: E402
from kvoffload.offload.worker.copy import CopyEngine, TransferLayout, transfer_layout_from_config  # noqa: E402
from kvoffload.runtime.cluster import ClusterStep  # noqa: E402

_NO_VERIFY = memoryview(Int64Array([0, 0]).tobytes())


class _InProcessCluster:
    """The part of WorkerCluster the demo's step uses, served by one in-process worker.

    Like the demo's worker processes it plays the engine's forward pass (fills the computed blocks with
    deterministic KV, verifies the loaded ones). Unlike them it waits for stores too, so the number of steps
    does not depend on timing.
    """

    def __init__(
        self, worker: OffloadWorker, kv: torch.Tensor, layout: TransferLayout, metrics: WorkerMetrics | None
    ) -> None:
        self.worker = worker
        self.kv = kv
        self.layout = layout
        self.metrics = metrics
        self.mismatches = 0
        self.metric_seconds = 0.0

    def step(self, plan: StepPlan, attachments: Sequence[bytes]) -> ClusterStep:
        flat = Int64Array.from_buffer(attachments[0]).tolist()
        fill = [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat) - 2, 3)]
        flat = Int64Array.from_buffer(attachments[1]).tolist()
        verify = [(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(0, len(flat) - 3, 4)]
        worker = self.worker
        worker.start_step(plan)
        worker.engine.wait(set(worker.in_flight))
        report: WorkerReport = worker.report(plan.step)
        if self.metrics is not None:
            started = time.perf_counter()
            self.metrics.record(report)
            self.metric_seconds += time.perf_counter() - started
        loaded = {r.job_id for r in report.results if not r.is_store and r.success}
        checked = [(g, b, s) for job, g, b, s in verify if job in loaded]
        self.mismatches += len(verify_blocks(self.kv, self.layout, 0, checked))
        fill_blocks(self.kv, self.layout, 0, fill)
        worker.end_step(plan)
        return ClusterStep((report,), {0: (_NO_VERIFY,)}, ())


def run(metrics_on: bool) -> tuple[float, float, int, float]:
    """One demo workload: (wall seconds, process CPU seconds in the step loop, steps, seconds in metric calls)."""
    snapshot = default_snapshot(workers=1, num_blocks=256, cpu_bytes=128 << 20)
    options = DemoOptions(requests=ARGS.requests, conversations=8)
    sched_metrics = SchedulerMetrics(CollectorRegistry()) if metrics_on else None
    worker_metrics = WorkerMetrics(CollectorRegistry(), max_samples=0) if metrics_on else None
    demo = DemoEngine(snapshot, options, sched_metrics)
    observe_seconds = 0.0
    if sched_metrics is not None:
        observe = sched_metrics.observe

        def timed_observe(sched: OffloadScheduler, *, force: bool = False) -> bool:
            nonlocal observe_seconds
            started = time.perf_counter()
            done = observe(sched, force=force)
            observe_seconds += time.perf_counter() - started
            return done

        sched_metrics.observe = timed_observe  # type: ignore[method-assign]
    layout = transfer_layout_from_config(snapshot.kv_cache_config, demo.config)
    kv = torch.zeros(layout.engine_bytes, dtype=torch.uint8)
    with HostPool(plan_host_pool_from_config(demo.config)) as pool:
        worker = OffloadWorker(CopyEngine(kv, layout, pool), rank=0)
        cluster = _InProcessCluster(worker, kv, layout, worker_metrics)
        start, cpu = time.perf_counter(), time.process_time()
        while not demo.done:
            demo.step(cluster)  # type: ignore[arg-type]
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        worker.close()
    if cluster.mismatches or demo.result.failed_jobs:
        sys.exit(f"the run failed verification: {cluster.mismatches} mismatched blocks")
    return elapsed, cpu, demo.result.steps, observe_seconds + cluster.metric_seconds


def per_call() -> None:
    """Microseconds per recording call, in the current prometheus_client mode."""
    metrics = WorkerMetrics(CollectorRegistry(), max_samples=0)
    n = 20_000
    start = time.perf_counter()
    for _ in range(n):
        metrics.load_bytes.inc(4096)
    counter = (time.perf_counter() - start) / n * 1e6
    start = time.perf_counter()
    for _ in range(n):
        metrics.load_size.observe(4096)
    hist = (time.perf_counter() - start) / n * 1e6
    from kvoffload import JobResult

    report = WorkerReport(
        rank=0,
        step=0,
        results=tuple(
            JobResult(job_id=i, success=True, is_store=bool(i % 2), num_bytes=1 << 20, seconds=1e-3) for i in range(8)
        ),
    )
    start = time.perf_counter()
    for _ in range(n // 10):
        metrics.record(report)
    record = (time.perf_counter() - start) / (n // 10) * 1e6
    print(
        f"per call: bound counter inc {counter:.2f} us, histogram observe {hist:.2f} us, record(8 jobs) {record:.1f} us"
    )


def main() -> None:
    mode = "in-process" if ARGS.no_multiprocess else "multiprocess"
    print(f"prometheus_client mode: {mode}; workload: {ARGS.requests} requests, demo model at 1 worker")
    per_call()
    run(False)  # warm-up (imports, allocator)
    wall: list[float] = []
    cpu: list[float] = []
    added: list[float] = []
    inside: list[float] = []
    for pair in range(ARGS.pairs):
        if pair % 2:  # alternate which runs first, so warm-up or drift does not favour one side
            on_s, on_cpu, on_steps, in_metrics = run(True)
            off_s, off_cpu, off_steps, _ = run(False)
        else:
            off_s, off_cpu, off_steps, _ = run(False)
            on_s, on_cpu, on_steps, in_metrics = run(True)
        if off_steps != on_steps:
            sys.exit(f"the workload diverged: {off_steps} steps off, {on_steps} on")
        wall.append(on_s / off_s)
        cpu.append(on_cpu / off_cpu)
        added.append((on_cpu - off_cpu) / off_steps)
        inside.append(in_metrics / off_s)
        print(
            f"pair {pair}: {off_steps} steps; wall ms/step off {off_s / off_steps * 1e3:.3f} on "
            f"{on_s / off_steps * 1e3:.3f} (x{wall[-1]:.4f}); CPU ms/step off {off_cpu / off_steps * 1e3:.3f} "
            f"on {on_cpu / off_steps * 1e3:.3f} (x{cpu[-1]:.4f}); in metric calls {inside[-1] * 100:.2f}%"
        )
    for name, ratios in (("wall", wall), ("process CPU", cpu)):
        median = statistics.median(ratios)
        print(f"metrics on / off, {name} time per step: median x{median:.4f} ({(median - 1) * 100:+.2f}%)")
    print(f"median added CPU per step: {statistics.median(added) * 1e6:.1f} us")
    share = statistics.median(inside)
    print(
        f"time inside metric calls / step time without metrics: median {share * 100:.2f}% "
        f"(max {max(inside) * 100:.2f}%)"
    )


if __name__ == "__main__":
    main()
