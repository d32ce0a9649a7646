"""The translator: an engine's KV-cache metadata → :class:`OffloadingConfig`, exactly as vLLM 0.33.

:func:`build_offloading_config` re-implements vLLM 0.33's ``build_offloading_config``
(``distributed/kv_transfer/kv_connector/v1/offloading/config.py``) rule for rule, on our generated types.
Every condition vLLM checks with ``raise`` or ``assert`` raises :class:`OffloadingConfigError` carrying vLLM's
exact message and, in ``vllm_exception``, the exception type vLLM raises. Where vLLM fails a bare ``assert``
(no message) the message is empty too, like vLLM's, and the detail travels as a PEP 678 note
(``err.__notes__``), which tracebacks and the CLI print.

:func:`explain_offloading_config` runs the very same code path with a decision recorder and returns an
:class:`Explanation`: the config (or the error) and the ordered decisions — which groups were selected and
why others were not, where ``tokens_per_hash`` and ``blocks_per_chunk`` came from, how
``worker_kv_bytes_per_block`` was computed, and every gate of ``replicated_layout``,
``is_parallelism_agnostic`` and the canonical certification (per layer). It is a sibling function rather than
an ``explain=True`` flag so each function has one return type.

:func:`translate_snapshot` and :func:`load_snapshot` are the file-level entry points used by the CLI.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ._generated import codecs
from ._generated.types import (
    AttentionSpec,
    EngineConfig,
    EngineSnapshot,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from .errors import ConfigError, OffloadingConfigError
from .layout import (
    DecisionSink,
    DecisionValue,
    _bare_assertion,
    group_kv_bytes_per_block,
    is_per_token_head,
    iter_layer_specs,
    offloading_group_ids,
    real_page_size_bytes,
    resolve_dcp_kv_block_size,
    resolve_kv_cache_block_sizes,
    round_up,
    sliding_window_size_in_chunks,
    spec_kind,
)

__all__ = [
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "Decision",
    "Explanation",
    "build_offloading_config",
    "describe_error",
    "explain_offloading_config",
    "explain_snapshot",
    "load_snapshot",
    "translate_snapshot",
]


# ----------------------------------------------------------------------------------------------------
# Explanation types
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Decision:
    """One step of the translation: what ``topic`` settled on (``value``) and why (``reason``)."""

    topic: str
    value: DecisionValue
    reason: str

    def render(self) -> str:
        """One line ``topic = value  # reason`` for people."""
        return f"{self.topic} = {_render_value(self.value)}  # {self.reason}"


@dataclass(frozen=True, slots=True)
class Explanation:
    """The outcome of a translation plus the ordered decisions that produced it.

    Exactly one of ``config`` and ``error`` is set. ``decisions`` stops at the failing rule when ``error`` is
    set, so the last decisions explain the failure.
    """

    config: OffloadingConfig | None
    error: ConfigError | None
    decisions: tuple[Decision, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Whether the translation succeeded."""
        return self.config is not None

    def find(self, topic: str) -> Decision:
        """The (last) decision recorded under ``topic``; KeyError when there is none."""
        for decision in reversed(self.decisions):
            if decision.topic == topic:
                return decision
        raise KeyError(topic)

    def topics(self, prefix: str) -> tuple[Decision, ...]:
        """Every decision whose topic starts with ``prefix`` (e.g. ``"replicated_layout."`` for its gates)."""
        return tuple(d for d in self.decisions if d.topic.startswith(prefix))

    def failing(self, prefix: str) -> tuple[Decision, ...]:
        """The gates under ``prefix`` that evaluated to False: the answer to "why is X False?"."""
        return tuple(d for d in self.topics(prefix) if d.value is False)

    def render(self) -> str:
        """A multi-line, human-readable report: one decision per line, then the outcome."""
        lines = [d.render() for d in self.decisions]
        if self.error is not None:
            lines.append(f"error ({self.error_type}): {describe_error(self.error)}")
        return "\n".join(lines)

    @property
    def error_type(self) -> str | None:
        """The exception vLLM raises for the same input, or ``ConfigError`` for other invalid input."""
        if self.error is None:
            return None
        if isinstance(self.error, OffloadingConfigError):
            return self.error.vllm_exception
        return type(self.error).__name__


def describe_error(err: BaseException) -> str:
    """The error's message, or its PEP 678 notes when the message is empty (vLLM's bare asserts)."""
    message = str(err)
    notes = getattr(err, "__notes__", None)
    if not message and isinstance(notes, list) and notes:
        name = err.vllm_exception if isinstance(err, OffloadingConfigError) else type(err).__name__
        return f"{'; '.join(str(n) for n in notes)} (vLLM: bare {name}, no message)"
    return message


def _render_value(value: DecisionValue) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else str(value)


class _Recorder:
    """Collects decisions in order; passed as the translator's :class:`DecisionSink`."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    def __call__(self, topic: str, value: DecisionValue, reason: str, /) -> None:
        self.decisions.append(Decision(topic, value, reason))


