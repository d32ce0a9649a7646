"""Page-size math, dtype sizes, layer-spec iteration and block-size resolution, as in vLLM 0.33.

Every function here is a small, pure function over the generated spec types of ``kvoffload._generated``:
vLLM keeps this logic in properties of its spec dataclasses (``page_size_bytes``, ``prefix_cacheable``, ...);
our specs are plain msgspec Structs, so the same formulas live here as free functions. An attention page holds
``num_heads * (block_size // tokens_per_state)`` states of ``(head_size + head_size_v) * dtype_size`` bytes
each (or ``state_content_bytes``), padded to ``page_size_padded`` when set; MLA-family specs pad to their
``alignment``; a Mamba page is the sum of ``prod(shape) * dtype_size`` over its state tensors; a
``uniform_type`` page is the sum of its layers' pages.

Block-size resolution (:func:`resolve_kv_cache_block_sizes`) and windows measured in chunks
(:func:`sliding_window_size_in_chunks`) are the two translator rules that live here, next to the formulas they
use; block-size resolution accepts an optional :class:`~kvoffload._explain.DecisionSink` so
``explain_offloading_config`` can record why ``tokens_per_hash`` came out as it did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final

from kvoffload._explain import DecisionSink, bare_assertion, discard
from kvoffload._generated.types import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    DType,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvoffload._ints import cdiv, round_up
from kvoffload.errors import ConfigError, OffloadingConfigError

__all__ = [
    "DTYPE_SIZES",
    "dcp_sharded",
    "dtype_size",
    "first_layer_spec",
    "group_kv_bytes_per_block",
    "head_size_v",
    "is_per_token_head",
    "iter_layer_specs",
    "num_heads",
    "num_states",
    "page_size_bytes",
    "page_size_padded",
    "partial_hash_hits_enabled",
    "prefix_cacheable",
    "real_page_size_bytes",
    "resolve_dcp_kv_block_size",
    "resolve_kv_cache_block_sizes",
    "sliding_window_size_in_chunks",
    "spec_kind",
    "state_content_size_bytes",
    "unpadded_page_size_bytes",
]

# ----------------------------------------------------------------------------------------------------
# dtypes and quantization modes
# ----------------------------------------------------------------------------------------------------

DTYPE_SIZES: Final[Mapping[DType, int]] = MappingProxyType(
    {
        DType.FLOAT16: 2,
        DType.BFLOAT16: 2,
        DType.FLOAT32: 4,
        DType.FLOAT64: 8,
        DType.FLOAT8_E4M3FN: 1,
        DType.FLOAT8_E5M2: 1,
        DType.UINT8: 1,
        DType.INT8: 1,
        DType.INT16: 2,
        DType.INT32: 4,
        DType.INT64: 8,
    }
)
"""Bytes per element of every storage dtype (torch's ``element_size()``); we do not import torch here."""


def dtype_size(dtype: DType) -> int:
    """Bytes per element of ``dtype`` (vLLM's ``get_dtype_size``)."""
    return DTYPE_SIZES[dtype]


_PER_TOKEN_HEAD: Final = frozenset(
    {KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD, KVQuantMode.INT4_PER_TOKEN_HEAD}
)


def is_per_token_head(mode: KVQuantMode) -> bool:
    """Whether pages carry per-token, per-head scales (int8/fp8/int4 per-token-head): never portable."""
    return mode in _PER_TOKEN_HEAD


# ----------------------------------------------------------------------------------------------------
# Spec helpers
# ----------------------------------------------------------------------------------------------------


def spec_kind(spec: KVCacheSpec) -> str:
    """The spec's ``type`` tag (``full_attention``, ``mla_attention``, ``uniform_type``, ...) for messages."""
    return str(type(spec).__struct_config__.tag)


def iter_layer_specs(spec: KVCacheSpec) -> tuple[KVCacheSpec, ...]:
    """The per-layer specs of a group spec: a ``uniform_type`` wrapper's values (one level), else (spec,)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return tuple(spec.kv_cache_specs.values())
    return (spec,)


def first_layer_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The representative layer spec: a wrapper's first value (what the scheduler sees), else the spec.

    Raises ConfigError for a wrapper without layers, which vLLM never builds.
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        for inner in spec.kv_cache_specs.values():
            return inner
        raise ConfigError("kv_cache_spec of type 'uniform_type' has no layer specs (kv_cache_specs is empty)")
    return spec


def dcp_sharded(spec: KVCacheSpec) -> bool:
    """Whether DCP shards the spec's tokens; a non-empty wrapper takes its first layer's flag (post-init)."""
    if isinstance(spec, UniformTypeKVCacheSpecs) and spec.kv_cache_specs:
        return dcp_sharded(next(iter(spec.kv_cache_specs.values())))
    return spec.dcp_sharded


def prefix_cacheable(spec: KVCacheSpec) -> bool:
    """Whether the spec's blocks can serve prefix-cache hits: False only for bounded-replay SWA-MLA.

    A wrapper is prefix-cacheable when all its layers are (vacuously True when empty).
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(prefix_cacheable(inner) for inner in spec.kv_cache_specs.values())
    if isinstance(spec, SlidingWindowMLASpec):
        return not spec.bounded_replay
    return True


def num_heads(spec: AttentionSpec | MambaSpec) -> int:
    """Head slots of one page: ``num_head_slots`` when set, else ``num_kv_heads`` (Mamba: ``num_heads``)."""
    if isinstance(spec, MambaSpec):
        return spec.num_heads
    return spec.num_head_slots if spec.num_head_slots is not None else spec.num_kv_heads


def head_size_v(spec: AttentionSpec) -> int:
    """Head size of V: ``head_size_v``, or ``head_size`` when None (MLA-family specs default to 0)."""
    return spec.head_size if spec.head_size_v is None else spec.head_size_v


def num_states(spec: AttentionSpec | MambaSpec) -> int:
    """States per block: ``block_size // tokens_per_state`` when ``tokens_per_state > 0``, else 1 (Mamba)."""
    tps = spec.tokens_per_state
    return spec.block_size // tps if tps > 0 else 1


def state_content_size_bytes(spec: AttentionSpec | MambaSpec) -> int:
    """Bytes of one state: ``state_content_bytes`` or ``(head_size + head_size_v) * dtype_size`` (attention);
    the sum of ``prod(shape) * dtype_size`` over the state tensors (Mamba)."""
    if isinstance(spec, MambaSpec):
        return _mamba_state_bytes(spec)
    if spec.state_content_bytes is not None:
        return spec.state_content_bytes
    return (spec.head_size + head_size_v(spec)) * dtype_size(spec.dtype)


def _mamba_state_bytes(spec: MambaSpec) -> int:
    # zip() truncates to the shorter of shapes/dtypes, exactly as vLLM's formula does.
    return sum(math.prod(shape) * dtype_size(dtype) for shape, dtype in zip(spec.shapes, spec.dtypes, strict=False))


def unpadded_page_size_bytes(spec: KVCacheSpec) -> int:
    """Bytes of one page before padding: ``num_heads * num_states * content`` (attention), the state sum
    (Mamba), or the sum of the layers' unpadded pages (wrapper)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return sum(unpadded_page_size_bytes(inner) for inner in spec.kv_cache_specs.values())
    if isinstance(spec, MambaSpec):
        return _mamba_state_bytes(spec)
    return num_heads(spec) * num_states(spec) * state_content_size_bytes(spec)


def real_page_size_bytes(spec: KVCacheSpec) -> int:
    """vLLM's ``real_page_size_bytes``: the unpadded page (the bytes a worker actually copies)."""
    return unpadded_page_size_bytes(spec)


def page_size_padded(spec: AttentionSpec | MambaSpec) -> int | None:
    """The effective ``page_size_padded``: MLA/SWA-MLA ``alignment`` padding overrides the field whenever
    ``round_up(real, alignment) != real`` (vLLM applies it in ``__post_init__``); otherwise the field."""
    if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)) and spec.alignment is not None:
        real = unpadded_page_size_bytes(spec)
        padded = round_up(real, spec.alignment)
        if padded != real:
            return padded
    return spec.page_size_padded


