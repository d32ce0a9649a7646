"""Metrics: scheduler and worker recorders on an application-owned registry, snapshots, multiprocess mode, HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import msgspec
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvoffload import ConfigError, JobResult, MissReason, WorkerReport
from kvoffload.metrics import (
    HistogramSample,
    MetricSample,
    MetricsSnapshot,
    SchedulerMetrics,
    WorkerMetrics,
    add_worker_collector,
    mark_worker_dead,
    multiprocess_env,
    serve_metrics,
)
from kvoffload.offload.keys import make_offload_key
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.scheduler import OffloadScheduler
from tests.helpers import chained_hashes as _hashes
from tests.helpers import offloading_config


def _store(sched: OffloadScheduler, req: str, hs: list[bytes]) -> None:
    sched.add_request(req, hs, 16 * len(hs))
    sched.on_blocks_allocated(req, [list(range(len(hs)))])
    sched.on_tokens_computed(req, 16 * len(hs))
    plan = sched.build_step_plan()
    results = tuple(
        JobResult(job_id=j.job_id, success=True, is_store=True, num_bytes=64, seconds=0.001) for j in plan.store_jobs
    )
    sched.on_worker_reports([WorkerReport(rank=0, step=plan.step, results=results)])
    sched.finish_request(req)


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_scheduler_metrics_follow_the_scheduler_once_per_step() -> None:
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, min_interval_s=0)
    manager = HostBlockManager(4)
    sched = OffloadScheduler(offloading_config(), manager)
    a, b = _hashes("a", 4), _hashes("b", 4)
    _store(sched, "a", a)
    metrics.observe(sched)
    _store(sched, "b", b)  # evicts a's 4 chunks
    sched.add_request("a2", a, 64)
    assert sched.lookup("a2", 0) == 0
    sched.add_request("b2", b, 64)
    assert sched.lookup("b2", 0) == 48
    sched.forget_chunk(make_offload_key(b[3], 0), MissReason.CORRUPT)
    metrics.observe(sched)
    metrics.observe(sched)  # nothing new: nothing counted twice

    assert _value(registry, "kvoffload_lookups_total") == 2
    assert _value(registry, "kvoffload_lookup_hits_total") == 1
    assert _value(registry, "kvoffload_lookup_misses_total", reason="evicted") == 1
    assert _value(registry, "kvoffload_lookup_misses_total", reason="never_stored") == 0
    assert _value(registry, "kvoffload_chunk_misses_total", reason="evicted") == 3
    assert _value(registry, "kvoffload_evictions_total", tier="host") == 4
    assert _value(registry, "kvoffload_store_tokens_total", tier="host") == 128
    assert _value(registry, "kvoffload_corrupted_loads_total", tier="host") == 0  # no load failed verification
    assert _value(registry, "kvoffload_chunks_removed_total", tier="host", reason="corrupt") == 1
    assert _value(registry, "kvoffload_cpu_allocation_size_count") == 2
    assert _value(registry, "kvoffload_pool_chunks", tier="host", state="capacity") == 4
    # b2's lookup pins chunks 0..2 (b[3] was dropped): 3 pinned, 1 free
    assert _value(registry, "kvoffload_pool_chunks", tier="host", state="pinned") == 3
    assert _value(registry, "kvoffload_pool_chunks", tier="host", state="free") == 1
    assert _value(registry, "kvoffload_cpu_cache_usage_perc") == 0.75

    snap = metrics.take_snapshot()
    assert snap.counter("kvoffload_evictions", tier="host") == 4
    assert snap.counter("kvoffload_lookup_misses") == 1
    assert snap.gauge("kvoffload_cpu_cache_usage_perc") == 0.75
    hist = snap.histogram("kvoffload_cpu_allocation_size")
    assert hist is not None and hist.count == 2 and hist.samples == (4.0, 4.0)
    again = metrics.take_snapshot()  # counters are deltas: nothing happened since
    assert again.counters == () and again.histograms == () and again.gauges == snap.gauges
    # nothing went to prometheus_client's global registry
    assert prometheus_client.REGISTRY.get_sample_value("kvoffload_lookups_total") is None


def test_observe_is_rate_limited_without_losing_counts() -> None:
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, min_interval_s=3600)
    sched = OffloadScheduler(offloading_config(), HostBlockManager(4))
    assert metrics.observe(sched)  # the first reading always happens
    sched.add_request("a", _hashes("a", 4), 64)
    sched.lookup("a", 0)
    assert not metrics.observe(sched)
    assert _value(registry, "kvoffload_lookups_total") == 0
    assert metrics.observe(sched, force=True)
    assert _value(registry, "kvoffload_lookups_total") == 1
    with pytest.raises(ConfigError, match="min_interval_s"):
        SchedulerMetrics(min_interval_s=-1)


def test_backpressure_drops_and_event_batches() -> None:
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)
    metrics.record_backpressure_drops("disk", 3)
    metrics.record_backpressure_drops("disk")
    metrics.record_event_batches(sent=5, dropped=1)
    metrics.record_event_batches(sent=7, dropped=1)
    assert _value(registry, "kvoffload_backpressure_drops_total", tier="disk") == 4
    assert _value(registry, "kvoffload_kv_event_batches_total", outcome="sent") == 7
    assert _value(registry, "kvoffload_kv_event_batches_total", outcome="dropped") == 1
    with pytest.raises(ConfigError, match="tier"):
        metrics.record_backpressure_drops("")


def test_bad_tier_records_are_counted_from_the_reports() -> None:
    from kvoffload._packed import pack_int32
    from kvoffload.tiers import TierJobResult

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    results = (
        TierJobResult(job_id=1, failed=pack_int32([0, 2, 3]), corrupt=pack_int32([0, 3])),
        TierJobResult(job_id=2, failed=pack_int32([1])),
    )
    metrics.record(WorkerReport(rank=0, step=1, results=(), tier_results=results))
    assert _value(registry, "kvoffload_tier_bad_records_total") == 2


def test_worker_metrics_and_snapshot_only_mode() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    plain = WorkerMetrics()  # no registry: snapshot only
    report = WorkerReport(
        rank=0,
        step=1,
        results=(
            JobResult(job_id=1, success=True, is_store=False, num_bytes=2_000_000, seconds=0.002),
            JobResult(job_id=2, success=True, is_store=True, num_bytes=500, seconds=0.001),
            JobResult(job_id=3, success=False, is_store=False, num_bytes=0, seconds=0.0005),
        ),
    )
    metrics.record(report)
    plain.record(report)
    assert _value(registry, "kvoffload_load_bytes_total", tier="host") == 2_000_000
    assert _value(registry, "kvoffload_store_bytes_total", tier="host") == 500
    assert _value(registry, "kvoffload_load_time_total", tier="host") == pytest.approx(0.0025)
    assert _value(registry, "kvoffload_load_size_bucket", tier="host", le="5e+06") == 2
    assert _value(registry, "kvoffload_transfer_seconds_count", tier="host", direction="load") == 2
    assert _value(registry, "kvoffload_transfer_failures_total", tier="host", direction="load") == 1
    snap = plain.take_snapshot()
    assert snap.counter("kvoffload_load_bytes") == 2_000_000 and snap.counter("kvoffload_transfer_failures") == 1
    assert plain.registry is None


def test_snapshot_aggregate_and_wire_round_trip() -> None:
    a = MetricsSnapshot(
        counters=(MetricSample(name="c", labels={"tier": "host"}, value=2.0),),
        gauges=(MetricSample(name="g", value=0.5),),
        histograms=(HistogramSample(name="h", count=2, sum=3.0, samples=(1.0, 2.0)),),
    )
    b = MetricsSnapshot(
        counters=(
            MetricSample(name="c", labels={"tier": "host"}, value=3.0),
            MetricSample(name="c", labels={"tier": "disk"}, value=1.0),
        ),
        gauges=(MetricSample(name="g", value=0.25),),
        histograms=(HistogramSample(name="h", count=1, sum=5.0, samples=(5.0,)),),
    )
    total = a.aggregate(b)
    assert total.counter("c", tier="host") == 5.0 and total.counter("c") == 6.0
    assert total.gauge("g") == 0.25
    h = total.histogram("h")
    assert h is not None and (h.count, h.sum, h.samples) == (3, 8.0, (1.0, 2.0, 5.0))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(total), type=MetricsSnapshot) == total
    assert total.reduce() == {
        "c{tier=host}": 5.0,
        "c{tier=disk}": 1.0,
        "g": 0.25,
        "h_count": 3.0,
        "h_sum": 8.0,
    }
    assert MetricsSnapshot().is_empty() and not total.is_empty()


_CHILD = """
import sys
from prometheus_client import CollectorRegistry
from kvoffload import JobResult, WorkerReport
from kvoffload.metrics import WorkerMetrics
m = WorkerMetrics(CollectorRegistry())
m.record(WorkerReport(rank=0, step=0, results=(JobResult(job_id=0, success=True, is_store=False,
                                                          num_bytes=int(sys.argv[1]), seconds=0.5),)))