def _ignore(topic: str, value: DecisionValue, reason: str, /) -> None:
    """No recording (plain ``build_offloading_config``)."""


def _gates(note: DecisionSink, prefix: str, gates: list[tuple[str, bool, str]], *, topic: str, what: str) -> bool:
    """Record each named gate as ``prefix.name``, then ``topic`` with their conjunction and the names of the
    gates that failed; every gate is evaluated (none has side effects), so all failures are reported."""
    for name, passed, reason in gates:
        note(f"{prefix}.{name}", passed, reason)
    failed = [name for name, passed, _ in gates if not passed]
    verdict = "all gates pass" if not failed else "failed gates: " + ", ".join(failed)
    note(topic, not failed, f"{what}: {verdict}")
    return not failed


# ----------------------------------------------------------------------------------------------------
# The translator
# ----------------------------------------------------------------------------------------------------


def build_offloading_config(engine_config: EngineConfig, kv_cache_config: KVCacheConfig) -> OffloadingConfig:
    """Translate an engine's config and KV cache config into the offloading plan (vLLM 0.33's rules in order).

    Raises :class:`OffloadingConfigError` with vLLM's message (and ``vllm_exception``) wherever vLLM raises or
    asserts, and :class:`ConfigError` for input vLLM would crash on elsewhere. Edge cases vLLM lets through
    but that make no sense are rejected with an OffloadingConfigError of our own wording:

    * ``block_size`` in ``kv_connector_extra_config`` that is 0 or a negative multiple of the GPU block
      gives ``blocks_per_chunk <= 0`` (vLLM returns it, then divides by zero when sizing SWA windows or the
      host pool); ``vllm_exception`` is ``"ZeroDivisionError"`` for 0 and ``"ValueError"`` (nominal) for
      negatives.
    * An extra-config value ``int()`` rejects (``"abc"``, a list) is a ConfigError naming the key and value
      (vLLM lets Python's ValueError/TypeError escape).
    * A page whose ``page_size_padded`` is smaller than the unpadded page, reached only when the worker bytes
      are summed from pages (no tensors): OffloadingConfigError with vLLM's empty AssertionError message and
      the values in a note.

    The result does not depend on whether a ``uniform_type`` group arrives wrapped (worker view) or flattened
    to its first layer spec (scheduler view) wherever vLLM keeps them equal; as in vLLM,
    ``is_parallelism_agnostic`` of a single wrapped group differs (False for the wrapper, which is not a
    FullAttentionSpec; possibly True for its flattened first layer).
    """
    return _translate(engine_config, kv_cache_config, _ignore)


def explain_offloading_config(engine_config: EngineConfig, kv_cache_config: KVCacheConfig) -> Explanation:
    """Run :func:`build_offloading_config` on the same code path, recording every decision.

    Never raises for invalid input: a ConfigError (incl. OffloadingConfigError) lands in ``error``.
    """
    recorder = _Recorder()
    try:
        config = _translate(engine_config, kv_cache_config, recorder)
    except ConfigError as err:
        return Explanation(config=None, error=err, decisions=tuple(recorder.decisions))
    return Explanation(config=config, error=None, decisions=tuple(recorder.decisions))


def translate_snapshot(snapshot: EngineSnapshot) -> OffloadingConfig:
    """:func:`build_offloading_config` on a decoded engine snapshot."""
    return build_offloading_config(snapshot.engine_config, snapshot.kv_cache_config)


def explain_snapshot(snapshot: EngineSnapshot) -> Explanation:
    """:func:`explain_offloading_config` on a decoded engine snapshot."""
    return explain_offloading_config(snapshot.engine_config, snapshot.kv_cache_config)


def _int_option(key: str, value: object) -> int:
    """``int(value)`` like vLLM (2.5 → 2, "4" → 4, True → 1); a ConfigError naming key and value otherwise."""
    if not isinstance(value, (int, float, str, bytes, bytearray)):
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}]={value!r} is not an integer: int() does not accept a "
            f"{type(value).__name__}"
        )
    try:
        return int(value)
    except (ValueError, OverflowError) as exc:
        raise ConfigError(f"kv_connector_extra_config[{key!r}]={value!r} is not an integer: {exc}") from exc


