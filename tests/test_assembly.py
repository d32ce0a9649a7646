"""One assembly per side: the extra config decoded once, the scheduler and the worker built from it."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from kvoffload import (
    ConfigError,
    LoadMode,
    SchedulerExtension,
    build_scheduler,
    build_worker,
    decode_extra_config,
    hash_token_blocks,
)
from kvoffload.assembly import tiering_of
from kvoffload.demo import default_snapshot
from kvoffload.offload.pool import plan_host_pool_from_config
from kvoffload.offload.worker.copy import transfer_layout_from_config
from kvoffload.tiers import FsTierConfig, Tiering
from kvoffload.translate import translate_snapshot
from tests.helpers import offloading_config

MiB = 1 << 20


def test_decode_extra_config_is_strict_and_holds_the_tiers(tmp_path: Path) -> None:
    extra = {
        "cpu_bytes_to_use": 4 * MiB,
        "eviction_policy": "arc",
        "offload_prompt_only": False,
        "load_mode": "sync",
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}],
        "tier_poll_interval_s": 0.0,
    }
    options = decode_extra_config(extra)
    assert (options.cpu_bytes_to_use, options.eviction_policy, options.load_mode) == (4 * MiB, "arc", LoadMode.SYNC)
    assert options.offload_prompt_only is False
    (tier,) = options.secondary_tiers
    assert isinstance(tier, FsTierConfig) and tier.root_dir == str(tmp_path)
    tiering = tiering_of(options)
    assert tiering.secondary_tiers == options.secondary_tiers and tiering.tier_poll_interval_s == 0.0

    with pytest.raises(ConfigError, match="evicton_policy"):
        decode_extra_config({"cpu_bytes_to_use": MiB, "evicton_policy": "lru"})
    with pytest.raises(ConfigError, match="store_threshold"):
        decode_extra_config({"cpu_bytes_to_use": MiB, "store_threshold": "two"})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]"):
        decode_extra_config({"cpu_bytes_to_use": MiB, "secondary_tiers": [{"type": "tape"}]})


@pytest.mark.parametrize("raw", [4 * MiB, str(4 * MiB), float(4 * MiB)])
def test_every_reader_takes_the_host_budget_by_vllms_int_rule(raw: object) -> None:
    """vLLM sizes its pool with ``int(cpu_bytes_to_use)``: the options, the runnability check and the pool plan
    all accept what it accepts, and read the same number of bytes."""
    extra = {"cpu_bytes_to_use": raw}
    assert decode_extra_config(extra).cpu_bytes_to_use == 4 * MiB
    config = offloading_config(extra_config=extra, worker_kv_bytes_per_block=4096)
    assert plan_host_pool_from_config(config).cpu_bytes_to_use == 4 * MiB
    assert build_scheduler(config).manager.num_chunks == plan_host_pool_from_config(config).num_chunks


@pytest.mark.parametrize(
    ("raw", "why"), [("lots", "is not a number of bytes"), ("-5", "must be > 0"), (True, "is not")]
)
def test_a_bad_host_budget_names_the_key_and_the_value(raw: object, why: str) -> None:
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config\['cpu_bytes_to_use'\]={raw!r} {why}"):
        decode_extra_config({"cpu_bytes_to_use": raw})


def _run_one_request(extra: dict[str, object]) -> tuple[int, str]:
    """Store a 64-token prompt that decodes 32 more tokens; (tokens stored, the manager's policy)."""
    config = offloading_config(extra_config=extra, worker_kv_bytes_per_block=4096)
    sched = build_scheduler(config)
    try:
        hashes = hash_token_blocks(list(range(96)), 16)
        sched.add_request("r", hashes[:4], 64)
        assert sched.lookup("r", 0) == 0
        sched.on_blocks_allocated("r", [[1, 2, 3, 4]])
        sched.on_tokens_computed("r", 64)
        sched.extend_request("r", hashes[4:], 96)
        sched.on_blocks_allocated("r", [[5, 6]])
        sched.on_tokens_computed("r", 96)
        stored = sum(len(job.chunk_ids) // 8 for job in sched.build_step_plan().store_jobs)
        return stored, sched.manager.policy_name
    finally:
        sched.close()


def test_build_scheduler_takes_policy_and_prompt_only_from_the_extra_config() -> None:
    assert _run_one_request({"cpu_bytes_to_use": MiB}) == (4, "lru")  # the prompt's 4 chunks only
    assert _run_one_request({"cpu_bytes_to_use": MiB, "eviction_policy": "arc", "offload_prompt_only": False}) == (
        6,
        "arc",
    )


def test_build_scheduler_composes_the_tiers_of_the_extra_config(tmp_path: Path) -> None:
    extra = {"cpu_bytes_to_use": MiB, "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "t")}]}
    sched = build_scheduler(offloading_config(extra_config=extra, worker_kv_bytes_per_block=4096))
    try:
        assert isinstance(sched.extension, Tiering)
        assert [row.name for row in sched.extension.stats] == ["fs"]
    finally:
        sched.close()
    plain = build_scheduler(offloading_config(extra_config={"cpu_bytes_to_use": MiB}, worker_kv_bytes_per_block=4096))
    assert type(plain.extension) is SchedulerExtension  # the null extension: nothing below the pool


def test_build_worker_builds_a_rank_and_closes_it_once() -> None:
    snapshot = default_snapshot(workers=1, num_blocks=16, cpu_bytes=4 * MiB)
    config = translate_snapshot(snapshot)
    layout = transfer_layout_from_config(snapshot.kv_cache_config, config)
    kv = torch.zeros(layout.engine_bytes, dtype=torch.uint8)
    parts = build_worker(config, kv, layout, checksums=False)
    assert parts.pool.num_chunks == plan_host_pool_from_config(config).num_chunks > 0
    assert parts.worker.engine.checksums is False and parts.worker.tiers is None
    parts.close()
    no_budget = msgspec.structs.replace(config, extra_config={})
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        build_worker(no_budget, kv, layout)  # nothing is built, nothing is left open