"""


def test_worker_processes_contribute_through_multiprocess_mode(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    add_worker_collector(registry, tmp_path)
    with multiprocess_env(tmp_path):
        procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(n)]) for n in (1000, 234)]
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ or os.environ["PROMETHEUS_MULTIPROC_DIR"] != str(tmp_path)
    for proc in procs:
        assert proc.wait(60) == 0
        mark_worker_dead(proc.pid, tmp_path)
    assert _value(registry, "kvoffload_load_bytes_total", tier="host") == 1234
    assert _value(registry, "kvoffload_load_time_total", tier="host") == 1.0
    assert _value(registry, "kvoffload_transfer_seconds_count", tier="host", direction="load") == 2
    with pytest.raises(ConfigError, match="does not exist"), multiprocess_env(tmp_path / "missing"):
        pass


def test_http_scrape_and_port_errors() -> None:
    registry = CollectorRegistry()
    SchedulerMetrics(registry).record_backpressure_drops("disk", 2)
    with serve_metrics(registry, 0) as server:
        body = urllib.request.urlopen(server.url, timeout=10).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(body)}
        drops = families["kvoffload_backpressure_drops"].samples
        assert [(s.labels, s.value) for s in drops if s.name.endswith("_total")] == [({"tier": "disk"}, 2.0)]
        with pytest.raises(ConfigError, match="cannot serve metrics"):
            serve_metrics(registry, server.port)
    with pytest.raises(ConfigError, match="metrics port"):
        serve_metrics(registry, 70000)
    with pytest.raises(ConfigError, match="registry"):
        SchedulerMetrics(object())  # type: ignore[arg-type]
