"""What the vLLM connector's scheduler half says in the logs: one start line (the pool, every tier) and one summary
line at shutdown. Built directly (no engine): the lines are what an operator reads first."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload import MissReason, hash_token_blocks
from kvoffload.offload.pool import plan_host_pool_from_config
from kvoffload.offload.scheduler import SchedulerStats
from kvoffload.tiers import TierStatsRow
from tests.helpers import offloading_config


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def vllm_log() -> Iterator[_Lines]:
    """What the connector logs on vLLM's ``vllm.kvoffload`` logger (vLLM's handlers do not propagate to pytest's)."""
    handler = _Lines()
    log = logging.getLogger("vllm.kvoffload")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def test_start_line_says_engine_blocks_on_cpu_and_lists_every_tier() -> None:
    from kvoffload.integrations.vllm import parse_connector_config
    from kvoffload.integrations.vllm._scheduler import start_line

    config = offloading_config(extra_config={"cpu_bytes_to_use": 1 << 20})
    options = parse_connector_config({"cpu_bytes_to_use": 1 << 20})
    pool = plan_host_pool_from_config(config)
    cpu = start_line(pool, config, options, engine_on_cpu=True, tiers=["[0] fs a", "[1] valkey b"])
    assert cpu.startswith(f"kvoffload: host pool of {pool.num_chunks} chunks x {pool.row_bytes} bytes (")
    assert "1 engine blocks per chunk" in cpu and "GPU" not in cpu
    assert cpu.endswith("; 2 secondary tiers: [0] fs a; [1] valkey b")
    gpu = start_line(pool, config, options, engine_on_cpu=False)
    assert "1 GPU blocks per chunk, lru, async loads)" in gpu and "tier" not in gpu


def test_shutdown_line_sums_up_stores_loads_tiers_and_misses() -> None:
    from kvoffload.integrations.vllm._scheduler import shutdown_line

    stats = SchedulerStats(
        lookups=5,
        lookup_hits=2,
        lookups_deferred=4,
        chunks_stored=12,
        tokens_stored=192,
        chunks_loaded=6,
        tokens_loaded=96,
        lookup_miss_reasons={MissReason.NEVER_STORED: 1, MissReason.TIER_UNAVAILABLE: 2},
    )
    row = TierStatsRow("fs", cascaded_chunks=12, promoted_chunks=3, index=0, outages=1)
    line = shutdown_line(stats, [row])
    assert line.startswith("kvoffload: shutting down: stored 12 chunks (192 tokens), loaded 6 chunks (96 tokens)")
    assert "5 lookups, 2 hits, 4 re-asks" in line
    assert "secondary_tiers[0] (fs): cascaded 12 chunks (0 failed, 0 dropped), promoted 3 (0 failed), 1 outage" in line
    assert line.endswith("lookup misses by reason: tier_unavailable 2, never_stored 1")
    assert shutdown_line(SchedulerStats()).endswith("lookup misses by reason: none")


def test_the_scheduler_half_logs_its_tiers_at_start_and_one_summary_at_shutdown(
    tmp_path: Path, vllm_log: _Lines
) -> None:
    from kvoffload.integrations.vllm import parse_connector_config
    from kvoffload.integrations.vllm._config import connector_tiering
    from kvoffload.integrations.vllm._scheduler import _SchedulerHalf

    extra = {
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv"), "max_bytes": 1 << 30}],
    }
    options = parse_connector_config(extra)
    config = offloading_config(extra_config=extra)
    half = _SchedulerHalf(config, options, connector_tiering(options), engine_on_cpu=True)
    try:
        (start,) = vllm_log.lines
        assert "engine blocks per chunk" in start
        assert start.endswith(
            f"; 1 secondary tier: [0] fs root_dir={tmp_path / 'kv'} max_bytes={1 << 30}, 0 records found"
        )
        half.scheduler.add_request("r#0", hash_token_blocks(list(range(64)), 16), 64)
        assert half.scheduler.lookup("r#0", 0) in (None, 0)
    finally:
        half.close()
        half.close()  # vLLM may shut down twice: one summary
    summaries = [line for line in vllm_log.lines if line.startswith("kvoffload: shutting down:")]
    assert len(summaries) == 1
    assert "secondary_tiers[0] (fs): cascaded 0 chunks" in summaries[0] and "0 outages" in summaries[0]


def test_interval_stats_carry_re_asks_apart_from_lookups() -> None:
    """vLLM's stats and Prometheus get ``lookups`` once per final answer and the re-asks under their own name."""
    from kvoffload.integrations.vllm import parse_connector_config
    from kvoffload.integrations.vllm._scheduler import _SchedulerHalf

    config = offloading_config(extra_config={"cpu_bytes_to_use": 1 << 20})
    half = _SchedulerHalf(config, parse_connector_config({"cpu_bytes_to_use": 1 << 20}))
    try:
        hashes = hash_token_blocks(list(range(64)), 16)
        half.scheduler.add_request("a#0", hashes, 64)
        half.scheduler.add_request("b#1", hashes, 64)
        assert half.scheduler.lookup("a#0", 0) == 0
        half.scheduler.on_blocks_allocated("a#0", [[1, 2, 3, 4]])
        half.scheduler.on_tokens_computed("a#0", 64)
        half.scheduler.build_step_plan()  # a's stores are in flight: b's lookup is asked again later
        assert half.scheduler.lookup("b#1", 0) is None
        assert half.scheduler.lookup("b#1", 0) is None
        data = half.interval_stats().data
        assert data["lookups"] == 1 and data["lookups_deferred"] == 2
    finally:
        half.close()
