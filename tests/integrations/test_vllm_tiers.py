"""The connector's scheduler half with a disk tier: tier figures in vLLM's stats and Prometheus registry under
vLLM's tiering names, and ``kv_load_tiers`` read from a vLLM request's ``kv_transfer_params``.

No engine runs: the scheduler half is driven as vLLM's hooks drive it, its plans run on a real in-process worker
(copy engine, host pool, tier worker) over a real disk tier in a tmp dir.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvoffload import StepPlan, wire
from kvoffload.demo import default_snapshot
from kvoffload.integrations.vllm import KVOffloadConnector, parse_connector_config
from kvoffload.integrations.vllm._scheduler import _SchedulerHalf
from kvoffload.offload.keys import hash_token_blocks
from kvoffload.offload.pool import HostPool, plan_host_pool_from_config
from kvoffload.offload.worker import OffloadWorker
from kvoffload.offload.worker.copy import CopyEngine, transfer_layout_from_config
from kvoffload.tiers import Tiering, TierWorker
from kvoffload.translate import translate_snapshot

CHUNK = 256 * 1024
TOKENS = list(range(1, 129))


class _Half:
    """A scheduler half with one disk tier, and one worker running its plans."""

    def __init__(self, root: Path) -> None:
        snapshot = default_snapshot(workers=1, num_blocks=64, cpu_bytes=16 * CHUNK)
        self.config = translate_snapshot(snapshot)
        extra = {
            "cpu_bytes_to_use": 16 * CHUNK,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(root),
                    "n_read_threads": 2,
                    "n_write_threads": 2,
                    "enable_kv_events": True,
                }
            ],
            "tier_poll_interval_s": 0.0,
        }
        options = parse_connector_config(extra)
        self.half = _SchedulerHalf(self.config, options)
        self.sched = self.half.scheduler
        tensor = snapshot.kv_cache_config.kv_cache_tensors[0]
        self.kv = torch.randint(0, 256, (tensor.size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        self.pool = HostPool(plan_host_pool_from_config(self.config), pin_memory=False)
        layout = transfer_layout_from_config(snapshot.kv_cache_config, self.config)
        tiering = self.half.scheduler.extension
        assert isinstance(tiering, Tiering)
        self.tiering = tiering
        self.worker = OffloadWorker(
            CopyEngine(self.kv, layout, self.pool), rank=0, tiers=TierWorker(tiering.tiering, self.config, self.pool)
        )

    def step(self) -> None:
        plan = wire.decode(wire.encode(self.sched.build_step_plan())).expect(StepPlan)
        self.worker.start_step(plan)
        self.worker.wait_for_loads(plan, 30)
        self.worker.end_step(plan)
        self.sched.on_worker_reports([self.worker.drain(plan.step, 30)])

    def settle(self, sid: str) -> int:
        for _ in range(100):
            hit = self.sched.lookup(sid, 0)
            if hit is not None:
                return hit
            self.step()
            time.sleep(0.005)
        raise AssertionError(f"the lookup of {sid} never settled")

    def close(self) -> None:
        self.worker.close()
        self.half.close()
        self.pool.close()


def test_tier_figures_reach_vllms_stats_and_registry_under_vllms_names(tmp_path: Path) -> None:
    engine = _Half(tmp_path)
    try:
        engine.sched.add_request("A#0", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.settle("A#0") == 0
        engine.sched.on_blocks_allocated("A#0", [list(range(1, 9))])  # vLLM: block 0 is the null block
        engine.sched.on_tokens_computed("A#0", len(TOKENS))
        for _ in range(3):  # store, then cascade
            engine.step()
        engine.sched.finish_request("A#0")
        row = engine.tiering.stats[0]
        assert row.cascaded_chunks == 8 and row.bytes_written > 0
        stats = engine.half.interval_stats()
        assert stats.data["tier_cascaded_chunks@1:fs"] == 8
        assert stats.data["tiering_write_bytes@1:fs"] == row.bytes_written
        assert stats.data["tiering_chunk_queries@1:fs"] == 8, "the first lookup asked the tier for every chunk"
        assert "kvoffload_tiering_write_bytes{tier=1:fs}" in stats.reduce()
        assert "tiering_write_bytes@1:fs" not in engine.half.interval_stats().data, "interval increases only"
        events = engine.half.events()  # vLLM's own event types, as its publisher sends them
        assert [e.medium for e in events] == ["STORAGE"] * 8
        # vLLM's own hash form (an int by default), as vLLM 0.33's offloading events give placeholders
        expected = [[maybe_convert_block_hash(h)] for h in hash_token_blocks(TOKENS, 16)]
        assert [e.block_hashes for e in events] == expected

        from vllm.config import KVTransferConfig, VllmConfig

        registry = CollectorRegistry()
        types = {Counter: partial(Counter, registry=registry), Gauge: Gauge, Histogram: Histogram}
        transfer = KVTransferConfig(
            kv_connector="KVOffloadConnector", kv_connector_module_path="kvoffload.integrations.vllm", kv_role="kv_both"
        )
        prom = KVOffloadConnector.build_prom_metrics(
            VllmConfig(kv_transfer_config=transfer), types, ["model_name", "engine"], {0: ["tiny", "0"]}
        )
        assert prom is not None
        prom.observe(stats.data, 0)
        labels = {"model_name": "tiny", "engine": "0", "tier": "1:fs"}
        assert registry.get_sample_value("vllm:kv_offload_tiering_write_bytes_total", labels) == row.bytes_written
        assert registry.get_sample_value("vllm:kv_offload_tiering_write_time_total", labels) == row.write_seconds
        assert registry.get_sample_value("vllm:kv_offload_tiering_chunk_queries_total", labels) == 8
        assert registry.get_sample_value("kvoffload_tier_cascaded_chunks_total", labels) == 8
        assert registry.get_sample_value("kvoffload_lookups_total", {"model_name": "tiny", "engine": "0"}) == 1
    finally:
        engine.close()


def _request(req_id: str, params: dict[str, object] | None) -> object:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    extra = {} if params is None else {"kv_transfer_params": params}
    sampling = SamplingParams(max_tokens=1, extra_args=extra)
    return Request(req_id, TOKENS, sampling, None, block_hasher=get_request_block_hasher(16, sha256))


def test_kv_load_tiers_from_kv_transfer_params(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``[]`` allows no tier (the lookup answers from the host pool at once, the tier is never asked); no key or
    an all-invalid list allows every tier (the tier is asked: the first answer is RETRY), with a warning."""
    engine = _Half(tmp_path)
    caplog.set_level(logging.WARNING, logger="vllm.kvoffload")
    try:
        row = engine.tiering.stats[0]
        assert engine.half.lookup(_request("deny", {"kv_load_tiers": []}), 0) == (0, False)  # type: ignore[arg-type]
        assert row.chunk_queries == 0
        storage_only = {"kv_load_tiers": [{"medium": "CPU", "locality": "local"}]}
        assert engine.half.lookup(_request("cpu", storage_only), 0) == (0, False)  # type: ignore[arg-type]
        assert row.chunk_queries == 0, "a disk tier is STORAGE: a cpu-only filter excludes it"
        asked = _request("all", None)
        assert engine.half.lookup(asked, 0) == (None, False)  # type: ignore[arg-type]
        invalid = _request("bad", {"kv_load_tiers": [{"medium": "tape"}]})
        assert engine.half.lookup(invalid, 0) == (None, False)  # type: ignore[arg-type]
        assert any("kv_load_tiers entry {'medium': 'tape'}" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()
