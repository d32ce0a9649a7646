"""A replicated layout (MLA over several ranks) keeps ONE host pool for the whole engine, not one per rank."""

from __future__ import annotations

import msgspec
import pytest

from kvoffload import OffloadingConfig
from kvoffload.integrations.vllm import _replicated_pool_id
from kvoffload.offload.pool import HostPool, plan_host_pool_from_config
from tests.helpers import offloading_config


def _config(
    *, replicated: bool, world_size: int, rank: int = 0, engine: str = "9f1c-uuid", dp: int = 0
) -> OffloadingConfig:
    config = offloading_config(
        world_size=world_size, rank=rank, worker_kv_bytes_per_block=64 << 10, extra_config={"cpu_bytes_to_use": 8 << 20}
    )
    parallel = msgspec.structs.replace(config.parallel, data_parallel_index=dp)
    return msgspec.structs.replace(config, replicated_layout=replicated, engine_id=engine, parallel=parallel)


def test_only_a_replicated_layout_over_several_ranks_shares_one_pool() -> None:
    assert _replicated_pool_id(_config(replicated=False, world_size=4)) is None
    assert _replicated_pool_id(_config(replicated=True, world_size=1)) is None
    shared = _replicated_pool_id(_config(replicated=True, world_size=4))
    assert shared is not None
    ranks = {_replicated_pool_id(_config(replicated=True, world_size=4, rank=r)) for r in range(4)}
    assert ranks == {shared}, "every rank of the engine maps the same pool"
    assert _replicated_pool_id(_config(replicated=True, world_size=4, dp=1)) != shared
    assert _replicated_pool_id(_config(replicated=True, world_size=4, engine="other")) != shared
    assert _replicated_pool_id(_config(replicated=True, world_size=4, engine="a/b c")) == "vllm-a-b-c-dp0"


def test_ranks_of_a_replicated_engine_map_one_copy_of_the_budget() -> None:
    configs = [_config(replicated=True, world_size=2, rank=r, engine="pool-test") for r in range(2)]
    pool_id = _replicated_pool_id(configs[0])
    plans = [plan_host_pool_from_config(c) for c in configs]
    with HostPool(plans[0], engine_id=pool_id) as first, HostPool(plans[1], engine_id=pool_id) as second:
        assert first.path == second.path and first.path is not None
        one_copy = plans[0].num_chunks * plans[0].slot_bytes
        assert one_copy <= first.path.stat().st_size < 2 * one_copy  # the rows once (and the table), not per rank
        assert first.writes and not second.writes  # rank 0 writes, the others read the same rows
        first.rows[0, :4] = 7
        assert second.rows[0, :4].tolist() == [7, 7, 7, 7]


if __name__ == "__main__":
    pytest.main([__file__])
