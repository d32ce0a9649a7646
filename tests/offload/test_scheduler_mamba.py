"""Align-mode Mamba groups and the prefix-cache retention interval in the offload scheduler.

vLLM 0.33 §5.5: with an align-mode Mamba group a lookup's ``max_hit`` is rounded down to that group's chunk
(``tokens_per_block * blocks_per_chunk``) before any group is asked. §2.4: the scheduler checks
``prefix_cache_retention_interval`` (>= 0, a multiple of every window group's tokens per chunk).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest

from kvoffload import ConfigError, build_scheduler
from kvoffload.offload.keys import BlockHash, OffloadKey, make_offload_key
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.scheduler import OffloadScheduler
from kvoffload.translate import load_snapshot, translate_snapshot
from tests.helpers import offloading_config

TPH = 16
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mamba-hybrid.json"


def hashes(n: int) -> list[BlockHash]:
    out: list[BlockHash] = []
    prev = b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"m:{i}".encode()).digest()
        out.append(BlockHash(prev))
    return out


def scheduler(
    groups: list[tuple[int, int, int | None]], *, mamba: list[int], retention: int | None = None, **kw: int
) -> OffloadScheduler:
    config = offloading_config(
        [(gid, tpb, (f"l{gid}",), w) for gid, tpb, w in groups], tokens_per_hash=TPH, world_size=1
    )
    return OffloadScheduler(
        config,
        HostBlockManager(32, "lru"),
        mamba_align_group_ids=mamba,
        prefix_cache_retention_interval=retention,
        **kw,  # type: ignore[arg-type]
    )


def store(sched: OffloadScheduler, keys: list[OffloadKey], *, complete: bool = True) -> None:
    assert sched.manager.prepare_store(keys) is not None
    if complete:
        sched.manager.complete_store(keys)


# A full-attention group of 16-token chunks and an align-mode Mamba group of 64-token chunks (one key per
# four hash blocks, keyed by the last). A 120-token request: 7 full chunks, 1 Mamba chunk.
HYBRID = [(0, 16, None), (1, 64, 1)]


def _hybrid(**kw: int) -> tuple[OffloadScheduler, list[BlockHash]]:
    sched = scheduler(HYBRID, mamba=[1], **kw)
    hs = hashes(7)
    return sched, hs


def test_the_hit_end_is_rounded_down_to_the_mamba_chunk_before_any_group_is_asked() -> None:
    sched, hs = _hybrid()
    assert sched.mamba_align_tokens == 64
    store(sched, [make_offload_key(h, 0) for h in hs])
    store(sched, [make_offload_key(hs[3], 1)])
    sched.add_request("r", hs, 120)
    before = sched.manager.stats().lookups
    assert sched.lookup("r", 0) == 64
    # The full-attention group is asked about chunks 0-3 only (not up to token 119), the Mamba group about one.
    assert sched.manager.stats().lookups - before == 5


def test_a_pending_chunk_past_the_mamba_boundary_is_not_a_recompute() -> None:
    sched, hs = _hybrid(max_recompute_pending_tokens=48)
    full = [make_offload_key(h, 0) for h in hs]
    store(sched, full[:5] + full[6:])
    store(sched, [full[5]], complete=False)  # chunk 5 (tokens 80-95) is being written
    store(sched, [make_offload_key(hs[3], 1)])
    sched.add_request("r", hs, 120)
    assert sched.lookup("r", 0) == 64
    assert sched.stats().pending_recomputes == 0  # chunk 5 lies past the Mamba-aligned end: never wanted


def test_a_longer_request_loads_whole_mamba_chunks() -> None:
    sched = scheduler(HYBRID, mamba=[1])
    hs = hashes(12)
    store(sched, [make_offload_key(h, 0) for h in hs])
    store(sched, [make_offload_key(hs[i], 1) for i in (3, 7, 11)])
    sched.add_request("r", hs, 200)
    assert sched.lookup("r", 0) == 192
    assert sched.lookup("r", 64) == 128


def test_without_align_mode_mamba_groups_nothing_is_rounded() -> None:
    sched = scheduler([(0, 16, None)], mamba=[])
    assert sched.mamba_align_tokens is None
    hs = hashes(7)
    store(sched, [make_offload_key(h, 0) for h in hs])
    sched.add_request("r", hs, 120)
    assert sched.lookup("r", 0) == 112


@pytest.mark.parametrize(
    ("groups", "mamba", "message"),
    [
        (HYBRID, [0], r"mamba_align_group_ids: group 0 has sliding_window_size_in_chunks=None"),
        (HYBRID, [2], r"mamba_align_group_ids: group 2 is not an offloaded group"),
        ([*HYBRID, (2, 32, 1)], [1, 2], r"different tokens per chunk \[32, 64\]"),
    ],
)
def test_bad_mamba_align_group_ids_are_config_errors(
    groups: list[tuple[int, int, int | None]], mamba: list[int], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        scheduler(groups, mamba=mamba)


# -- prefix_cache_retention_interval ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "value", "message"),
    [
        (HYBRID, -16, r"^prefix_cache_retention_interval \(-16\) must be non-negative\.$"),
        (HYBRID, 32, r"^prefix_cache_retention_interval \(32\) must be a multiple of tokens_per_chunk \(64\)\.$"),
        ([(0, 16, None), (1, 16, 2)], 40, r"must be a multiple of tokens_per_chunk \(16\)"),
        (HYBRID, "64", r"^prefix_cache_retention_interval must be an int or None, got '64'$"),
        (HYBRID, True, r"must be an int or None, got True"),
    ],
)
def test_a_bad_retention_interval_is_a_config_error(
    groups: list[tuple[int, int, int | None]], value: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        scheduler(groups, mamba=[], retention=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("groups", "value"), [(HYBRID, 0), (HYBRID, 128), ([(0, 16, None)], 7), ([(0, 16, 2)], 48), (HYBRID, None)]
)
def test_a_retention_interval_on_window_chunk_boundaries_is_kept(
    groups: list[tuple[int, int, int | None]], value: int | None
) -> None:
    assert scheduler(groups, mamba=[], retention=value).prefix_cache_retention_interval == value


# -- build_scheduler reads the facts from the snapshot's KV cache config ----------------------------------


def test_build_scheduler_takes_mamba_eagle_and_retention_from_the_kv_cache_config() -> None:
    snapshot = load_snapshot(EXAMPLE)  # granite-h: full attention + nine align-mode Mamba groups, 400 tokens
    config = translate_snapshot(snapshot)
    kv = snapshot.kv_cache_config
    plain = build_scheduler(config)
    assert plain.mamba_align_tokens is None and not any(g.eagle for g in plain.groups)

    groups = list(kv.kv_cache_groups)
    groups[0] = msgspec.structs.replace(groups[0], is_eagle_group=True)
    kv = msgspec.structs.replace(kv, kv_cache_groups=tuple(groups), prefix_cache_retention_interval=800)
    sched = build_scheduler(config, kv_cache_config=kv)
    assert sched.mamba_align_tokens == 400 * config.cache.blocks_per_chunk
    assert [g.group_id for g in sched.groups if g.eagle] == [0]
    assert sched.prefix_cache_retention_interval == 800
    # The caller's EAGLE groups (e.g. none: the speculative config does not drop EAGLE blocks) win.
    assert not any(g.eagle for g in build_scheduler(config, kv_cache_config=kv, eagle_group_ids=()).groups)

    with pytest.raises(ConfigError, match=r"prefix_cache_retention_interval \(600\) must be a multiple"):
        build_scheduler(config, kv_cache_config=msgspec.structs.replace(kv, prefix_cache_retention_interval=600))
    with pytest.raises(ConfigError, match=r"kv_cache_config has 1 KV cache groups, but the offloading config"):
        build_scheduler(config, kv_cache_config=msgspec.structs.replace(kv, kv_cache_groups=tuple(groups[:1])))
