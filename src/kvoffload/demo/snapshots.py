"""The demo's engine snapshots: an embedded Llama-style one, and the connector overrides of the command line."""

from __future__ import annotations

import msgspec

from kvoffload._generated import (
    CacheConfig,
    DType,
    EngineConfig,
    EngineSnapshot,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
)
from kvoffload.errors import ConfigError

__all__ = ["MiB", "default_snapshot", "snapshot_with_overrides"]

MiB = 1 << 20


def default_snapshot(
    *, workers: int = 2, num_blocks: int = 256, cpu_bytes: int = 128 * MiB, policy: str = "lru"
) -> EngineSnapshot:
    """A Llama-style GQA model at reduced size: 4 layers, 8 KV heads of 128 (bf16), block 16, TP=workers.

    Pages are realistic (4 heads per rank x 16 tokens x (128 + 128) x 2 bytes = 32 KiB per layer at TP 2);
    the KV memory is layer-major, one backing allocation per worker, as vLLM lays it out.
    """
    total_heads = 8
    if workers < 1 or total_heads % workers:
        raise ConfigError(f"workers={workers} must divide the demo model's {total_heads} KV heads")
    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=total_heads // workers, head_size=128, dtype=DType.BFLOAT16)
    page = spec.num_kv_heads * spec.block_size * (spec.head_size * 2) * 2
    return EngineSnapshot(
        engine_config=EngineConfig(
            model_config=ModelConfig(
                model="demo/llama-style-gqa",
                dtype=DType.BFLOAT16,
                use_mla=False,
                total_num_kv_heads=total_heads,
            ),
            cache_config=CacheConfig(block_size=16),
            parallel_config=ParallelConfig(tensor_parallel_size=workers, world_size=workers),
            kv_transfer_config=KVTransferConfig(
                engine_id="kvoffload-demo",
                kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes, "eviction_policy": policy},
            ),
        ),
        kv_cache_config=KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=(
                KVCacheTensor(
                    size=len(layers) * num_blocks * page,
                    layers=layers,
                    layer_stride=num_blocks * page,
                    block_stride=page,
                ),
            ),
            kv_cache_groups=(KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec),),
        ),
    )


def snapshot_with_overrides(snapshot: EngineSnapshot, *, cpu_bytes: int | None, policy: str | None) -> EngineSnapshot:
    """Set ``cpu_bytes_to_use`` / ``eviction_policy`` in the snapshot's connector extra config."""
    engine = snapshot.engine_config
    transfer = engine.kv_transfer_config or KVTransferConfig(engine_id="kvoffload-demo")
    extra = dict(transfer.kv_connector_extra_config)
    if cpu_bytes is not None:
        extra["cpu_bytes_to_use"] = cpu_bytes
    if policy is not None:
        extra["eviction_policy"] = policy
    transfer = msgspec.structs.replace(transfer, kv_connector_extra_config=extra)
    return msgspec.structs.replace(snapshot, engine_config=msgspec.structs.replace(engine, kv_transfer_config=transfer))
