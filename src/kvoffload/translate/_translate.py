"""The translator: an engine's KV-cache metadata → :class:`OffloadingConfig`, exactly as vLLM 0.33.

:func:`build_offloading_config` re-implements vLLM 0.33's ``build_offloading_config``
(``distributed/kv_transfer/kv_connector/v1/offloading/config.py``) rule for rule, on our generated types, in
vLLM's order (the first rule that fails decides the error):

1. the connector config (``kv_transfer_config``) and its ``engine_id`` exist;
2. group selection: the transferable, prefix-cacheable groups (with HiSparse: the ``hisparse_indexer``
   groups); none is an error;
3. each selected group's tokens per block: its spec's ``block_size``, times dcp when the spec is DCP-sharded;
4. ``tokens_per_hash`` over all groups (:func:`~kvoffload.translate._rules.resolve_kv_cache_block_sizes`), and
5. every selected group's block is a whole number of hash blocks;
6. ``blocks_per_chunk`` from ``blocks_per_chunk`` or ``block_size`` (tokens) in ``kv_connector_extra_config``
   (exclusive; 1 when neither is set);
7. the group configs, each window (sliding window, chunked local, Mamba) measured in chunks of that group;
8. ``worker_kv_bytes_per_block``: the first KV tensor's size per block, else the selected groups' pages;
9-14. the parallelism gates ``replicated_layout``, ``canonical_layout`` and ``is_parallelism_agnostic``
   (:mod:`kvoffload.translate._gates`);
15. the cache dtype string (the model dtype when ``cache_dtype`` is ``auto``);
16. the :class:`OffloadingConfig` itself.

Every condition vLLM checks with ``raise`` or ``assert`` raises :class:`OffloadingConfigError` carrying vLLM's
exact message and, in ``vllm_exception``, the exception type vLLM raises. Where vLLM fails a bare ``assert``
(no message) the message is empty too, like vLLM's, and the detail travels as a PEP 678 note
(``err.__notes__``), which tracebacks and the CLI print.

:func:`explain_offloading_config` runs the very same code path with a decision recorder and returns an
:class:`~kvoffload.Explanation` (see :mod:`kvoffload.translate._explain`): the config (or the error) and the ordered
decisions of every rule above. It is a sibling function rather than an ``explain=True`` flag so each function
has one return type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

from kvoffload._generated.types import (
    AttentionSpec,
    EngineConfig,
    EngineSnapshot,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)
from kvoffload._ints import round_up
from kvoffload.errors import ConfigError, OffloadingConfigError
from kvoffload.translate._explain import DecisionSink, Explanation, Recorder, bare_assertion, discard
from kvoffload.translate._gates import ParallelGates, decide_parallel_gates
from kvoffload.translate._rules import resolve_kv_cache_block_sizes, sliding_window_size_in_chunks
from kvoffload.translate._spec_math import (
    group_kv_bytes_per_block,
    prefix_cacheable,
    resolve_dcp_kv_block_size,
    spec_kind,
    tokens_per_state,
)

__all__ = [
    "build_offloading_config",
    "explain_offloading_config",
    "explain_snapshot",
    "translate_snapshot",
]

_Selected: TypeAlias = tuple[tuple[int, KVCacheGroupSpec], ...]
"""The selected groups as ``(group_id, group)`` pairs, in group order."""


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
    return _translate(engine_config, kv_cache_config, discard)


def explain_offloading_config(engine_config: EngineConfig, kv_cache_config: KVCacheConfig) -> Explanation:
    """Run :func:`build_offloading_config` on the same code path, recording every decision.

    Never raises for invalid input: a ConfigError (incl. OffloadingConfigError) lands in ``error``.
    """
    recorder = Recorder()
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


def _check_spec_construction(kv: KVCacheConfig) -> None:
    """What vLLM's spec dataclasses reject when they are built, i.e. before the translator runs; and a spec that
    means no vLLM value (``states_per_token > 1`` with ``tokens_per_state != 1``), a ConfigError naming it."""
    for group_id, group in enumerate(kv.kv_cache_groups):
        outer = group.kv_cache_spec
        where = f"kv_cache_groups[{group_id}].kv_cache_spec"
        nested = outer.kv_cache_specs.items() if isinstance(outer, UniformTypeKVCacheSpecs) else ()
        for path, spec in ((where, outer), *((f"{where}.kv_cache_specs[{n!r}]", s) for n, s in nested)):
            alignment = spec.block_stride_alignment
            if alignment is not None and alignment <= 0:
                raise OffloadingConfigError("block_stride_alignment must be positive")
            if isinstance(spec, SlidingWindowMLASpec) and spec.model_version not in (None, "deepseek_v4"):
                raise bare_assertion(f"SlidingWindowMLASpec.model_version={spec.model_version!r} (None or deepseek_v4)")
            if isinstance(spec, AttentionSpec):
                try:
                    tokens_per_state(spec)
                except ConfigError as exc:
                    raise ConfigError(f"{path}: {exc}") from None


def _translate(engine_config: EngineConfig, kv: KVCacheConfig, note: DecisionSink) -> OffloadingConfig:
    """The rules of vLLM 0.33's ``build_offloading_config`` in order, reporting each decision to ``note``."""
    _check_spec_construction(kv)
    extra, engine_id = _connector(engine_config)
    dcp = engine_config.parallel_config.decode_context_parallel_size
    selected = _select_groups(kv, note)
    tokens_per_block = _tokens_per_block(selected, dcp, note)
    tokens_per_hash = _tokens_per_hash(kv, engine_config, tokens_per_block, note)
    blocks_per_chunk = _blocks_per_chunk(extra, tokens_per_block, note)
    groups = _group_configs(selected, tokens_per_block, blocks_per_chunk, note)
    worker_kv_bytes_per_block = _worker_kv_bytes_per_block(kv, selected, note)
    gates = decide_parallel_gates(engine_config, kv, extra, selected, worker_kv_bytes_per_block, note)
    dtype = _cache_dtype(engine_config, note)
    return _assemble(
        engine_config,
        extra=extra,
        engine_id=engine_id,
        groups=groups,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        tokens_per_hash=tokens_per_hash,
        blocks_per_chunk=blocks_per_chunk,
        gates=gates,
        dtype=dtype,
    )


