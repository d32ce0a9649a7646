"""Which engines share tier records: byte-compatible rows only, and a replicated layout across parallel sizes."""

from __future__ import annotations

import msgspec

from kvoffload.tiers import namespace_for, namespaces_for_all_ranks
from tests.helpers import offloading_config


def _config(world_size: int, *, replicated: bool, rank: int = 0) -> object:
    config = offloading_config(world_size=world_size, rank=rank, worker_kv_bytes_per_block=18432)
    return msgspec.structs.replace(config, replicated_layout=replicated)


def test_a_replicated_layout_shares_one_namespace_across_parallel_sizes() -> None:
    """vLLM's FileMapper collapses TP for a replicated layout (MLA): a TP 2 writer and a TP 4 reader share."""
    tp2, tp4 = _config(2, replicated=True), _config(4, replicated=True, rank=3)
    assert namespace_for(tp2) == namespace_for(tp4)  # type: ignore[arg-type]
    assert namespaces_for_all_ranks(tp4) == [namespace_for(tp2)]  # type: ignore[arg-type]


def test_rank_sliced_layouts_keep_parallel_sizes_and_ranks_apart() -> None:
    tp2, tp4 = _config(2, replicated=False), _config(4, replicated=False)
    assert namespace_for(tp2) != namespace_for(tp4)  # type: ignore[arg-type]
    assert namespace_for(tp2, 0) != namespace_for(tp2, 1)  # type: ignore[arg-type]
    assert namespace_for(_config(2, replicated=True)) != namespace_for(tp2)  # type: ignore[arg-type]
