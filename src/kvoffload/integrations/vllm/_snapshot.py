"""Live vLLM engine -> EngineSnapshot (``snapshot_from_vllm``), and fitting the chunk size to vLLM's block size."""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from fractions import Fraction
from typing import TYPE_CHECKING

import msgspec
import torch

from kvoffload._generated import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    EngineSnapshot,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvoffload._ints import round_up
from kvoffload.errors import ConfigError
from kvoffload.translate import translate_snapshot

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmKVCacheConfig


logger = logging.getLogger("vllm.kvoffload")  # a child of vLLM's logger: printed in its format

_NULL_BLOCK_ID = 0
"""vLLM's placeholder block (a block a sliding window dropped): never stored, never loaded into."""

# vLLM spec class name -> our union tag, most specific first (subclasses resolve through the MRO).
_SPEC_TAGS: dict[str, tuple[str, type[msgspec.Struct]]] = {
    "SlidingWindowMLASpec": ("sliding_window_mla", SlidingWindowMLASpec),
    "SlidingWindowSpec": ("sliding_window", SlidingWindowSpec),
    "HiddenStateCacheSpec": ("hidden_state_cache", HiddenStateCacheSpec),
    "MLAAttentionSpec": ("mla_attention", MLAAttentionSpec),
    "ChunkedLocalAttentionSpec": ("chunked_local_attention", ChunkedLocalAttentionSpec),
    "CircularBufferSpec": ("circular_buffer", CircularBufferSpec),
    "FullAttentionSpec": ("full_attention", FullAttentionSpec),
    "MambaSpec": ("mamba", MambaSpec),
    "UniformTypeKVCacheSpecs": ("uniform_type", UniformTypeKVCacheSpecs),
}


def _plain(value: object, where: str) -> object:
    """A vLLM attribute value as the JSON-like value our schema decodes (dtypes, enums, tuples)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        if type(value).__name__ == "KVQuantMode":
            return value.name.lower()
        return value.value if isinstance(value.value, str) else value.name.lower()
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, Fraction):
        raise ConfigError(f"{where}={value}: a Fraction is only expressible as an attention spec's tokens_per_state")
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise ConfigError(f"{where}: cannot represent a {type(value).__name__} ({value!r}) in a snapshot")


def _spec_document(spec: object, where: str) -> dict[str, object]:
    """One vLLM KV cache spec as our tagged-union document: the fields our schema declares, vLLM's values."""
    for cls in type(spec).__mro__:
        found = _SPEC_TAGS.get(cls.__name__)
        if found is not None:
            break
    else:
        raise ConfigError(
            f"{where}: vLLM spec type {type(spec).__name__} has no kvoffload equivalent "
            f"(supported: {', '.join(_SPEC_TAGS)})"
        )
    tag, ours = found
    document: dict[str, object] = {"type": tag}
    for name in ours.__struct_fields__:
        if (
            name == "tokens_per_state"
            and issubclass(ours, AttentionSpec)
            and isinstance(getattr(spec, name, None), Fraction)
        ):
            document.update(_state_fields(getattr(spec, name), f"{where}.{name}"))
        elif name == "kv_cache_specs":
            inner = getattr(spec, "kv_cache_specs", {})
            document[name] = {
                layer: _spec_document(s, f"{where}.kv_cache_specs[{layer!r}]") for layer, s in inner.items()
            }
        elif hasattr(spec, name):
            document[name] = _plain(getattr(spec, name), f"{where}.{name}")
    return document


def _state_fields(value: Fraction, where: str) -> dict[str, object]:
    """vLLM's ``tokens_per_state = Fraction(1, n)`` (n states per token) as ``states_per_token = n``; any other
    fraction (vLLM documents whole tokens per state or ``Fraction(1, n)`` only) is refused naming it."""
    if value.numerator != 1 or value.denominator < 1:
        raise ConfigError(
            f"{where}=Fraction({value.numerator}, {value.denominator}): only an int or Fraction(1, n) "
            "(n states per token) can be expressed in a snapshot"
        )
    return {"tokens_per_state": 1, "states_per_token": value.denominator}


def _executor_backend(backend: object) -> str | None:
    if backend is None or isinstance(backend, str):
        return backend
    return getattr(backend, "__qualname__", type(backend).__name__)


