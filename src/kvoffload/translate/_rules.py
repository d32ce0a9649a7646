"""The translator rules that sit next to the page math: block-size resolution and windows measured in chunks.

:func:`resolve_kv_cache_block_sizes` settles ``(scheduler_block_size, hash_block_size)`` exactly as vLLM 0.33
does (with :func:`partial_hash_hits_enabled`, its Mamba partial-hit test), and
:func:`sliding_window_size_in_chunks` sizes an attention window in offload chunks. Unlike the pure formulas of
:mod:`kvoffload.translate._spec_math` they raise vLLM's errors, and block-size resolution accepts an optional
:class:`~kvoffload.translate._explain.DecisionSink` so ``explain_offloading_config`` can record why
``tokens_per_hash`` came out as it did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvoffload._generated.types import (
    ChunkedLocalAttentionSpec,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvoffload._ints import cdiv
from kvoffload.errors import OffloadingConfigError
from kvoffload.translate._explain import DecisionSink, bare_assertion, discard
from kvoffload.translate._spec_math import (
    dcp_sharded,
    first_layer_spec,
    iter_layer_specs,
    prefix_cacheable,
    resolve_dcp_kv_block_size,
    spec_kind,
    tokens_per_state,
)

__all__ = ["partial_hash_hits_enabled", "resolve_kv_cache_block_sizes", "sliding_window_size_in_chunks"]


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
    # vLLM collects the int tokens_per_state > 1 only: Fraction(1, n) (states_per_token = n) never compresses.
    alignments = {
        tps
        for g in groups
        for spec in iter_layer_specs(g.kv_cache_spec)
        if prefix_cacheable(spec) and not isinstance(spec, UniformTypeKVCacheSpecs)
        for tps in (tokens_per_state(spec),)
        if isinstance(tps, int) and tps > 1
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
