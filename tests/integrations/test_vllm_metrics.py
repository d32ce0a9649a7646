"""The connector's figures under vLLM 0.33's metric names: the name table, the stats' aggregation, the lookup
delays and transfer sizes the scheduler half measures, and ``LLM.get_metrics()`` of a real engine.

Only the last test starts an engine (in its own process, ``vllm_metrics_scenario.py``); the others drive the
scheduler half in-process, its plans run by a real worker (copy engine, host pool) where bytes must move.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm import SamplingParams
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvoffload import StepPlan, wire
from kvoffload.demo import default_snapshot
from kvoffload.errors import ConfigError, WireError
from kvoffload.integrations.vllm import (
    KVOffloadConnector,
    KVOffloadConnectorStats,
    KVOffloadWorkerMetadata,
    parse_connector_config,
)
from kvoffload.integrations.vllm._messages import (
    LOOKUP_ASYNC_BUCKETS,
    LOOKUP_SYNC_BUCKETS,
    VLLM_FIGURES,
)
from kvoffload.integrations.vllm._scheduler import _SchedulerHalf
from kvoffload.metrics import ALLOCATION_BUCKETS, SIZE_BUCKETS, STAT_METRICS, TIER_METRICS, TIERING_METRICS
from kvoffload.offload.keys import hash_token_blocks
from kvoffload.offload.pool import HostPool, plan_host_pool_from_config
from kvoffload.offload.worker import OffloadWorker
from kvoffload.offload.worker.copy import CopyEngine, transfer_layout_from_config
from kvoffload.translate import translate_snapshot
from tests.integrations.engines import run_script

CHUNK = 256 * 1024  # one chunk of default_snapshot(workers=1): 16 tokens
TOKENS = list(range(1, 129))  # 8 chunks
LABELS = {"model_name": "tiny", "engine": "0"}


def _prom(registry: CollectorRegistry) -> KVOffloadConnector:
    """The connector's Prometheus metrics on ``registry`` (vLLM hands the three metric classes in)."""
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    transfer = KVTransferConfig(
        kv_connector="KVOffloadConnector", kv_connector_module_path="kvoffload.integrations.vllm", kv_role="kv_both"
    )
    prom = KVOffloadConnector.build_prom_metrics(
        VllmConfig(kv_transfer_config=transfer), types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    assert prom is not None
    return prom


# ------------------------------------------------------------------------------------------------------------
# Names
# ------------------------------------------------------------------------------------------------------------


def test_figures_vllm_has_carry_vllms_names_and_buckets() -> None:
    expected = {
        "load_bytes": ("vllm:kv_offload_load_bytes", "counter"),
        "load_time": ("vllm:kv_offload_load_time", "counter"),
        "store_bytes": ("vllm:kv_offload_store_bytes", "counter"),
        "store_time": ("vllm:kv_offload_store_time", "counter"),
        "allocation_failure": ("vllm:kv_offload_allocation_failure", "counter"),
        "stores_skipped": ("vllm:kv_offload_stores_skipped", "counter"),
        "load_size": ("vllm:kv_offload_load_size", "histogram"),
        "store_size": ("vllm:kv_offload_store_size", "histogram"),
        "lookup_sync_delay_seconds": ("vllm:kv_offload_lookup_sync_delay_seconds", "histogram"),
        "lookup_async_delay_seconds": ("vllm:kv_offload_lookup_async_delay_seconds", "histogram"),
        "cpu_cache_usage_perc": ("vllm:kv_offload_cpu_cache_usage_perc", "gauge"),
        "cpu_cache_write_usage_perc": ("vllm:kv_offload_cpu_cache_write_usage_perc", "gauge"),
        "cpu_cache_read_usage_perc": ("vllm:kv_offload_cpu_cache_read_usage_perc", "gauge"),
        "cpu_allocation_size": ("vllm:kv_offload_cpu_allocation_size", "histogram"),
    }
    assert {name: (f.metric, f.kind) for name, f in VLLM_FIGURES.items()} == expected
    assert VLLM_FIGURES["load_size"].buckets == VLLM_FIGURES["store_size"].buckets == SIZE_BUCKETS
    assert SIZE_BUCKETS == (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
    assert VLLM_FIGURES["lookup_sync_delay_seconds"].buckets == LOOKUP_SYNC_BUCKETS
    assert (LOOKUP_SYNC_BUCKETS[0], LOOKUP_SYNC_BUCKETS[-1], len(LOOKUP_SYNC_BUCKETS)) == (1e-5, 1.0, 11)
    assert VLLM_FIGURES["lookup_async_delay_seconds"].buckets == LOOKUP_ASYNC_BUCKETS
    assert (LOOKUP_ASYNC_BUCKETS[0], LOOKUP_ASYNC_BUCKETS[-1], len(LOOKUP_ASYNC_BUCKETS)) == (1e-4, 10.0, 11)
    assert VLLM_FIGURES["cpu_allocation_size"].buckets == ALLOCATION_BUCKETS


def test_every_series_is_named_as_vllm_names_it_or_as_kvoffloads_own() -> None:
    registry = CollectorRegistry()
    _prom(registry)
    names = {metric.name for metric in registry.collect()}  # counters without their _total
    vllm_names = {n for n in names if n.startswith("vllm:")}
    ours = names - vllm_names
    assert all(n.startswith("kvoffload_") for n in ours), ours
    # The five counters vLLM registers up front, and the tiering's, are there under vLLM's names...
    assert {
        "vllm:kv_offload_load_bytes",
        "vllm:kv_offload_load_time",
        "vllm:kv_offload_store_bytes",
        "vllm:kv_offload_store_time",
        "vllm:kv_offload_allocation_failure",
    } <= vllm_names
    assert {vllm for _, vllm, _ in TIER_METRICS.values() if vllm} <= vllm_names
    # ...and never twice: no kvoffload_ series for a figure vLLM has.
    for data_name in VLLM_FIGURES:
        assert f"kvoffload_{data_name}" not in ours
    for _, vllm, _ in [*TIER_METRICS.values(), *TIERING_METRICS.values()]:
        assert vllm is None or vllm in vllm_names
    assert {f"kvoffload_{m}" for m in STAT_METRICS.values() if m not in VLLM_FIGURES} <= ours
    # Figures in seconds say so; vLLM's *_time counters keep vLLM's names.
    assert all(n.endswith("_seconds") for n in ours if "time" in n or "delay" in n or "latency" in n), ours


def test_prometheus_gets_counters_gauges_and_histograms_under_vllms_names() -> None:
    registry = CollectorRegistry()
    prom = _prom(registry)
    data = {
        "load_bytes": 3_000_000,
        "store_bytes": 7_000_000,
        "load_time": 0.25,
        "lookups": 2,
        "lookup_misses_never_stored": 1,
        "stores_skipped": 4,
        "load_size": [3_000_000],
        "store_size": [2_000_000, 5_000_000],
        "lookup_sync_delay_seconds": [2e-5, 3e-4, 0.2],
        "lookup_async_delay_seconds": [0.02],
        "cpu_cache_usage_perc": 0.5,
        "cpu_cache_write_usage_perc": 0.375,
        "cpu_cache_read_usage_perc": 0.125,
        "cpu_allocation_size": [2, 8],
    }
    prom.observe(data, 0)
    prom.observe({"load_bytes": 1, "cpu_cache_usage_perc": 0.0, "lookup_sync_delay_seconds": [0.7]}, 0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {**LABELS, **labels})

    assert value("vllm:kv_offload_load_bytes_total") == 3_000_001
    assert value("vllm:kv_offload_store_bytes_total") == 7_000_000
    assert value("vllm:kv_offload_load_time_total") == 0.25
    assert value("vllm:kv_offload_store_time_total") == 0.0  # registered up front, as vLLM does
    assert value("vllm:kv_offload_stores_skipped_total") == 4
    assert value("kvoffload_lookups_total") == 2
    assert value("kvoffload_lookup_misses_by_reason_total", reason="never_stored") == 1
    assert value("kvoffload_load_bytes_total") is None
    assert value("vllm:kv_offload_load_size_count") == 1
    assert value("vllm:kv_offload_load_size_bucket", le="1e+06") == 0
    assert value("vllm:kv_offload_load_size_bucket", le="5e+06") == 1
    assert value("vllm:kv_offload_store_size_count") == 2
    assert value("vllm:kv_offload_store_size_sum") == 7_000_000
    assert value("vllm:kv_offload_lookup_sync_delay_seconds_count") == 4
    assert value("vllm:kv_offload_lookup_sync_delay_seconds_bucket", le="1e-05") == 0
    assert value("vllm:kv_offload_lookup_sync_delay_seconds_bucket", le="5e-05") == 1
    assert value("vllm:kv_offload_lookup_sync_delay_seconds_bucket", le="1.0") == 4
    assert value("vllm:kv_offload_lookup_async_delay_seconds_count") == 1
    assert value("vllm:kv_offload_lookup_async_delay_seconds_bucket", le="0.05") == 1
    assert value("vllm:kv_offload_lookup_async_delay_seconds_bucket", le="0.01") == 0
    assert value("vllm:kv_offload_cpu_cache_usage_perc") == 0.0, "a gauge holds the latest value"
    assert value("vllm:kv_offload_cpu_cache_write_usage_perc") == 0.375
    assert value("vllm:kv_offload_cpu_cache_read_usage_perc") == 0.125
    assert value("vllm:kv_offload_cpu_allocation_size_bucket", le="4.0") == 1
    assert value("vllm:kv_offload_cpu_allocation_size_count") == 2
    with pytest.raises(WireError, match="load_size"):
        prom.observe({"load_size": 5}, 0)


# ------------------------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------------------------


def test_stats_aggregate_counters_add_gauges_overwrite_histograms_extend() -> None:
    first = KVOffloadConnectorStats(
        data={
            "load_bytes": 10,
            "lookups": 1,
            "lookup_sync_delay_seconds": [0.001],
            "cpu_cache_usage_perc": 0.5,
            "tiering_write_bytes@1:fs": 3,
        }
    )
    second = KVOffloadConnectorStats(
        data={
            "load_bytes": 5,
            "store_bytes": 7,
            "lookup_sync_delay_seconds": [0.002, 0.003],
            "lookup_async_delay_seconds": [0.5],
            "cpu_cache_usage_perc": 0.25,
            "tiering_write_bytes@1:fs": 4,
        }
    )
    total = first.aggregate(second)
    assert isinstance(total, KVOffloadConnectorStats)
    assert total.data == {
        "load_bytes": 15,
        "store_bytes": 7,
        "lookups": 1,
        "lookup_sync_delay_seconds": [0.001, 0.002, 0.003],
        "lookup_async_delay_seconds": [0.5],
        "cpu_cache_usage_perc": 0.25,
        "tiering_write_bytes@1:fs": 7,
    }
    # Neither input changed (vLLM keeps aggregating into accumulators).
    assert first.data["lookup_sync_delay_seconds"] == [0.001] and first.data["load_bytes"] == 10
    assert second.data["lookup_sync_delay_seconds"] == [0.002, 0.003]
    assert total.reduce() == {
        "kvoffload_cpu_cache_usage_perc": 0.25,
        "kvoffload_load_bytes": 15,
        "kvoffload_lookup_async_delay_seconds_count": 1,
        "kvoffload_lookup_async_delay_seconds_sum": 0.5,
        "kvoffload_lookup_sync_delay_seconds_count": 3,
        "kvoffload_lookup_sync_delay_seconds_sum": pytest.approx(0.006),
        "kvoffload_lookups": 1,
        "kvoffload_store_bytes": 7,
        "kvoffload_tiering_write_bytes{tier=1:fs}": 7,
    }
    # A gauge that went back to 0 is still news: only an interval without any figure is empty.
    assert not KVOffloadConnectorStats(data={"cpu_cache_usage_perc": 0.0}).is_empty()
    assert KVOffloadConnectorStats(data={}).is_empty()


def test_stats_refuse_malformed_figures() -> None:
    good = KVOffloadConnectorStats(data={"load_bytes": 1})
    with pytest.raises(WireError, match="load_size"):
        good.aggregate(KVOffloadConnectorStats(data={"load_size": 3}))
    with pytest.raises(WireError, match="load_bytes"):
        good.aggregate(KVOffloadConnectorStats(data={"load_bytes": [1, 2]}))
    with pytest.raises(WireError, match="lookups"):
        good.aggregate(KVOffloadConnectorStats(data={"lookups": "2"}))
    with pytest.raises(WireError, match="store_size"):
        good.aggregate(KVOffloadConnectorStats(data={"store_size": [1, None]}))
    with pytest.raises(ConfigError, match="KVOffloadConnectorStats"):
        good.aggregate(KVConnectorStats(data={"load_bytes": 1}))  # another connector's stats


# ------------------------------------------------------------------------------------------------------------
# What the scheduler half measures
# ------------------------------------------------------------------------------------------------------------


def _hasher(request: Request) -> list[bytes]:
    """vLLM's per-request block hasher, at the connector's 16-token hash blocks (only the new full blocks)."""
    return hash_token_blocks(request.all_token_ids, 16)[len(request.block_hashes) :]


def _request(req_id: str) -> Request:
    return Request(req_id, list(TOKENS), SamplingParams(max_tokens=4), None, block_hasher=_hasher)


class _Engine:
    """The scheduler half as vLLM's hooks drive it, its plans run by one real in-process worker."""

    def __init__(self) -> None:
        snapshot = default_snapshot(workers=1, num_blocks=64, cpu_bytes=16 * CHUNK)
        self.config = translate_snapshot(snapshot)
        self.half = _SchedulerHalf(self.config, parse_connector_config({"cpu_bytes_to_use": 16 * CHUNK}))
        tensor = snapshot.kv_cache_config.kv_cache_tensors[0]
        self.kv = torch.randint(0, 256, (tensor.size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        self.pool = HostPool(plan_host_pool_from_config(self.config), pin_memory=False)
        layout = transfer_layout_from_config(snapshot.kv_cache_config, self.config)
        self.worker = OffloadWorker(CopyEngine(self.kv, layout, self.pool), rank=0)

    def plan(self) -> StepPlan:
        """The step's plan, as the workers receive it (its jobs are in flight until :meth:`run` reports them)."""
        return wire.decode(wire.encode(self.half.scheduler.build_step_plan())).expect(StepPlan)

    def run(self, plan: StepPlan) -> None:
        """The worker runs ``plan``; its report goes back to the half as vLLM hands it over."""
        self.worker.start_step(plan)
        self.worker.wait_for_loads(plan, 30)
        self.worker.end_step(plan)
        report = self.worker.drain(plan.step, 30)
        meta = KVOffloadWorkerMetadata([bytes(wire.encode(report)[0])])
        self.half.on_output(KVConnectorOutput(kv_connector_worker_meta=meta))

    def close(self) -> None:
        self.worker.close()
        self.half.close()
        self.pool.close()


def test_lookup_delays_and_transfer_sizes_reach_the_stats_and_prometheus() -> None:
    engine = _Engine()
    try:
        half = engine.half
        a, b = _request("a"), _request("b")
        assert half.lookup(a, 0) == (0, False)  # nothing stored yet: answered at once, no deferral
        sid = half.track(a).sid
        half.scheduler.on_blocks_allocated(sid, [list(range(1, 9))])  # vLLM: block 0 is the null block
        half.scheduler.on_tokens_computed(sid, len(TOKENS))
        stores = engine.plan()  # a's stores are in flight
        mid = half.interval_stats().data
        assert len(mid["lookup_sync_delay_seconds"]) == 1 and "lookup_async_delay_seconds" not in mid
        assert mid["cpu_allocation_size"] == [8], "one store offer of 8 chunks"
        assert mid["cpu_cache_write_usage_perc"] == mid["cpu_cache_usage_perc"] == 8 / 16
        assert "cpu_cache_read_usage_perc" not in mid, "unchanged gauges are not repeated"
        deferred_at = time.monotonic()
        assert half.lookup(b, 0) == (None, False), "b waits for a's stores"
        time.sleep(0.02)
        assert half.lookup(b, 0) == (None, False)
        engine.run(stores)  # the stores land
        hit, load_async = half.lookup(b, 0)
        answered_at = time.monotonic()
        assert hit == len(TOKENS) - 16 and load_async  # whole chunks, the last token left to compute
        half.scheduler.on_blocks_allocated(half.track(b).sid, [list(range(9, 17))], num_external_tokens=hit)
        engine.run(engine.plan())  # b's load
        stats = half.interval_stats()
        data = stats.data

        assert len(data["lookup_sync_delay_seconds"]) == 3, "one sample per lookup call"
        assert all(0 <= s < 1 for s in data["lookup_sync_delay_seconds"])
        (async_delay,) = data["lookup_async_delay_seconds"]
        assert 0.02 <= async_delay <= answered_at - deferred_at + 0.001, "from the first deferred call on"
        assert data["store_size"] == [8 * CHUNK] and data["store_bytes"] == 8 * CHUNK  # one job, 8 chunks
        assert data["load_size"] == [7 * CHUNK] and data["load_bytes"] == 7 * CHUNK
        assert "cpu_allocation_size" not in data, "the loads allocated nothing"
        assert data["cpu_cache_write_usage_perc"] == data["cpu_cache_usage_perc"] == 0.0, "back to idle: reported"
        again = half.interval_stats().data
        assert not any(isinstance(v, list) for v in again.values()), "samples are reported once"

        registry = CollectorRegistry()
        _prom(registry).observe(data, 0)
        assert registry.get_sample_value("vllm:kv_offload_store_bytes_total", LABELS) == 8 * CHUNK
        assert registry.get_sample_value("vllm:kv_offload_load_bytes_total", LABELS) == 7 * CHUNK
        assert registry.get_sample_value("vllm:kv_offload_lookup_sync_delay_seconds_count", LABELS) == 3
        assert registry.get_sample_value("vllm:kv_offload_lookup_async_delay_seconds_count", LABELS) == 1
        assert registry.get_sample_value("vllm:kv_offload_store_size_count", LABELS) == 1
        assert registry.get_sample_value("vllm:kv_offload_load_size_count", LABELS) == 1
        assert registry.get_sample_value("vllm:kv_offload_cpu_cache_usage_perc", LABELS) == 0.0
    finally:
        engine.close()


def test_a_request_that_ends_while_deferred_has_its_wait_measured() -> None:
    engine = _Engine()
    try:
        half = engine.half
        a, b = _request("a"), _request("b")
        assert half.lookup(a, 0) == (0, False)
        sid = half.track(a).sid
        half.scheduler.on_blocks_allocated(sid, [list(range(1, 9))])
        half.scheduler.on_tokens_computed(sid, len(TOKENS))
        stores = engine.plan()
        assert half.lookup(b, 0) == (None, False)
        half.interval_stats()
        half.finished(b)  # aborted while it waited (vLLM: the delay ends at the request's end)
        assert len(half.interval_stats().data["lookup_async_delay_seconds"]) == 1
        half.finished(b)
        assert "lookup_async_delay_seconds" not in half.interval_stats().data, "measured once"
        engine.run(stores)
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------------------------
# A real engine
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_llm_get_metrics_sees_the_connectors_figures(tiny_model: Path) -> None:
    """vLLM's reader returns only ``vllm:`` metrics: the connector's transfer and lookup figures are among them."""
    result = run_script(Path(__file__).with_name("vllm_metrics_scenario.py"), tiny_model)
    figures = result["figures"]
    assert result["lookups_deferred"] >= 1, "b's lookup waited for a's stores"
    assert figures["vllm:kv_offload_load_bytes"] == result["bytes_loaded"] > 0
    assert figures["vllm:kv_offload_store_bytes"] == result["bytes_stored"] > 0
    assert figures["vllm:kv_offload_load_size"]["count"] >= 1
    assert figures["vllm:kv_offload_store_size"]["count"] >= 1
    assert figures["vllm:kv_offload_lookup_sync_delay_seconds"]["count"] >= 3  # a, b deferred, b answered
    assert figures["vllm:kv_offload_lookup_async_delay_seconds"]["count"] >= 1
    assert figures["vllm:kv_offload_lookup_async_delay_seconds"]["sum"] > 0
    assert "vllm:kv_offload_cpu_allocation_size" in figures
