"""Byte-exact store -> wipe -> load round trips for every spec kind, layer-major and block-major placements.

Each case is a real translation (snapshot -> OffloadingConfig -> TransferLayout) of a one-group model
whose pages come from the layout math (padding, MLA alignment, Mamba shapes, uniform wrappers), so the
copy engine is exercised with the page sizes the translator computes, not hand-picked ones.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvoffload import (
    CacheConfig,
    ChunkedLocalAttentionSpec,
    DType,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVTransferConfig,
    MambaSpec,
    MLAAttentionSpec,
    ModelConfig,
    ParallelConfig,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    build_offloading_config,
)
from kvoffload.offload.pool import HostPool, plan_host_pool_from_config
from kvoffload.offload.worker.copy import CopyEngine, transfer_layout_from_config
from kvoffload.translate._spec_math import page_size_bytes, real_page_size_bytes

LAYERS = ("l0", "l1", "l2")
NUM_BLOCKS = 12
BS = 16

SPECS: dict[str, KVCacheSpec] = {
    "full": FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=DType.FLOAT16),
    "full_padded": FullAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=8, dtype=DType.FLOAT16, page_size_padded=1100
    ),
    "mla_aligned": MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=36, dtype=DType.BFLOAT16, alignment=256),
    "sliding_window": SlidingWindowSpec(
        block_size=BS, num_kv_heads=1, head_size=8, dtype=DType.FLOAT32, sliding_window=32
    ),
    "sliding_window_mla": SlidingWindowMLASpec(
        block_size=BS, num_kv_heads=1, head_size=20, dtype=DType.UINT8, sliding_window=64
    ),
    "chunked_local": ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=4, dtype=DType.INT8, attention_chunk_size=64
    ),
    "mamba_padded": MambaSpec(
        block_size=BS,
        shapes=((3, 5), (7,)),
        dtypes=(DType.FLOAT32, DType.BFLOAT16),
        page_size_padded=128,
        mamba_cache_mode="align",
    ),
    "uniform_mla": UniformTypeKVCacheSpecs(
        block_size=BS,
        kv_cache_specs={
            name: MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=12 + 4 * i, dtype=DType.UINT8)
            for i, name in enumerate(LAYERS)
        },
    ),
}


def snapshot(spec: KVCacheSpec, *, block_major: bool, bpc: int) -> tuple[EngineConfig, KVCacheConfig]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        pages = [page_size_bytes(spec.kv_cache_specs[n]) for n in LAYERS]
    else:
        pages = [page_size_bytes(spec)] * len(LAYERS)
    stride = max(pages)  # every layer slot has the widest (padded) page, as allocators align them
    if block_major:  # [block][layer] : a block's layers are contiguous
        tensor = KVCacheTensor(
            size=NUM_BLOCKS * stride * len(LAYERS),
            layers=LAYERS,
            layer_stride=stride,
            block_stride=stride * 3,
        )
    else:  # [layer][block]
        tensor = KVCacheTensor(
            size=NUM_BLOCKS * stride * len(LAYERS),
            layers=LAYERS,
            layer_stride=NUM_BLOCKS * stride,
            block_stride=stride,
        )
    engine = EngineConfig(
        model_config=ModelConfig(model="m", dtype=DType.FLOAT16, use_mla=False, total_num_kv_heads=2),
        cache_config=CacheConfig(block_size=BS),
        parallel_config=ParallelConfig(),
        kv_transfer_config=KVTransferConfig(
            engine_id="e", kv_connector_extra_config={"blocks_per_chunk": bpc, "cpu_bytes_to_use": 1 << 22}
        ),
    )
    kv = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=(tensor,),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=LAYERS, kv_cache_spec=spec),),
    )
    return engine, kv


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("block_major", [False, True], ids=["layer_major", "block_major"])
@pytest.mark.parametrize("bpc", [1, 3])
def test_round_trip_every_spec_kind(kind: str, block_major: bool, bpc: int) -> None:
    spec = SPECS[kind]
    engine_config, kv = snapshot(spec, block_major=block_major, bpc=bpc)
    config = build_offloading_config(engine_config, kv)
    layout = transfer_layout_from_config(kv, config)
    expected_pages = (
        [real_page_size_bytes(spec.kv_cache_specs[n]) for n in LAYERS]
        if isinstance(spec, UniformTypeKVCacheSpecs)
        else [real_page_size_bytes(spec)] * 3
    )
    assert [layer.page_bytes for layer in layout.groups[0].layers] == expected_pages
    gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()) + bpc)
    memory = torch.randint(0, 256, (kv.kv_cache_tensors[0].size,), dtype=torch.uint8, generator=gen)
    original = memory.clone()
    with (
        HostPool(plan_host_pool_from_config(config), check_memory=False) as pool,
        CopyEngine(memory, layout, pool) as engine,
    ):
        # Logical blocks 1..7 of a request (a partial first chunk when bpc > 1), in scattered engine blocks.
        blocks = [9, 2, 7, 0, 11, 4, 5]
        first_index = 1
        n_chunks = -(-(len(blocks) + first_index % bpc) // bpc)
        chunks = [3, 0, 5, 1, 4, 2, 6][:n_chunks]
        job = {
            "group_sizes": [len(blocks)],
            "block_indices": [first_index],
            "block_ids": blocks,
            "chunk_ids": chunks,
        }
        engine.submit_store(1, **job)  # type: ignore[arg-type]
        engine.wait([1])
        (stored,) = engine.poll()
        assert stored.success and stored.num_bytes == len(blocks) * sum(expected_pages)
        memory.zero_()
        engine.submit_load(2, **job)  # type: ignore[arg-type]
        engine.wait([2])
        (loaded,) = engine.poll()
        assert loaded.success and loaded.num_bytes == stored.num_bytes
    # Every offloaded page is back byte for byte; everything else stays zero.
    expected = torch.zeros_like(original)
    for layer in layout.groups[0].layers:
        for block in blocks:
            start = layer.engine_offset + block * layer.block_stride
            expected[start : start + layer.page_bytes] = original[start : start + layer.page_bytes]
    assert torch.equal(memory, expected)