def _check_spec_construction(kv: KVCacheConfig) -> None:
    """What vLLM's spec dataclasses reject when they are built, i.e. before the translator runs."""
    for group in kv.kv_cache_groups:
        outer = group.kv_cache_spec
        nested = outer.kv_cache_specs.values() if isinstance(outer, UniformTypeKVCacheSpecs) else ()
        for spec in (outer, *nested):
            alignment = spec.block_stride_alignment
            if alignment is not None and alignment <= 0:
                raise OffloadingConfigError("block_stride_alignment must be positive")
            if isinstance(spec, SlidingWindowMLASpec) and spec.model_version not in (None, "deepseek_v4"):
                raise _bare_assertion(
                    f"SlidingWindowMLASpec.model_version={spec.model_version!r} (None or deepseek_v4)"
                )


def _translate(engine_config: EngineConfig, kv: KVCacheConfig, note: DecisionSink) -> OffloadingConfig:
    """The rules of vLLM 0.33's ``build_offloading_config`` in order, reporting each decision to ``note``."""
    _check_spec_construction(kv)
    # Rule 1: the connector config and the engine id must exist (bare asserts in vLLM).
    transfer = engine_config.kv_transfer_config
    if transfer is None:
        raise _bare_assertion("engine_config.kv_transfer_config is None; the offloading connector needs one")
    extra = transfer.kv_connector_extra_config
    if transfer.engine_id is None:
        raise _bare_assertion("kv_transfer_config.engine_id is None; the offloading connector needs one")
    engine_id = transfer.engine_id
    parallel = engine_config.parallel_config
    model = engine_config.model_config
    tp = parallel.tensor_parallel_size
    dcp = parallel.decode_context_parallel_size
    pcp = parallel.prefill_context_parallel_size

    # Rule 2: group selection.
    selected_ids = offloading_group_ids(kv, note)
    selected: tuple[tuple[int, KVCacheGroupSpec], ...] = tuple((i, kv.kv_cache_groups[i]) for i in selected_ids)
    if not selected:
        raise OffloadingConfigError("KV offloading found no eligible cache groups.")

    # Rule 3: DCP-scaled tokens per block of each selected group.
    tokens_per_block: list[int] = []
    for group_id, group in selected:
        tpb = resolve_dcp_kv_block_size(group.kv_cache_spec, dcp)
        tokens_per_block.append(tpb)
        scaled = tpb != group.kv_cache_spec.block_size
        note(
            f"group[{group_id}].tokens_per_block",
            tpb,
            f"{spec_kind(group.kv_cache_spec)} block_size={group.kv_cache_spec.block_size}"
            + (f" x dcp={dcp} (dcp_sharded)" if scaled else f" (not scaled: dcp={dcp})"),
        )

    # Rule 4: the hash block over all groups; rule 5: every offloaded block is a whole number of hashes.
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv, engine_config, note)
    for tpb in tokens_per_block:
        if tpb % tokens_per_hash != 0:
            raise OffloadingConfigError(
                f"tokens_per_block={tpb} not divisible by tokens_per_hash={tokens_per_hash}. Hybrid models "
                "(e.g. Mamba+Attention) need --enable-prefix-caching to align block sizes.",
                vllm_exception="AssertionError",
            )

    # Rule 6: chunking.
    blocks_per_chunk = _blocks_per_chunk(extra, tokens_per_block, note)

    # Rule 7: the group configs, with each window measured in chunks of this group's size.
    groups: list[OffloadingGroupConfig] = []
    for (group_id, group), tpb in zip(selected, tokens_per_block, strict=True):
        chunks = sliding_window_size_in_chunks(group.kv_cache_spec, tpb * blocks_per_chunk)
        if chunks is not None:
            note(
                f"group[{group_id}].sliding_window_size_in_chunks",
                chunks,
                f"{spec_kind(group.kv_cache_spec)} window over chunks of {tpb * blocks_per_chunk} tokens",
            )
        groups.append(
            OffloadingGroupConfig(
                group_id=group_id,
                tokens_per_block=tpb,
                layer_names=tuple(group.layer_names),
                sliding_window_size_in_chunks=chunks,
            )
        )

    # Rule 8: bytes of one GPU block on one worker.
    worker_kv_bytes_per_block = _worker_kv_bytes_per_block(kv, selected, note)

    # Rule 9: the single group's spec (all groups, not only the selected ones).
    single_spec = kv.kv_cache_groups[0].kv_cache_spec if len(kv.kv_cache_groups) == 1 else None

    # Rule 10: the direct replicated layout (MLA replicas of one TP group share one host copy).
    backend = parallel.distributed_executor_backend
    replicated_layout = _gates(
        note,
        "replicated_layout",
        [
            ("use_mla", model.use_mla, f"model_config.use_mla={model.use_mla} (needs True)"),
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
            ("pcp==1", pcp == 1, f"prefill_context_parallel_size={pcp}"),
            ("dcp==1", dcp == 1, f"decode_context_parallel_size={dcp}"),
            (
                "world_size==tp",
                parallel.world_size == tp,
                f"world_size={parallel.world_size}, tensor_parallel_size={tp} (TP-only)",
            ),
            (
                "backend==mp",
                backend == "mp",
                f"distributed_executor_backend={backend!r} (the shared /dev/shm layout needs 'mp')",
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

    # Rule 11.
    canonical_layout = bool(extra.get("canonical_layout", False))
    note(
        "canonical_layout",
        canonical_layout,
        f"bool(kv_connector_extra_config.get('canonical_layout', False)) of {extra.get('canonical_layout')!r}",
    )

    # Rule 12: the direct parallelism-agnostic gate (one head-sharded, non-MLA full-attention group).
    total_kv_heads = model.total_num_kv_heads
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
    is_parallelism_agnostic = _gates(
        note,
        "is_parallelism_agnostic",
        [
            (
                "v1_model_runner",
                not engine_config.use_v2_model_runner,
                f"use_v2_model_runner={engine_config.use_v2_model_runner} (needs False)",
            ),
            ("single_full_attention_group", is_full, kind_reason),
            ("heads_sharded", heads_ok, heads_reason),
            ("not_per_token_head", per_token_ok, per_token_reason),
            ("dcp==1", dcp == 1, f"decode_context_parallel_size={dcp}"),
            ("pcp==1", pcp == 1, f"prefill_context_parallel_size={pcp}"),
        ],
        topic="is_parallelism_agnostic",
        what="direct gate (one head-sharded, non-MLA full-attention group)",
    )

    # Rule 13: canonical pages widen the gate to every config whose layers certify one by one.
    if canonical_layout and is_parallelism_agnostic:
        note("canonical.certification", True, "skipped: the direct gate already holds")
    if canonical_layout and not is_parallelism_agnostic:
        layer_specs: list[tuple[str, KVCacheSpec]] = []
        for group_id, group in enumerate(kv.kv_cache_groups):
            specs = iter_layer_specs(group.kv_cache_spec)
            layer_specs.extend(zip(_layer_topics(group, group_id, len(specs)), specs, strict=True))
        certified = True
        for topic, spec in layer_specs:
            ok, why = _spec_certifiable(spec, tp, total_kv_heads)
            note(f"canonical.{topic}", ok, why)
            certified = certified and ok
        is_parallelism_agnostic = _gates(
            note,
            "canonical.is_parallelism_agnostic",
            [
                ("has_layers", len(layer_specs) > 0, f"{len(layer_specs)} layer specs over all groups"),
                ("all_layers_certified", certified, "every layer spec passes the canonical certification"),
                ("dcp==1", dcp == 1, f"decode_context_parallel_size={dcp}"),
                ("pcp==1", pcp == 1, f"prefill_context_parallel_size={pcp}"),
                (
                    "world_size==tp",
                    parallel.world_size == tp,
                    f"world_size={parallel.world_size}, tensor_parallel_size={tp}",
                ),
            ],
            topic="is_parallelism_agnostic",
            what="canonical_layout: recomputed from the per-layer certification",
        )

    # Rule 14: with canonical pages, the replicated layout is recomputed from the certification.
    if canonical_layout:
        selected_layers = [spec for _, g in selected for spec in iter_layer_specs(g.kv_cache_spec)]
        all_mla = all(type(spec) is MLAAttentionSpec for spec in selected_layers)
        kinds = sorted({spec_kind(spec) for spec in selected_layers})
        replicated_layout = _gates(
            note,
            "canonical.replicated_layout",
            [
                (
                    "is_parallelism_agnostic",
                    is_parallelism_agnostic,
                    f"is_parallelism_agnostic={is_parallelism_agnostic}",
                ),
                (
                    "all_selected_mla",
                    all_mla,
                    f"selected layer spec kinds {kinds} (all must be mla_attention)",
                ),
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

    # Rule 15: the cache dtype string.
    cache_dtype = engine_config.cache_config.cache_dtype
    dtype = model.dtype.value if cache_dtype.value == "auto" else cache_dtype.value
    source = " → model_config.dtype" if cache_dtype.value == "auto" else " verbatim"
    note("model.dtype", dtype, f"cache_config.cache_dtype={cache_dtype.value!r}{source}")

    # Rule 16.
    events = engine_config.kv_events_config
    return OffloadingConfig(
        groups=tuple(groups),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=events is not None and events.enable_kv_cache_events,
        extra_config=dict(extra),
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model.model, dtype=dtype, max_model_len=model.max_model_len),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_hash, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=parallel.rank,
            world_size=parallel.world_size,
            tp_size=tp,
            pp_size=parallel.pipeline_parallel_size,
            pcp_size=pcp,
            dcp_size=dcp,
            data_parallel_index=parallel.data_parallel_index,
            data_parallel_size=parallel.data_parallel_size,
            data_parallel_rank_local=parallel.data_parallel_rank_local,
            is_parallelism_agnostic=is_parallelism_agnostic,
        ),
        replicated_layout=replicated_layout,
        canonical_layout=canonical_layout,
        kv_cache_layout=engine_config.cache_config.kv_cache_layout,
    )


def _blocks_per_chunk(extra: Mapping[str, object], tokens_per_block: list[int], note: DecisionSink) -> int:
    """Rule 6: GPU blocks per host chunk from ``blocks_per_chunk`` or ``block_size`` (tokens) in the extra
    config, exclusive; 1 when neither is set."""
    bpc_option = extra.get("blocks_per_chunk")
    tokens_option = extra.get("block_size")
    if bpc_option is not None and tokens_option is not None:
        raise OffloadingConfigError(
            "Specify only one of 'block_size' or 'blocks_per_chunk' in kv_connector_extra_config."
        )
    if bpc_option is not None:
        bpc = _int_option("blocks_per_chunk", bpc_option)
        if bpc <= 0:
            raise OffloadingConfigError("'blocks_per_chunk' must be greater than 0.")
        note("blocks_per_chunk", bpc, f"kv_connector_extra_config['blocks_per_chunk']={bpc_option!r}")
        return bpc
    if tokens_option is None:
        note("blocks_per_chunk", 1, "neither 'blocks_per_chunk' nor 'block_size' in kv_connector_extra_config")
        return 1
    tokens_per_chunk = _int_option("block_size", tokens_option)
    unique = set(tokens_per_block)
    if len(unique) != 1:
        raise OffloadingConfigError(
            "If 'block_size' is specified in kv_connector_extra_config, there must be at least one KV cache "
            "group, and all groups must have the same block size.",
            vllm_exception="AssertionError",
        )
    tpb = unique.pop()
    if tokens_per_chunk % tpb != 0:
        raise OffloadingConfigError(
            f"'block_size'={tokens_per_chunk} in kv_connector_extra_config must be a multiple of the GPU KV "
            f"cache block size ({tpb} tokens). Use {round_up(tokens_per_chunk, tpb)} instead, or set "
            "'blocks_per_chunk' to express the chunk size in blocks."
        )
    bpc = tokens_per_chunk // tpb
    if bpc <= 0:
        # vLLM returns blocks_per_chunk <= 0 here and divides by zero later (SWA windows, host-pool sizing).
        raise OffloadingConfigError(
            f"'block_size'={tokens_per_chunk} in kv_connector_extra_config must be a positive multiple of "
            f"the GPU KV cache block size ({tpb} tokens); it gives blocks_per_chunk={bpc}.",
            vllm_exception="ZeroDivisionError" if bpc == 0 else "ValueError",
        )
    note(
        "blocks_per_chunk",
        bpc,
        f"kv_connector_extra_config['block_size']={tokens_option!r} tokens // {tpb} tokens per (DCP-scaled) block",
    )
    return bpc


def _worker_kv_bytes_per_block(
    kv: KVCacheConfig, selected: tuple[tuple[int, KVCacheGroupSpec], ...], note: DecisionSink
) -> int:
    """Rule 8: the backing allocation per block when tensors are known (no HiSparse), else the selected
    groups' pages, else 0."""
    if kv.hisparse_host_num_blocks is None and kv.num_blocks > 0 and kv.kv_cache_tensors:
        total = kv.kv_cache_tensors[0].size
        value = total // kv.num_blocks
        note(
            "worker_kv_bytes_per_block",
            value,
            f"kv_cache_tensors[0].size={total} // num_blocks={kv.num_blocks} (the whole backing "
            "allocation per block, including groups that are not offloaded)",
        )
        return value
    if kv.num_blocks > 0:
        parts: list[int] = []
        for _, group in selected:
            try:
                parts.append(group_kv_bytes_per_block(group))
            except ConfigError as exc:
                # vLLM: a bare `assert page_size_padded >= unpadded` inside page_size_bytes.
                raise _bare_assertion(str(exc)) from exc
        if kv.hisparse_host_num_blocks is not None:
            why = f"hisparse_host_num_blocks={kv.hisparse_host_num_blocks}: tensors ignored"
        else:
            why = "no kv_cache_tensors"
        value = sum(parts)
        note(
            "worker_kv_bytes_per_block",
            value,
            f"{why}; sum of the selected groups' block bytes {tuple(parts)} (wrapper: sum of layer pages; "
            "otherwise page x layers)",
        )
        return value
    note("worker_kv_bytes_per_block", 0, "num_blocks=0")
    return 0


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
        ok = spec.tokens_per_state == 1 and real % spec.block_size == 0
        return ok, (
            f"mla_attention: tokens_per_state={spec.tokens_per_state} (needs 1), real page {real} bytes "
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


# ----------------------------------------------------------------------------------------------------
# Snapshot files
# ----------------------------------------------------------------------------------------------------

_PATH_RE = re.compile(r" - at `(\$[^`]*)`$")
_TOKEN_RE = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


DEFAULT_MAX_SNAPSHOT_BYTES = 16 * 1024 * 1024
"""Largest snapshot file :func:`load_snapshot` reads unless told otherwise (real engines' snapshots are KBs)."""


def load_snapshot(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES) -> EngineSnapshot:
    """Read an engine snapshot from a JSON or TOML file (by suffix; otherwise JSON when it starts with ``{``).

    Decoding is strict (unknown fields, wrong types and out-of-range values are rejected). Any failure is a
    ConfigError whose one-line message names the file, the field path and, when present, the bad value. At
    most ``max_bytes`` bytes are read (a larger input, e.g. ``/dev/zero``, is refused without reading on),
    and a document nested too deeply to decode is refused instead of raising RecursionError.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ConfigError(f"max_bytes={max_bytes!r} must be an int >= 1")
    file = Path(path)
    try:
        with file.open("rb") as handle:
            raw = handle.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) > max_bytes:
        raise ConfigError(f"{file}: larger than max_bytes={max_bytes}: not an engine snapshot (raise the limit?)")
    try:
        return _decode_snapshot(file, raw)
    except RecursionError:
        raise ConfigError(f"{file}: nested too deeply to decode (not an engine snapshot)") from None


def _decode_snapshot(file: Path, raw: bytes) -> EngineSnapshot:
    is_toml = file.suffix.lower() == ".toml" or (file.suffix.lower() != ".json" and not raw.lstrip().startswith(b"{"))
    document: object = None
    if is_toml:
        try:
            document = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: invalid TOML: {exc}") from exc
        try:
            raw = msgspec.json.encode(document)
        except (TypeError, msgspec.EncodeError) as exc:  # pragma: no cover - tomllib yields JSON-able values
            raise ConfigError(f"{file}: unsupported TOML value: {exc}") from exc
    try:
        return codecs.decode_engine_snapshot_json(raw)
    except msgspec.ValidationError as exc:
        if document is None:
            try:
                document = json.loads(raw)
            except ValueError:  # pragma: no cover - msgspec already parsed it
                document = None
        raise ConfigError(f"{file}: {_with_value(str(exc), document)}") from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{file}: invalid JSON: {exc}") from exc


def _with_value(message: str, document: object) -> str:
    """Append the offending value to a msgspec validation message (it names the path, not the value)."""
    match = _PATH_RE.search(message)
    if match is None:
        return message
    found, value = _lookup(document, match.group(1))
    if not found or isinstance(value, (dict, list)):
        return message
    return f"{message} (got {json.dumps(value)})"


def _lookup(document: object, path: str) -> tuple[bool, object]:
    node = document
    for key, index in _TOKEN_RE.findall(path[1:]):
        if key and isinstance(node, dict) and key in node:
            node = node[key]
        elif index and isinstance(node, list) and int(index) < len(node):
            node = node[int(index)]
        else:
            return False, None
    return True, node
