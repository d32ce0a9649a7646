"""Page-size math, dtype sizes and layer-spec helpers of every spec kind, as in vLLM 0.33.

Every function here is a small, pure function over the generated spec types of ``kvoffload._generated``
(it imports nothing of the translator's rules or decision recording): vLLM keeps this logic in properties of
its spec dataclasses (``page_size_bytes``, ``prefix_cacheable``, ...); our specs are plain msgspec Structs, so
the same formulas live here as free functions. An attention page holds
``num_heads * (block_size // tokens_per_state)`` states of ``(head_size + head_size_v) * dtype_size`` bytes
each (or ``state_content_bytes``); vLLM's ``tokens_per_state = Fraction(1, n)`` (n states per token) is
``states_per_token = n`` here, with ``block_size * n`` states per block (:func:`tokens_per_state`). Pages are
padded to ``page_size_padded`` when set; MLA-family specs pad to their ``alignment``; a Mamba page is the sum
of ``prod(shape) * dtype_size`` over its state tensors; a ``uniform_type`` page is the sum of its layers' pages.

The translator rules built on these formulas (block-size resolution, windows measured in chunks) are in
:mod:`kvoffload.translate._rules`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import Final

from kvoffload._generated.types import (
    AttentionSpec,
    BaseKVCacheSpec,
    CircularBufferSpec,
    DType,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)
from kvoffload._ints import round_up
from kvoffload.errors import ConfigError

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
    "prefix_cacheable",
    "real_page_size_bytes",
    "resolve_dcp_kv_block_size",
    "spec_kind",
    "state_content_size_bytes",
    "tokens_per_state",
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


def spec_kind(spec: BaseKVCacheSpec) -> str:
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
    """Whether the spec's blocks can serve prefix-cache hits: False for bounded-replay SWA-MLA and for a
    circular buffer (one ring block per request), True for every other kind.

    A wrapper is prefix-cacheable when all its layers are (vacuously True when empty).
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(prefix_cacheable(inner) for inner in spec.kv_cache_specs.values())
    if isinstance(spec, SlidingWindowMLASpec):
        return not spec.bounded_replay
    return not isinstance(spec, CircularBufferSpec)


def num_heads(spec: AttentionSpec | MambaSpec) -> int:
    """Head slots of one page: ``num_head_slots`` when set, else ``num_kv_heads`` (Mamba: ``num_heads``)."""
    if isinstance(spec, MambaSpec):
        return spec.num_heads
    return spec.num_head_slots if spec.num_head_slots is not None else spec.num_kv_heads


def head_size_v(spec: AttentionSpec) -> int:
    """Head size of V: ``head_size_v``, or ``head_size`` when None (MLA-family specs default to 0)."""
    return spec.head_size if spec.head_size_v is None else spec.head_size_v


def tokens_per_state(spec: AttentionSpec | MambaSpec) -> int | Fraction:
    """vLLM's ``tokens_per_state``: ``Fraction(1, states_per_token)`` when an attention spec stores several
    states per token, else the ``tokens_per_state`` field (an int; Mamba's -1 means one state per block).

    Raises ConfigError naming both fields when ``states_per_token > 1`` comes with ``tokens_per_state != 1``:
    vLLM's single value is either whole tokens per state or a fraction, never both.
    """
    if isinstance(spec, MambaSpec) or spec.states_per_token == 1:
        return spec.tokens_per_state
    if spec.states_per_token < 1:
        # The schema's bound (ge = 1); a spec built with msgspec.structs.replace skips it.
        raise ConfigError(f"{spec_kind(spec)} spec has states_per_token={spec.states_per_token} (needs >= 1)")
    if spec.tokens_per_state != 1:
        raise ConfigError(
            f"{spec_kind(spec)} spec has states_per_token={spec.states_per_token} with "
            f"tokens_per_state={spec.tokens_per_state}: several states per token (vLLM's tokens_per_state = "
            f"Fraction(1, {spec.states_per_token})) needs tokens_per_state=1"
        )
    return Fraction(1, spec.states_per_token)


def num_states(spec: AttentionSpec | MambaSpec) -> int:
    """States per block: ``block_size // tokens_per_state`` when ``tokens_per_state > 0``, else 1 (Mamba).

    With ``states_per_token = n`` (vLLM's ``Fraction(1, n)``) that is ``block_size * n``. Raises ConfigError for
    a spec that sets both (see :func:`tokens_per_state`).
    """
    tps = tokens_per_state(spec)
    return int(spec.block_size // tps) if tps > 0 else 1


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


def real_page_size_bytes(spec: KVCacheSpec) -> int:
    """vLLM's ``real_page_size_bytes``: the page before padding (the bytes a worker actually copies):
    ``num_heads * num_states * content`` (attention), the state sum (Mamba), or the sum of the layers' real
    pages (wrapper)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return sum(real_page_size_bytes(inner) for inner in spec.kv_cache_specs.values())
    if isinstance(spec, MambaSpec):
        return _mamba_state_bytes(spec)
    return num_heads(spec) * num_states(spec) * state_content_size_bytes(spec)


def page_size_padded(spec: AttentionSpec | MambaSpec) -> int | None:
    """The effective ``page_size_padded``: MLA/SWA-MLA ``alignment`` padding overrides the field whenever
    ``round_up(real, alignment) != real`` (vLLM applies it in ``__post_init__``); otherwise the field."""
    if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)) and spec.alignment is not None:
        real = real_page_size_bytes(spec)
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
    unpadded = real_page_size_bytes(spec)
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
