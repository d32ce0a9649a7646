"""``run_demo``: the demo workload through the scheduler and one worker process per rank, verified.

The workers run the demo's hook (:mod:`kvoffload.demo.worker_hook`), so the runtime itself knows nothing of
the simulated engine. Before any process starts, the run is refused when the options are out of bounds, the
snapshot cannot run (:func:`~kvoffload.translate.validate_runnable`), the workers' KV memory and host pools
would not fit in this machine's memory, or the workload's longest conversation can never fit the engine's
block pool.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING

from kvoffload._generated import EngineSnapshot, OffloadingConfig
from kvoffload.demo.engine import DemoEngine
from kvoffload.demo.report import DemoResult
from kvoffload.demo.worker_hook import HOOK, TierFigures, checksum_cost_of, memcpy_gbps_of, tier_figures_of
from kvoffload.demo.workload import DEFAULT_OPTIONS, DemoOptions, check_options, check_workload_fits
from kvoffload.errors import DeadlineError, HostMemoryError
from kvoffload.offload.pool import available_host_memory_bytes, plan_host_pool_from_config
from kvoffload.runtime.cluster import DEFAULT_START_TIMEOUT_S, WorkerCluster
from kvoffload.tiers import EmbeddedValkey, start_embedded_servers
from kvoffload.translate import translate_snapshot, validate_runnable

if TYPE_CHECKING:
    from kvoffload._events import KVEventPublisher
    from kvoffload.metrics import SchedulerMetrics

__all__ = ["MEMORY_SHARE", "demo_memory_bytes", "run_demo"]

MEMORY_SHARE = 0.8
"""The share of available memory the demo's workers may use together."""


def run_demo(
    snapshot: EngineSnapshot,
    options: DemoOptions = DEFAULT_OPTIONS,
    *,
    progress: bool = True,
    max_steps: int = 100_000,
    metrics: SchedulerMetrics | None = None,
    metrics_dir: str | None = None,
    events: KVEventPublisher | None = None,
    start_timeout_s: float | None = None,
) -> DemoResult:
    """Run the demo workload on ``snapshot`` with one worker process per rank; returns what it measured.

    Raises ConfigError before starting any process when an option is out of bounds or the snapshot cannot run,
    and HostMemoryError when the workers' KV memory and host pools would not fit in this machine's available
    memory (real-size snapshots need a real-size machine).
    ``metrics`` is updated after every step; workers record their transfer metrics under ``metrics_dir``
    (prometheus_client multiprocess mode); ``events`` publishes the pool's KV events after every step.
    ``start_timeout_s`` bounds the workers' start-up (default the cluster's, 120 s).
    """
    check_options(options)
    config = translate_snapshot(snapshot)
    validate_runnable(snapshot, config)
    _check_memory(snapshot, config)
    servers: list[EmbeddedValkey] = []
    if options.tiering is not None:
        tiering, embedded = start_embedded_servers(options.tiering)
        servers.extend(embedded)
        options = dataclasses.replace(options, tiering=tiering)
    try:
        start = DEFAULT_START_TIMEOUT_S if start_timeout_s is None else start_timeout_s
        return _run(snapshot, options, progress, max_steps, metrics, metrics_dir, events, start)
    finally:
        for server in servers:
            server.stop()


def _run(
    snapshot: EngineSnapshot,
    options: DemoOptions,
    progress: bool,
    max_steps: int,
    metrics: SchedulerMetrics | None,
    metrics_dir: str | None,
    events: KVEventPublisher | None,
    start_timeout_s: float,
) -> DemoResult:
    demo = DemoEngine(snapshot, options, metrics, events)
    check_workload_fits(options, demo.tph, demo.groups, demo.num_blocks)
    try:
        return _drive(demo, snapshot, options, progress, max_steps, metrics_dir, events, start_timeout_s)
    finally:
        demo.sched.close()


