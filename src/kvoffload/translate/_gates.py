"""The translator's parallelism gates: may ranks share one host copy, and may another parallelism read it?

Three flags of the :class:`~kvoffload.OffloadingConfig` come from conjunctions of conditions, evaluated in vLLM
0.33's order after ``worker_kv_bytes_per_block``:

* ``replicated_layout`` (direct): an MLA model whose every TP rank holds the same KV (``kv_tp_replicas == tp``,
  tp > 1), TP only (pp, pcp, dcp 1; world size tp), non-empty blocks, the ``mp`` backend on one node. Then the
  ranks share one host copy.
* ``canonical_layout``: ``bool(kv_connector_extra_config.get("canonical_layout", False))``.
* ``is_parallelism_agnostic`` (direct): the V1 model runner, exactly one KV cache group whose spec is a
  non-MLA full-attention spec with its heads genuinely sharded (``num_kv_heads * tp == total_num_kv_heads``),
  no per-token-head quantization, dcp and pcp 1.
* With ``canonical_layout`` and the direct gate False, every layer spec of every group is certified one by one
  (attention, no per-token-head scales; plain MLA with one token per state (not several tokens, nor several
  states per token) and a real page divisible by the block size; never the other MLA kinds (SWA-MLA, the
  hidden-state cache); or full / sliding-window attention with ``num_kv_heads == max(1, total // tp)`` where total and
  tp divide one another), and the flag becomes: some layers, all certified, dcp and pcp 1, world size tp.
* With ``canonical_layout``, ``replicated_layout`` is recomputed: parallelism-agnostic, every selected layer
  spec exactly ``mla_attention``, one node, and a single worker or the ``mp`` backend.

Each condition is recorded as a named gate (``replicated_layout.tp>1``, ``canonical.group[0]``, ...), so an
explanation names every gate that failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvoffload._generated.types import (
    AttentionSpec,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvoffload.translate._explain import DecisionSink, record_gates
from kvoffload.translate._spec_math import (
    is_per_token_head,
    iter_layer_specs,
    real_page_size_bytes,
    spec_kind,
    tokens_per_state,
)

__all__ = ["ParallelGates", "decide_parallel_gates"]


class ParallelGates(NamedTuple):
    """The three flags the gates settle on."""

    replicated_layout: bool
    canonical_layout: bool
    is_parallelism_agnostic: bool


def decide_parallel_gates(
    engine_config: EngineConfig,
    kv: KVCacheConfig,
    extra: Mapping[str, object],
    selected: Sequence[tuple[int, KVCacheGroupSpec]],
    worker_kv_bytes_per_block: int,
    note: DecisionSink,
) -> ParallelGates:
    """The direct replicated gate, the canonical flag, the direct agnostic gate, then (with canonical pages)
    the per-layer certification and the recomputed replicated layout, in that order (``extra`` is the
    connector's ``kv_connector_extra_config``)."""
    replicated = _direct_replicated_layout(engine_config, kv, worker_kv_bytes_per_block, note)
    canonical = bool(extra.get("canonical_layout", False))
    note(
        "canonical_layout",
        canonical,
        f"bool(kv_connector_extra_config.get('canonical_layout', False)) of {extra.get('canonical_layout')!r}",
    )
    agnostic = _direct_parallelism_agnostic(engine_config, kv, note)
    if canonical and agnostic:
        note("canonical.certification", True, "skipped: the direct gate already holds")
    if canonical and not agnostic:
        agnostic = _certified_parallelism_agnostic(engine_config, kv, note)
    if canonical:
        replicated = _canonical_replicated_layout(engine_config, selected, agnostic, note)
    return ParallelGates(replicated_layout=replicated, canonical_layout=canonical, is_parallelism_agnostic=agnostic)


def _direct_replicated_layout(
    engine_config: EngineConfig, kv: KVCacheConfig, worker_kv_bytes_per_block: int, note: DecisionSink
) -> bool:
    """MLA replicas of one TP group share one host copy: TP only, single node, the ``mp`` backend."""
    parallel = engine_config.parallel_config
    use_mla = engine_config.model_config.use_mla
    tp = parallel.tensor_parallel_size
    backend = parallel.distributed_executor_backend
    return record_gates(
        note,
        "replicated_layout",
        [
            ("use_mla", use_mla, f"model_config.use_mla={use_mla} (needs True)"),
            ("tp>1", tp > 1, f"tensor_parallel_size={tp} (needs > 1)"),
            (
                "kv_tp_replicas==tp",
                kv.kv_tp_replicas == tp,
                f"kv_cache_config.kv_tp_replicas={kv.kv_tp_replicas}, tensor_parallel_size={tp} (need equal: "
                "every TP rank holds the same KV)",
            ),
            (
                "worker_kv_bytes_per_block>0",
                worker_kv_bytes_per_block > 0,
                f"worker_kv_bytes_per_block={worker_kv_bytes_per_block} (needs > 0)",
            ),
            (
                "pp==1",
                parallel.pipeline_parallel_size == 1,
                f"pipeline_parallel_size={parallel.pipeline_parallel_size}",
            ),
            _pcp_gate(engine_config),
            _dcp_gate(engine_config),
            (
                "world_size==tp",
                parallel.world_size == tp,
                f"world_size={parallel.world_size}, tensor_parallel_size={tp} (TP-only)",
            ),
            (
                "backend==mp",
                backend == "mp",
                f"distributed_executor_backend={backend!r} (the shared /dev/shm pool needs 'mp')",
            ),
            (
                "nnodes_within_dp==1",
                parallel.nnodes_within_dp == 1,
                f"nnodes_within_dp={parallel.nnodes_within_dp} (single node only)",
            ),
        ],
        topic="replicated_layout",
        what="direct replicated layout (MLA, TP-only, single node, mp)",
    )


def _direct_parallelism_agnostic(engine_config: EngineConfig, kv: KVCacheConfig, note: DecisionSink) -> bool:
    """One head-sharded, non-MLA full-attention group (of all groups, not only the selected ones)."""
    tp = engine_config.parallel_config.tensor_parallel_size
    total_kv_heads = engine_config.model_config.total_num_kv_heads
    single_spec = kv.kv_cache_groups[0].kv_cache_spec if len(kv.kv_cache_groups) == 1 else None
    is_full = isinstance(single_spec, FullAttentionSpec) and not isinstance(single_spec, MLAAttentionSpec)
    if single_spec is None:
        kind_reason = f"{len(kv.kv_cache_groups)} KV cache groups (needs exactly one)"
    else:
        kind_reason = f"the single group's spec is {spec_kind(single_spec)} (needs full_attention, not MLA)"
    heads_ok = False
    heads_reason = "no single full-attention spec"
    per_token_ok = False
    per_token_reason = "no single full-attention spec"
    if isinstance(single_spec, FullAttentionSpec) and is_full:
        heads_ok = single_spec.num_kv_heads * tp == total_kv_heads
        heads_reason = (
            f"num_kv_heads={single_spec.num_kv_heads} x tp={tp} vs total_num_kv_heads={total_kv_heads} "
            "(must be equal: heads genuinely sharded, not replicated)"
        )
        per_token_ok = not is_per_token_head(single_spec.kv_quant_mode)
        per_token_reason = f"kv_quant_mode={single_spec.kv_quant_mode.value!r} (per-token-head scales excluded)"
    v2 = engine_config.use_v2_model_runner
    return record_gates(
        note,
        "is_parallelism_agnostic",
        [
            ("v1_model_runner", not v2, f"use_v2_model_runner={v2} (needs False)"),
            ("single_full_attention_group", is_full, kind_reason),
            ("heads_sharded", heads_ok, heads_reason),
            ("not_per_token_head", per_token_ok, per_token_reason),
            _dcp_gate(engine_config),
            _pcp_gate(engine_config),
        ],
        topic="is_parallelism_agnostic",
        what="direct gate (one head-sharded, non-MLA full-attention group)",
    )


def _certified_parallelism_agnostic(engine_config: EngineConfig, kv: KVCacheConfig, note: DecisionSink) -> bool:
    """Canonical pages widen the agnostic gate to every config whose layer specs (all groups) certify one by one."""
    parallel = engine_config.parallel_config
    tp = parallel.tensor_parallel_size
    layer_specs: list[tuple[str, KVCacheSpec]] = []
    for group_id, group in enumerate(kv.kv_cache_groups):
        specs = iter_layer_specs(group.kv_cache_spec)
        layer_specs.extend(zip(_layer_topics(group, group_id, len(specs)), specs, strict=True))
    certified = True
    for topic, spec in layer_specs:
        ok, why = _spec_certifiable(spec, tp, engine_config.model_config.total_num_kv_heads)
        note(f"canonical.{topic}", ok, why)
        certified = certified and ok
    return record_gates(
        note,
        "canonical.is_parallelism_agnostic",
        [
            ("has_layers", len(layer_specs) > 0, f"{len(layer_specs)} layer specs over all groups"),
            ("all_layers_certified", certified, "every layer spec passes the canonical certification"),
            _dcp_gate(engine_config),
            _pcp_gate(engine_config),
            (
                "world_size==tp",
                parallel.world_size == tp,
                f"world_size={parallel.world_size}, tensor_parallel_size={tp}",
            ),
        ],
        topic="is_parallelism_agnostic",
        what="canonical_layout: recomputed from the per-layer certification",
    )


def _canonical_replicated_layout(
    engine_config: EngineConfig,
    selected: Sequence[tuple[int, KVCacheGroupSpec]],
    is_parallelism_agnostic: bool,
    note: DecisionSink,
) -> bool:
    """With canonical pages, the replicated layout is recomputed from the certification."""
    parallel = engine_config.parallel_config
    backend = parallel.distributed_executor_backend
    selected_layers = [spec for _, g in selected for spec in iter_layer_specs(g.kv_cache_spec)]
    all_mla = all(type(spec) is MLAAttentionSpec for spec in selected_layers)
    kinds = sorted({spec_kind(spec) for spec in selected_layers})
    return record_gates(
        note,
        "canonical.replicated_layout",
        [
            (
                "is_parallelism_agnostic",
                is_parallelism_agnostic,
                f"is_parallelism_agnostic={is_parallelism_agnostic}",
            ),
            ("all_selected_mla", all_mla, f"selected layer spec kinds {kinds} (all must be mla_attention)"),
            (
                "nnodes_within_dp==1",
                parallel.nnodes_within_dp == 1,
                f"nnodes_within_dp={parallel.nnodes_within_dp}",
            ),
            (
                "single_worker_or_mp",
                parallel.world_size == 1 or backend == "mp",
                f"world_size={parallel.world_size}, distributed_executor_backend={backend!r}",
            ),
        ],
        topic="replicated_layout",
        what="canonical_layout: recomputed (certified, all offloaded layers plain MLA, one node)",
    )


def _dcp_gate(engine_config: EngineConfig) -> tuple[str, bool, str]:
    dcp = engine_config.parallel_config.decode_context_parallel_size
    return ("dcp==1", dcp == 1, f"decode_context_parallel_size={dcp}")


def _pcp_gate(engine_config: EngineConfig) -> tuple[str, bool, str]:
    pcp = engine_config.parallel_config.prefill_context_parallel_size
    return ("pcp==1", pcp == 1, f"prefill_context_parallel_size={pcp}")


def _layer_topics(group: KVCacheGroupSpec, group_id: int, count: int) -> list[str]:
    """Explanation topics of a group's layer specs: ``group[i].layer[name]`` for a wrapper's layers,
    ``group[i]`` for a plain group spec (one spec shared by all its layers)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [f"group[{group_id}].layer[{name}]" for name in spec.kv_cache_specs]
    return [f"group[{group_id}]"] * count


def _spec_certifiable(spec: KVCacheSpec, tp: int, total_kv_heads: int) -> tuple[bool, str]:
    """vLLM's conservative static mirror of the worker's per-layer canonical mapping checks, with a reason."""
    kind = spec_kind(spec)
    if not isinstance(spec, AttentionSpec):
        return False, f"{kind} is not an attention spec"
    if is_per_token_head(spec.kv_quant_mode):
        return False, f"{kind} kv_quant_mode={spec.kv_quant_mode.value!r} has per-token-head scales"
    if type(spec) is MLAAttentionSpec:
        real = real_page_size_bytes(spec)
        tps = tokens_per_state(spec)  # Fraction(1, n) with states_per_token = n: never 1
        ok = tps == 1 and real % spec.block_size == 0
        return ok, (
            f"mla_attention: tokens_per_state={tps} (needs 1), real page {real} bytes "
            f"{'divisible' if real % spec.block_size == 0 else 'not divisible'} by "
            f"block_size={spec.block_size}"
        )
    if isinstance(spec, (SlidingWindowMLASpec, MLAAttentionSpec)):
        return False, f"{kind} (MLA family other than plain mla_attention) is never certified"
    if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
        return False, f"{kind} is neither full attention nor sliding window"
    divides = total_kv_heads % tp == 0 or tp % total_kv_heads == 0
    expected = max(1, total_kv_heads // tp)
    ok = divides and spec.num_kv_heads == expected
    return ok, (
        f"{kind}: total_num_kv_heads={total_kv_heads} and tp={tp} "
        f"{'divide' if divides else 'do not divide'} one another; num_kv_heads={spec.num_kv_heads} "
        f"(needs max(1, {total_kv_heads} // {tp}) = {expected})"
    )