def _connector(engine_config: EngineConfig) -> tuple[Mapping[str, object], str]:
    """Rule 1: the connector config and the engine id must exist (bare asserts in vLLM)."""
    transfer = engine_config.kv_transfer_config
    if transfer is None:
        raise bare_assertion("engine_config.kv_transfer_config is None; the offloading connector needs one")
    if transfer.engine_id is None:
        raise bare_assertion("kv_transfer_config.engine_id is None; the offloading connector needs one")
    return transfer.kv_connector_extra_config, transfer.engine_id


def _select_groups(kv: KVCacheConfig, note: DecisionSink) -> _Selected:
    """Rule 2: the offloaded groups (:func:`offloading_group_ids`); none is vLLM's ValueError."""
    selected = tuple((i, kv.kv_cache_groups[i]) for i in offloading_group_ids(kv, note))
    if not selected:
        raise OffloadingConfigError("KV offloading found no eligible cache groups.")
    return selected


def offloading_group_ids(kv_cache_config: KVCacheConfig, note: DecisionSink = discard) -> tuple[int, ...]:
    """Groups the offloading connector moves (vLLM's ``get_offloading_group_ids``).

    Without HiSparse (``hisparse_host_num_blocks`` is None): the prefix-cacheable transferable groups. With
    HiSparse: the ``hisparse_indexer`` groups, whatever their other flags. Every group left out is recorded
    with the reason.
    """
    groups = kv_cache_config.kv_cache_groups
    if kv_cache_config.hisparse_host_num_blocks is None:
        selected = tuple(i for i, g in enumerate(groups) if g.enable_kv_transfer and prefix_cacheable(g.kv_cache_spec))
        for i, g in enumerate(groups):
            if i in selected:
                continue
            if not g.enable_kv_transfer:
                why = "enable_kv_transfer is False"
            else:
                why = f"its {spec_kind(g.kv_cache_spec)} spec is not prefix-cacheable"
                if isinstance(g.kv_cache_spec, SlidingWindowMLASpec):
                    why += " (bounded_replay=True)"
            note(f"group[{i}].selected", False, why)
        note(
            "groups",
            selected,
            "hisparse_host_num_blocks is None: the transferable (enable_kv_transfer) prefix-cacheable groups",
        )
        return selected
    selected = tuple(i for i, g in enumerate(groups) if g.role is KVCacheGroupRole.HISPARSE_INDEXER)
    for i, g in enumerate(groups):
        if i not in selected:
            note(f"group[{i}].selected", False, f"HiSparse is on and its role is {g.role.value!r}")
    note(
        "groups",
        selected,
        f"hisparse_host_num_blocks={kv_cache_config.hisparse_host_num_blocks}: only the hisparse_indexer groups",
    )
    return selected