def _drive(
    demo: DemoEngine,
    snapshot: EngineSnapshot,
    options: DemoOptions,
    progress: bool,
    max_steps: int,
    metrics_dir: str | None,
    events: KVEventPublisher | None,
    start_timeout_s: float,
) -> DemoResult:
    started = time.perf_counter()
    cluster = WorkerCluster(
        snapshot,
        shared_pool=options.shared_pool,
        step_timeout_s=options.step_timeout_s,
        worker_timeout_s=options.worker_timeout_s,
        start_timeout_s=start_timeout_s,
        hook=HOOK,
        hook_options={"memcpy_probe_bytes": options.memcpy_probe_bytes},
        tiering=options.tiering,
        metrics_dir=metrics_dir,
    )
    cluster.start()
    bar = _progress(options.requests) if progress else None
    try:
        while not demo.done and demo.result.steps < max_steps:
            demo.step(cluster)
            if bar is not None:
                bar.update(demo.workload.issued - len(demo.waiting) - len(demo.running))
    finally:
        # a rank's final hook times every tier against its raw baseline: a network store takes seconds for that
        tiers = options.tiering is not None and bool(options.tiering.secondary_tiers)
        final = cluster.close(timeout_s=_CLOSE_WITH_TIERS_S if tiers else None)
        if bar is not None:
            bar.close()
    demo.sched.on_worker_reports(final.reports)
    demo.result.tiers = list(demo.sched.extension.figures().tiers)
    demo.observe(final=True)
    probes = [p for extras in final.attachments.values() if (p := memcpy_gbps_of(extras)) is not None]
    stats = demo.sched.stats()
    result = demo.result
    result.bytes_stored, result.bytes_loaded = stats.bytes_stored, stats.bytes_loaded
    result.store_seconds, result.load_seconds = stats.store_seconds, stats.load_seconds
    result.memcpy_gbps = sum(probes) / len(probes) if probes else 0.0
    costs = [c for extras in final.attachments.values() if (c := checksum_cost_of(extras)) is not None]
    if costs:
        result.checksum_cost = (sum(c[0] for c in costs) / len(costs), sum(c[1] for c in costs) / len(costs))
    result.tier_figures = _mean_tier_figures([tier_figures_of(extras) for extras in final.attachments.values()])
    result.host_chunks_filled = len(demo.manager)
    result.lookup_miss_reasons = {str(k): v for k, v in stats.lookup_miss_reasons.items()}
    result.chunk_miss_reasons = {str(k): v for k, v in stats.chunk_miss_reasons.items()}
    if events is not None:
        result.events_published, result.events_dropped = events.sent, events.dropped
    result.wall_seconds = time.perf_counter() - started
    if demo.result.steps >= max_steps:
        raise DeadlineError(f"the demo did not finish within max_steps={max_steps} steps")
    return result


_CLOSE_WITH_TIERS_S = 60.0
"""How long the workers get to drain and send their final figures when tiers are configured (default: 10 s)."""


def _mean_tier_figures(per_rank: list[list[TierFigures]]) -> list[TierFigures]:
    """Per tier, the mean over the ranks that measured each figure (NaN where none did)."""

    def mean(values: list[float]) -> float:
        known = [v for v in values if not math.isnan(v)]
        return sum(known) / len(known) if known else math.nan

    tiers = max((len(r) for r in per_rank), default=0)
    out: list[TierFigures] = []
    for t in range(tiers):
        rows = [r[t] for r in per_rank if len(r) > t]
        out.append(
            TierFigures(
                mean([f.write_gbps for f in rows]),
                mean([f.read_gbps for f in rows]),
                mean([f.probe_write_gbps for f in rows]),
                mean([f.probe_read_gbps for f in rows]),
                mean([f.raw_write_gbps for f in rows]),
                mean([f.raw_read_gbps for f in rows]),
            )
        )
    return out


def demo_memory_bytes(snapshot: EngineSnapshot, config: OffloadingConfig | None = None) -> tuple[int, int, int]:
    """``(total, kv bytes per worker, host pool bytes per worker)`` the demo's worker processes allocate."""
    config = translate_snapshot(snapshot) if config is None else config
    plan = plan_host_pool_from_config(config)
    kv_bytes = max((t.size for t in snapshot.kv_cache_config.kv_cache_tensors), default=0)
    pool_bytes = plan.num_chunks * plan.slot_bytes
    return config.parallel.world_size * (kv_bytes + pool_bytes), kv_bytes, pool_bytes


def _check_memory(snapshot: EngineSnapshot, config: OffloadingConfig) -> None:
    needed, kv_bytes, pool_bytes = demo_memory_bytes(snapshot, config)
    workers = config.parallel.world_size
    available = available_host_memory_bytes()
    if needed > available * MEMORY_SHARE:
        raise HostMemoryError(
            f"the demo needs {needed / 2**30:.1f} GiB ({workers} workers x ({kv_bytes / 2**30:.2f} GiB of KV "
            f"memory + {pool_bytes / 2**30:.2f} GiB of host pool)) but "
            f"{available / 2**30:.1f} GiB are available: use a snapshot with fewer num_blocks or a smaller "
            "--cpu-bytes, or let `kvoffload demo --shrink` reduce it to fit"
        )


class _progress:
    """A rich progress bar over finished requests (rich is a dependency; the bar goes to stderr)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("requests"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._progress.add_task("demo", total=total)
        self._progress.start()

    def update(self, completed: int) -> None:
        self._progress.update(self._task, completed=completed)

    def close(self) -> None:
        self._progress.stop()