def page_size_bytes(spec: KVCacheSpec) -> int:
    """Bytes one block of this spec occupies: the padded page when padding applies, else the unpadded page;
    a wrapper sums its layers' (padded) pages.

    Raises ConfigError naming both values when the padded size is smaller than the unpadded page (vLLM's
    bare ``assert page_size_padded >= unpadded``).
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return sum(page_size_bytes(inner) for inner in spec.kv_cache_specs.values())
    unpadded = unpadded_page_size_bytes(spec)
    padded = page_size_padded(spec)
    if padded is None:
        return unpadded
    if padded < unpadded:
        raise ConfigError(
            f"{spec_kind(spec)} spec has page_size_padded={padded} smaller than its unpadded page ({unpadded} bytes)"
        )
    return padded


# ----------------------------------------------------------------------------------------------------
# Group bytes
# ----------------------------------------------------------------------------------------------------


def group_kv_bytes_per_block(group: KVCacheGroupSpec) -> int:
    """Physical bytes of one block of a group: a wrapper's page (sum of layer pages), else page * layers.

    Invariant across the worker view (wrapper) and the scheduler view (first layer spec) whenever the
    wrapper's layers share one page size, as vLLM guarantees for uniform-type groups.
    """
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return page_size_bytes(spec)
    return page_size_bytes(spec) * len(group.layer_names)


# ----------------------------------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------------------------------


def resolve_dcp_kv_block_size(spec: KVCacheSpec, dcp_world_size: int) -> int:
    """Tokens one block spans under DCP: ``block_size * dcp`` when the spec is ``dcp_sharded`` (attention by
    default; a wrapper uses its first layer's flag), else ``block_size`` (Mamba). PCP never scales blocks."""
    return spec.block_size * (dcp_world_size if dcp_sharded(spec) else 1)


def partial_hash_hits_enabled(groups: Sequence[KVCacheGroupSpec], hash_block_size: int, dcp: int) -> bool:
    """Whether prefix hits may land inside a block: some align-mode Mamba layer's group block is larger than
    the hash block (``>`` without DCP, ``>=`` with DCP)."""
    for group in groups:
        size = resolve_dcp_kv_block_size(group.kv_cache_spec, dcp)
        for spec in iter_layer_specs(group.kv_cache_spec):
            if not (isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"):
                continue
            if (dcp == 1 and size > hash_block_size) or (dcp > 1 and size >= hash_block_size):
                return True
    return False


def resolve_kv_cache_block_sizes(
    kv_cache_config: KVCacheConfig,
    engine_config: EngineConfig,
    note: DecisionSink = discard,
) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` in tokens, exactly as vLLM 0.33 resolves them.

    One group (or none): both are ``cache_config.block_size * dcp`` (the engine's block size, not the spec's;
    dcp drops to 1 when the single group is not DCP-sharded); a ``prefix_match_unit`` other than that is a
    ValueError when prefix caching or a connector is on. Several groups: the scheduler block is the LCM of
    the DCP-scaled group block sizes; the hash block is ``prefix_match_unit`` or the GCD of the
    prefix-cacheable groups' sizes (of all sizes when none is), falling back to the LCM when neither prefix
    caching nor a connector is on, or when a Mamba layer is not in ``align`` mode. The three
    ``prefix_match_unit`` rejections raise :class:`OffloadingConfigError` with vLLM's ValueError text.
    """
    cache = engine_config.cache_config
    dcp = engine_config.parallel_config.decode_context_parallel_size
    groups = kv_cache_config.kv_cache_groups
    connector_enabled = engine_config.kv_transfer_config is not None
    pmu = cache.prefix_match_unit

    if len(groups) <= 1:
        why_dcp = f"dcp={dcp}"
        if len(groups) == 1 and not dcp_sharded(groups[0].kv_cache_spec):
            dcp = 1
            why_dcp = "dcp=1 (the single group is not dcp_sharded)"
        bs = cache.block_size * dcp
        if pmu is not None and pmu != bs and len(groups) == 1 and (cache.enable_prefix_caching or connector_enabled):
            raise OffloadingConfigError(
                f"Invalid prefix_match_unit={pmu}; with a single KV cache group, prefix-cache hits land "
                f"on the block size ({bs}). Unset it or set it to {bs}."
            )
        note(
            "tokens_per_hash",
            bs,
            f"{len(groups)} KV cache group(s): cache_config.block_size={cache.block_size} x {why_dcp} "
            "(a single group hashes at the engine block size, not the spec's)",
        )
        return bs, bs

    sizes = [resolve_dcp_kv_block_size(g.kv_cache_spec, dcp) for g in groups]
    scheduler_bs = math.lcm(*sizes)
    if not (cache.enable_prefix_caching or connector_enabled):
        note(
            "tokens_per_hash",
            scheduler_bs,
            f"prefix caching off and no connector: hash at the scheduler block, lcm{tuple(sizes)}={scheduler_bs}",
        )
        return scheduler_bs, scheduler_bs
    if any(
        isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "align"
        for g in groups
        for spec in iter_layer_specs(g.kv_cache_spec)
    ):
        note(
            "tokens_per_hash",
            scheduler_bs,
            "a Mamba layer is not in mamba_cache_mode 'align': finer hashing is disabled, hash at the "
            f"scheduler block lcm{tuple(sizes)}={scheduler_bs}",
        )
        return scheduler_bs, scheduler_bs

    hashing = [size for g, size in zip(groups, sizes, strict=True) if prefix_cacheable(g.kv_cache_spec)] or sizes
    hash_bs = pmu if pmu is not None else math.gcd(*hashing)
    if any(size % hash_bs != 0 for size in hashing):
        raise OffloadingConfigError(
            f"Invalid prefix_match_unit={hash_bs}; prefix-cacheable KV cache group block sizes must be "
            f"divisible by prefix_match_unit. Got group block sizes={sizes}, prefix-cacheable={hashing}."
        )
    alignments = {
        spec.tokens_per_state
        for g in groups
        for spec in iter_layer_specs(g.kv_cache_spec)
        if prefix_cacheable(spec) and not isinstance(spec, UniformTypeKVCacheSpecs) and spec.tokens_per_state > 1
    }
    partial = partial_hash_hits_enabled(groups, hash_bs, dcp)
    hit_alignment = hash_bs if partial else scheduler_bs
    if any(hit_alignment % a for a in alignments):
        raise OffloadingConfigError(
            f"Invalid prefix_match_unit={hash_bs}; prefix-cache boundaries must align with each spec's "
            f"per-state compression. Got alignments={sorted(alignments)}."
        )
    source = f"prefix_match_unit={pmu}" if pmu is not None else f"gcd{tuple(hashing)}={hash_bs}"
    note(
        "tokens_per_hash",
        hash_bs,
        f"{len(groups)} groups with DCP-scaled block sizes {tuple(sizes)}: {source} over the "
        f"prefix-cacheable sizes {tuple(hashing)} (scheduler block lcm={scheduler_bs}"
        + (", partial Mamba hits enabled" if partial else "")
        + ")",
    )
    return scheduler_bs, hash_bs


def sliding_window_size_in_chunks(spec: KVCacheSpec, tokens_per_chunk: int) -> int | None:
    """Chunks a request needs to cover the spec's attention window, or None for full attention.

    Sliding window (incl. SWA-MLA): ``max(cdiv(sw, tpc), cdiv(sw - 1 + extra_retained_tokens, tpc))``;
    chunked local: ``cdiv(attention_chunk_size, tpc)``; Mamba: 1 (a single state); full attention and MLA:
    None. A wrapper is classified by its first layer spec. Raises :class:`OffloadingConfigError` where vLLM
    fails a bare ``assert`` (a window ≤ 0, a nested wrapper) with an empty message and the detail in a note,
    and for a chunk of ≤ 0 tokens (where vLLM would divide by zero).
    """
    spec = first_layer_spec(spec)
    if tokens_per_chunk <= 0 and isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
        raise OffloadingConfigError(
            f"Cannot size the {spec_kind(spec)} window in chunks of {tokens_per_chunk} tokens: the offload "
            "chunk must hold at least one token.",
            vllm_exception="ZeroDivisionError",
        )
    if isinstance(spec, SlidingWindowSpec):
        if spec.sliding_window <= 0:
            raise bare_assertion(f"sliding_window={spec.sliding_window} must be > 0")
        return max(
            cdiv(spec.sliding_window, tokens_per_chunk),
            cdiv(spec.sliding_window - 1 + spec.extra_retained_tokens, tokens_per_chunk),
        )
    if isinstance(spec, ChunkedLocalAttentionSpec):
        if spec.attention_chunk_size <= 0:
            raise bare_assertion(f"attention_chunk_size={spec.attention_chunk_size} must be > 0")
        return cdiv(spec.attention_chunk_size, tokens_per_chunk)
    if isinstance(spec, MambaSpec):
        return 1
    if isinstance(spec, FullAttentionSpec):
        return None
    raise bare_assertion(f"a {spec_kind(spec)} layer spec is not a full-attention spec")