def snapshot_from_vllm(vllm_config: VllmConfig, kv_cache_config: VllmKVCacheConfig) -> EngineSnapshot:
    """The :class:`~kvoffload.EngineSnapshot` of a live vLLM engine (what ``kvoffload translate`` reads).

    Field names are vLLM's, so the snapshot is a faithful dump; ``msgspec.json.encode`` it to write a file.
    Raises :class:`~kvoffload.ConfigError` naming the attribute when the engine holds something the schema
    cannot express (an unknown spec type, a ``tokens_per_state`` fraction other than ``Fraction(1, n)``, which
    becomes ``states_per_token = n``).
    """
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    ktc, kec = vllm_config.kv_transfer_config, vllm_config.kv_events_config
    kv_cache_layout = getattr(cc, "kv_cache_layout", None)
    engine: dict[str, object] = {
        "model_config": {
            "model": str(mc.model),
            "dtype": _plain(mc.dtype, "model_config.dtype"),
            "use_mla": bool(mc.use_mla),
            "total_num_kv_heads": int(mc.get_total_num_kv_heads()),
            "max_model_len": int(mc.max_model_len or 0),
        },
        "cache_config": {
            "block_size": int(cc.block_size),
            "cache_dtype": str(cc.cache_dtype),
            "kv_cache_layout": None
            if kv_cache_layout is None
            else getattr(kv_cache_layout, "name", str(kv_cache_layout)),
            "enable_prefix_caching": bool(cc.enable_prefix_caching),
            "prefix_match_unit": getattr(cc, "prefix_match_unit", None),
        },
        "parallel_config": {
            "tensor_parallel_size": pc.tensor_parallel_size,
            "pipeline_parallel_size": pc.pipeline_parallel_size,
            "prefill_context_parallel_size": getattr(pc, "prefill_context_parallel_size", 1),
            "decode_context_parallel_size": getattr(pc, "decode_context_parallel_size", 1),
            "world_size": pc.world_size,
            "rank": pc.rank,
            "data_parallel_index": getattr(pc, "data_parallel_index", pc.data_parallel_rank),
            "data_parallel_size": pc.data_parallel_size,
            "data_parallel_rank_local": pc.data_parallel_rank_local,
            "distributed_executor_backend": _executor_backend(pc.distributed_executor_backend),
            "nnodes_within_dp": getattr(pc, "nnodes_within_dp", 1),
        },
        "kv_transfer_config": None
        if ktc is None
        else {
            "engine_id": ktc.engine_id,
            "kv_connector_extra_config": _plain(dict(ktc.kv_connector_extra_config), "kv_connector_extra_config"),
        },
        "kv_events_config": None if kec is None else {"enable_kv_cache_events": bool(kec.enable_kv_cache_events)},
        "use_v2_model_runner": bool(getattr(vllm_config, "use_v2_model_runner", False)),
    }
    kv: dict[str, object] = {
        "num_blocks": kv_cache_config.num_blocks,
        "kv_cache_tensors": [
            {
                "size": t.size,
                "layers": list(t.layers),
                "layer_stride": t.layer_stride,
                "block_stride": t.block_stride,
                "offset": t.offset,
                "host_resident": bool(getattr(t, "host_resident", False)),
            }
            for t in kv_cache_config.kv_cache_tensors
        ],
        "kv_cache_groups": [
            {
                "layer_names": list(g.layer_names),
                "kv_cache_spec": _spec_document(g.kv_cache_spec, f"kv_cache_groups[{i}].kv_cache_spec"),
                "enable_kv_transfer": bool(getattr(g, "enable_kv_transfer", True)),
                "role": _plain(getattr(g, "role", "default"), f"kv_cache_groups[{i}].role"),
                "is_eagle_group": bool(getattr(g, "is_eagle_group", False)),
                "host_resident": bool(getattr(g, "host_resident", False)),
            }
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        ],
        "hisparse_host_num_blocks": getattr(kv_cache_config, "hisparse_host_num_blocks", None),
        "kv_tp_replicas": getattr(kv_cache_config, "kv_tp_replicas", 1),
    }
    try:
        return msgspec.convert({"engine_config": engine, "kv_cache_config": kv}, EngineSnapshot)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"the live vLLM engine does not fit kvoffload's snapshot schema: {exc}") from None


def _fit_chunk_size(snapshot: EngineSnapshot) -> EngineSnapshot:
    """Round a ``block_size`` (tokens per chunk) that is not a multiple of vLLM's block size up to one.

    vLLM's translator refuses such a value, yet vLLM's block size depends on the backend (16 on CUDA, 128 on
    CPU), so a config written for one engine would stop another from starting. The connector uses the next
    multiple instead and says so in the log; ``kvoffload translate`` on the raw snapshot still applies vLLM's
    rule, and the connector's adjusted snapshot is ``KVOffloadConnector.snapshot``.
    """
    transfer = snapshot.engine_config.kv_transfer_config
    if transfer is None:
        return snapshot
    extra = dict(transfer.kv_connector_extra_config)
    wanted = extra.get("block_size")
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted <= 0:
        return snapshot
    probe_extra = {k: v for k, v in extra.items() if k not in ("block_size", "blocks_per_chunk")}
    try:
        probe = translate_snapshot(_with_extra(snapshot, probe_extra))
    except ConfigError:
        return snapshot  # the real translation reports the problem
    sizes = {g.tokens_per_block for g in probe.groups}
    if len(sizes) != 1:
        return snapshot
    engine_block = sizes.pop()
    if wanted % engine_block == 0:
        return snapshot
    fitted = round_up(wanted, engine_block)
    logger.warning(
        "kvoffload: kv_connector_extra_config['block_size']=%d is not a multiple of vLLM's KV block size (%d "
        "tokens); offloading chunks of %d tokens instead",
        wanted,
        engine_block,
        fitted,
    )
    return _with_extra(snapshot, {**extra, "block_size": fitted})


def _with_extra(snapshot: EngineSnapshot, extra: dict[str, object]) -> EngineSnapshot:
    engine = snapshot.engine_config
    if engine.kv_transfer_config is None:
        return snapshot
    transfer = msgspec.structs.replace(engine.kv_transfer_config, kv_connector_extra_config=extra)
    return msgspec.structs.replace(snapshot, engine_config=msgspec.structs.replace(engine, kv_transfer_config=transfer))
