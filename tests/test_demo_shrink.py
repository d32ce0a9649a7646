"""Shrinking a real-size snapshot for the demo: what changes, what is kept, and when it refuses."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvoffload import ConfigError, HostMemoryError
from kvoffload._generated import MambaSpec, SlidingWindowSpec
from kvoffload.demo import DemoOptions, default_snapshot, shrink_snapshot
from kvoffload.demo.runner import demo_memory_bytes
from kvoffload.demo.shrink import format_bytes
from kvoffload.offload.worker.copy import transfer_layout_from_config
from kvoffload.translate import load_snapshot, translate_snapshot

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GiB = 1 << 30


def test_mla_across_eight_ranks_keeps_its_ranks_and_replicated_layout() -> None:
    original = load_snapshot(EXAMPLES / "deepseek-v3-mla-tp8.json")
    shrunk = shrink_snapshot(original, max_bytes=4 * GiB)
    kv = shrunk.snapshot.kv_cache_config
    assert shrunk.changes == (
        f"num_blocks 8192 -> {kv.num_blocks}",
        f"KV memory per worker 34.3 GiB -> {format_bytes(kv.num_blocks * 61 * 73728)}",
        shrunk.changes[2],
        shrunk.changes[3],
    )
    assert shrunk.changes[2].startswith("cpu pool 256 GiB -> ") and "(15279 -> " in shrunk.changes[2]
    assert shrunk.changes[3].startswith("world_size 8, groups and layout kept: ")
    assert 0 < kv.num_blocks < 8192
    (tensor,) = kv.kv_cache_tensors
    assert (tensor.size, tensor.layer_stride, tensor.block_stride) == (
        kv.num_blocks * 61 * 73728,
        kv.num_blocks * 73728,
        73728,
    )
    config = translate_snapshot(shrunk.snapshot)
    assert config.replicated_layout and config.parallel.world_size == 8 and config.cache.blocks_per_chunk == 4
    assert config.extra_config["cpu_bytes_to_use"] < 256 * GiB
    assert demo_memory_bytes(shrunk.snapshot)[0] <= 4 * GiB
    # The shrunk placement is still a valid layout of the translated groups.
    assert transfer_layout_from_config(kv, config).num_blocks == kv.num_blocks
    # Nothing but sizes changed: the model, ranks and groups are the original's.
    assert shrunk.snapshot.engine_config.parallel_config == original.engine_config.parallel_config
    assert kv.kv_cache_groups == original.kv_cache_config.kv_cache_groups


@pytest.mark.parametrize(("name", "spec_type"), [("gemma-swa-hybrid", SlidingWindowSpec), ("mamba-hybrid", MambaSpec)])
def test_hybrids_keep_their_groups_and_aliased_tensors(name: str, spec_type: type) -> None:
    original = load_snapshot(EXAMPLES / f"{name}.json")
    before = translate_snapshot(original)
    shrunk = shrink_snapshot(original, max_bytes=4 * GiB)
    kv = shrunk.snapshot.kv_cache_config
    after = translate_snapshot(shrunk.snapshot)
    assert after.groups == before.groups and len(after.groups) > 1
    assert any(g.sliding_window_size_in_chunks for g in after.groups)
    assert any(isinstance(g.kv_cache_spec, spec_type) for g in kv.kv_cache_groups)
    old = original.kv_cache_config
    for t, o in zip(kv.kv_cache_tensors, old.kv_cache_tensors, strict=True):
        assert t.layer_stride == 0 and t.block_stride == o.block_stride
        assert t.offset * old.num_blocks == o.offset * kv.num_blocks
        assert t.size * old.num_blocks == o.size * kv.num_blocks
    assert demo_memory_bytes(shrunk.snapshot)[0] <= 4 * GiB
    transfer_layout_from_config(kv, after)


def test_a_snapshot_that_fits_is_left_as_it_is() -> None:
    snapshot = default_snapshot(workers=2, num_blocks=64, cpu_bytes=8 << 20)
    shrunk = shrink_snapshot(snapshot, DemoOptions(requests=4, conversations=2, system_prompt_tokens=64))
    assert shrunk.changes == () and shrunk.snapshot == snapshot
    assert shrunk.describe() == "nothing changed: it fits as it is"


def test_the_workload_sizes_the_engine_pool() -> None:
    snapshot = load_snapshot(EXAMPLES / "llama-3.1-8b-tp2.json")
    small = shrink_snapshot(snapshot, DemoOptions(requests=2, conversations=2, system_prompt_tokens=64))
    large = shrink_snapshot(snapshot, DemoOptions(requests=48, conversations=2, system_prompt_tokens=2048))
    assert small.snapshot.kv_cache_config.num_blocks < large.snapshot.kv_cache_config.num_blocks


def test_refused_with_the_numbers_when_even_the_smallest_run_cannot_fit() -> None:
    snapshot = load_snapshot(EXAMPLES / "deepseek-v3-mla-tp8.json")
    with pytest.raises(
        HostMemoryError, match=r"cannot shrink the snapshot to fit: even num_blocks=\d+ .* world_size=8"
    ):
        shrink_snapshot(snapshot, max_bytes=64 << 20)
    with pytest.raises(ConfigError, match="max_bytes=0 must be > 0"):
        shrink_snapshot(snapshot, max_bytes=0)


def test_tensors_that_do_not_scale_with_num_blocks_are_refused() -> None:
    snapshot = load_snapshot(EXAMPLES / "llama-3.1-8b-tp2.json")
    kv = snapshot.kv_cache_config
    odd = msgspec.structs.replace(kv.kv_cache_tensors[0], size=kv.kv_cache_tensors[0].size + 1)
    broken = msgspec.structs.replace(snapshot, kv_cache_config=msgspec.structs.replace(kv, kv_cache_tensors=(odd,)))
    with pytest.raises(ConfigError, match=r"kv_cache_tensors\[0\]\.size=60129542145 is not a multiple of num_blocks"):
        shrink_snapshot(broken)


@pytest.mark.parametrize(
    ("value", "text"), [(512, "512 B"), (268435456, "256 MiB"), (3 << 29, "1.5 GiB"), (274877906944, "256 GiB")]
)
def test_format_bytes(value: int, text: str) -> None:
    assert format_bytes(value) == text


@pytest.mark.timeout(30)
def test_a_snapshot_that_cannot_run_at_its_real_size_is_refused_not_shrunk() -> None:
    """Shrinking keeps what is wrong with a snapshot: it is refused with the real numbers, before any sizing."""
    snapshot = load_snapshot(EXAMPLES / "llama-3.1-8b-tp2.json")
    kv = snapshot.kv_cache_config
    huge = msgspec.structs.replace(snapshot, kv_cache_config=msgspec.structs.replace(kv, num_blocks=2**40))
    with pytest.raises(
        ConfigError, match=r"beyond kv_cache_tensors\[0\]\.size=60129542144 \(num_blocks=1099511627776\)"
    ):
        shrink_snapshot(huge)
    zero = msgspec.structs.replace(kv.kv_cache_tensors[0], block_stride=0)
    broken = msgspec.structs.replace(snapshot, kv_cache_config=msgspec.structs.replace(kv, kv_cache_tensors=(zero,)))
    with pytest.raises(ConfigError, match=r"block_stride=0 of kv_cache_tensors\[0\] is smaller than its page_bytes"):
        shrink_snapshot(broken)
    with pytest.raises(ConfigError, match=r"^requests=1180591620717411303424 must be in \[1, 10000\]$"):
        shrink_snapshot(snapshot, DemoOptions(requests=2**70))