def _tokens_per_block(selected: _Selected, dcp: int, note: DecisionSink) -> tuple[int, ...]:
    """Rule 3: the DCP-scaled tokens per block of each selected group."""
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
    return tuple(tokens_per_block)


def _tokens_per_hash(
    kv: KVCacheConfig, engine_config: EngineConfig, tokens_per_block: Sequence[int], note: DecisionSink
) -> int:
    """Rules 4-5: the hash block over all groups; every offloaded block is a whole number of hash blocks."""
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv, engine_config, note)
    for tpb in tokens_per_block:
        if tpb % tokens_per_hash != 0:
            raise OffloadingConfigError(
                f"tokens_per_block={tpb} not divisible by tokens_per_hash={tokens_per_hash}. Hybrid models "
                "(e.g. Mamba+Attention) need --enable-prefix-caching to align block sizes.",
                vllm_exception="AssertionError",
            )
    return tokens_per_hash


def _blocks_per_chunk(extra: Mapping[str, object], tokens_per_block: Sequence[int], note: DecisionSink) -> int:
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


def _group_configs(
    selected: _Selected, tokens_per_block: Sequence[int], blocks_per_chunk: int, note: DecisionSink
) -> tuple[OffloadingGroupConfig, ...]:
    """Rule 7: the group configs, with each window measured in chunks of this group's size."""
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
    return tuple(groups)


def _worker_kv_bytes_per_block(kv: KVCacheConfig, selected: _Selected, note: DecisionSink) -> int:
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
                raise bare_assertion(str(exc)) from exc
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


def _cache_dtype(engine_config: EngineConfig, note: DecisionSink) -> str:
    """Rule 15: the cache dtype string: the model dtype when ``cache_dtype`` is ``auto``, else verbatim."""
    cache_dtype = engine_config.cache_config.cache_dtype
    dtype = engine_config.model_config.dtype.value if cache_dtype.value == "auto" else cache_dtype.value
    source = " → model_config.dtype" if cache_dtype.value == "auto" else " verbatim"
    note("model.dtype", dtype, f"cache_config.cache_dtype={cache_dtype.value!r}{source}")
    return dtype


def _assemble(
    engine_config: EngineConfig,
    *,
    extra: Mapping[str, object],
    engine_id: str,
    groups: tuple[OffloadingGroupConfig, ...],
    worker_kv_bytes_per_block: int,
    tokens_per_hash: int,
    blocks_per_chunk: int,
    gates: ParallelGates,
    dtype: str,
) -> OffloadingConfig:
    """Rule 16: the OffloadingConfig, with the engine's parallel sizes and the extra config copied through."""
    parallel = engine_config.parallel_config
    model = engine_config.model_config
    events = engine_config.kv_events_config
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=events is not None and events.enable_kv_cache_events,
        extra_config=dict(extra),
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model.model, dtype=dtype, max_model_len=model.max_model_len),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_hash, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=parallel.rank,
            world_size=parallel.world_size,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            pcp_size=parallel.prefill_context_parallel_size,
            dcp_size=parallel.decode_context_parallel_size,
            data_parallel_index=parallel.data_parallel_index,
            data_parallel_size=parallel.data_parallel_size,
            data_parallel_rank_local=parallel.data_parallel_rank_local,
            is_parallelism_agnostic=gates.is_parallelism_agnostic,
        ),
        replicated_layout=gates.replicated_layout,
        canonical_layout=gates.canonical_layout,
        kv_cache_layout=engine_config.cache_config.kv_cache_layout,
    )
