"""Worker-side metrics: bytes, seconds and failures of every finished transfer, from the worker's reports."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvoffload._generated import WorkerReport
from kvoffload.metrics._recorder import _DEFAULT_MAX_SAMPLES, _check_tier, _Recorder
from kvoffload.metrics._samples import MetricsSnapshot

__all__ = ["SIZE_BUCKETS", "TIME_BUCKETS", "WorkerMetrics"]

SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
"""Bytes per transfer job (vLLM's ``kv_offload_load_size`` / ``store_size`` buckets)."""
TIME_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0, 10.0)
"""Seconds per transfer job."""


class WorkerMetrics:
    """Worker-side transfer metrics, recorded from each :class:`WorkerReport` the worker sends.

    In a spawned worker (multiprocess mode) ``registry`` may be a private ``CollectorRegistry()``: the values
    go to the multiprocess directory either way, and the parent's :func:`add_worker_collector` sums them.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, tier: str = "host", max_samples: int = _DEFAULT_MAX_SAMPLES
    ) -> None:
        self.tier = _check_tier(tier)
        r = self._rec = _Recorder(registry, max_samples)
        fam = r.counter_family("load_bytes", "Bytes loaded from the tier into the engine.", ("tier",))
        self.load_bytes = r.counter(fam, "load_bytes", tier=tier)
        fam = r.counter_family("load_time", "Seconds spent loading (sum over jobs).", ("tier",))
        self.load_time = r.counter(fam, "load_time", tier=tier)
        fam = r.counter_family("store_bytes", "Bytes stored from the engine into the tier.", ("tier",))
        self.store_bytes = r.counter(fam, "store_bytes", tier=tier)
        fam = r.counter_family("store_time", "Seconds spent storing (sum over jobs).", ("tier",))
        self.store_time = r.counter(fam, "store_time", tier=tier)
        hfam = r.histogram_family("load_size", "Bytes per load job.", SIZE_BUCKETS, ("tier",))
        self.load_size = r.histogram(hfam, "load_size", tier=tier)
        hfam = r.histogram_family("store_size", "Bytes per store job.", SIZE_BUCKETS, ("tier",))
        self.store_size = r.histogram(hfam, "store_size", tier=tier)
        hfam = r.histogram_family("transfer_seconds", "Seconds per transfer job.", TIME_BUCKETS, ("tier", "direction"))
        self.load_seconds = r.histogram(hfam, "transfer_seconds", tier=tier, direction="load")
        self.store_seconds = r.histogram(hfam, "transfer_seconds", tier=tier, direction="store")
        fam = r.counter_family("transfer_failures", "Transfer jobs a worker failed.", ("tier", "direction"))
        self.load_failures = r.counter(fam, "transfer_failures", tier=tier, direction="load")
        self.store_failures = r.counter(fam, "transfer_failures", tier=tier, direction="store")
        fam = r.counter_family(
            "tier_bad_records", "Secondary-tier records found bad (damaged, foreign, unauthenticated) and deleted."
        )
        self.tier_bad_records = r.counter(fam, "tier_bad_records")

    @property
    def registry(self) -> CollectorRegistry | None:
        """The registry the series are registered on (None: snapshots only)."""
        return self._rec.registry

    def record(self, report: WorkerReport) -> None:
        """Record every job result of ``report``: sizes and times per job, byte and time totals once per report."""
        load_bytes = store_bytes = load_failed = store_failed = 0
        load_time = store_time = 0.0
        for result in report.results:
            if result.is_store:
                store_bytes += result.num_bytes
                store_time += result.seconds
                store_failed += not result.success
                self.store_size.observe(result.num_bytes)
                self.store_seconds.observe(result.seconds)
            else:
                load_bytes += result.num_bytes
                load_time += result.seconds
                load_failed += not result.success
                self.load_size.observe(result.num_bytes)
                self.load_seconds.observe(result.seconds)
        if load_bytes or load_time:
            self.load_bytes.inc(load_bytes)
            self.load_time.inc(load_time)
        if store_bytes or store_time:
            self.store_bytes.inc(store_bytes)
            self.store_time.inc(store_time)
        if load_failed:
            self.load_failures.inc(load_failed)
        if store_failed:
            self.store_failures.inc(store_failed)
        bad = sum(len(result.corrupt) // 4 for result in report.tier_results)  # packed int32 indices
        if bad:
            self.tier_bad_records.inc(bad)

    def take_snapshot(self) -> MetricsSnapshot:
        """The figures since the previous snapshot, engine-neutral (see :class:`MetricsSnapshot`)."""
        return self._rec.take_snapshot()
