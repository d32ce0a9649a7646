"""The translator against released vLLM 0.33.0's answers, every rule and error text of the seed, the
scenarios of vLLM's own translator unit tests, wrapped-vs-flattened invariance, explain, snapshot loading, and a
property test: any snapshot that decodes translates or raises a ConfigError, nothing else."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload import (
    CacheConfig,
    CacheDType,
    ChunkedLocalAttentionSpec,
    ConfigError,
    DType,
    EngineConfig,
    EngineSnapshot,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVEventsConfig,
    KVQuantMode,
    KVTransferConfig,
    MambaSpec,
    MLAAttentionSpec,
    ModelConfig,
    OffloadingConfig,
    OffloadingConfigError,
    ParallelConfig,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    codecs,
)
from kvoffload.translate import (
    Explanation,
    build_offloading_config,
    describe_error,
    explain_offloading_config,
    explain_snapshot,
    load_snapshot,
    translate_snapshot,
)
from tests.conftest import load_cases
from tests.helpers import flatten_for_scheduler

# ------------------------------------------------------------------------------------------------------------
# recorded cases answered by vLLM 0.33.0 (tests/data/translate_cases.jsonl)
# ------------------------------------------------------------------------------------------------------------


CASES: list[dict[str, Any]] = load_cases()


def _outcome(engine_config: EngineConfig, kv: KVCacheConfig) -> dict[str, Any]:
    """vLLM's answer format: {"ok": config-dict} or {"error": exception-name, "message": text}."""
    try:
        config = build_offloading_config(engine_config, kv)
    except OffloadingConfigError as err:
        return {"error": err.vllm_exception, "message": str(err)}
    return {"ok": json.loads(codecs.encode(config, format="json"))}


def test_all_shared_cases_are_present() -> None:
    assert len(CASES) == 37


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_shared_case_agrees_with_vllm(case: dict[str, Any]) -> None:
    snapshot = codecs.decode(json.dumps(case["input"]), EngineSnapshot, format="json")
    assert _outcome(snapshot.engine_config, snapshot.kv_cache_config) == case["expect"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_shared_case_scheduler_view_agrees(case: dict[str, Any]) -> None:
    """The flattened (scheduler) view gives the same answer, but for vLLM's documented per-process
    difference of is_parallelism_agnostic on a single wrapped group."""
    snapshot = codecs.decode(json.dumps(case["input"]), EngineSnapshot, format="json")
    wrapped = _outcome(snapshot.engine_config, snapshot.kv_cache_config)
    flat = _outcome(snapshot.engine_config, flatten_for_scheduler(snapshot.kv_cache_config))
    groups = snapshot.kv_cache_config.kv_cache_groups
    if len(groups) == 1 and isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs) and "ok" in flat:
        flat["ok"]["parallel"]["is_parallelism_agnostic"] = wrapped["ok"]["parallel"]["is_parallelism_agnostic"]
    assert flat == wrapped


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_shared_case_explain_runs_the_same_path(case: dict[str, Any]) -> None:
    snapshot = codecs.decode(json.dumps(case["input"]), EngineSnapshot, format="json")
    explanation = explain_snapshot(snapshot)
    if "ok" in case["expect"]:
        assert explanation.config is not None and explanation.error is None
        assert json.loads(codecs.encode(explanation.config, format="json")) == case["expect"]["ok"]
        cfg = explanation.config
        assert explanation.find("replicated_layout").value is cfg.replicated_layout
        assert explanation.find("is_parallelism_agnostic").value is cfg.parallel.is_parallelism_agnostic
        assert explanation.find("tokens_per_hash").value == cfg.cache.tokens_per_hash
        assert explanation.find("blocks_per_chunk").value == cfg.cache.blocks_per_chunk
        assert explanation.find("worker_kv_bytes_per_block").value == cfg.worker_kv_bytes_per_block
    else:
        assert isinstance(explanation.error, OffloadingConfigError)
        assert explanation.error_type == case["expect"]["error"]
        assert str(explanation.error) == case["expect"]["message"]


# ------------------------------------------------------------------------------------------------------------
# builders
# ------------------------------------------------------------------------------------------------------------


def full(bs: int = 16, heads: int = 4, head: int = 128, **kw: Any) -> FullAttentionSpec:
    kw.setdefault("dtype", DType.FLOAT16)
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, **kw)


def mla(bs: int = 16, head: int = 576, **kw: Any) -> MLAAttentionSpec:
    kw.setdefault("dtype", DType.BFLOAT16)
    return MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=head, **kw)


def swa(bs: int = 16, window: int = 128, heads: int = 4, **kw: Any) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=heads, head_size=128, dtype=DType.FLOAT16, sliding_window=window, **kw
    )


def swa_mla(bs: int = 16, **kw: Any) -> SlidingWindowMLASpec:
    return SlidingWindowMLASpec(
        block_size=bs, num_kv_heads=1, head_size=512, dtype=DType.BFLOAT16, sliding_window=128, **kw
    )


def mamba(bs: int = 16, mode: str = "align", **kw: Any) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=((16, 1),), dtypes=(DType.FLOAT32,), mamba_cache_mode=mode, **kw)


def wrap(bs: int = 16, **specs: KVCacheSpec) -> UniformTypeKVCacheSpecs:
    return UniformTypeKVCacheSpecs(block_size=bs, kv_cache_specs=specs)


def group(spec: KVCacheSpec, *names: str, **kw: Any) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layer_names=names or ("layer.0",), kv_cache_spec=spec, **kw)


def kvc(
    *groups: KVCacheGroupSpec, num_blocks: int = 4, tensors: tuple[KVCacheTensor, ...] = (), **kw: Any
) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups, **kw)


def eng(
    *,
    block_size: int = 16,
    extra: Mapping[str, object] | None = None,
    tp: int = 1,
    pp: int = 1,
    pcp: int = 1,
    dcp: int = 1,
    world: int | None = None,
    backend: str | None = "mp",
    nnodes: int = 1,
    use_mla: bool = False,
    total_heads: int = 4,
    v2: bool = False,
    cache_dtype: CacheDType = CacheDType.FLOAT16,
    events: bool | None = None,
    prefix_caching: bool = True,
    pmu: int | None = None,
    engine_id: str | None = "engine-0",
    transfer: bool = True,
    **parallel: Any,
) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(
            model="test/model",
            dtype=DType.BFLOAT16,
            use_mla=use_mla,
            total_num_kv_heads=total_heads,
            max_model_len=2048,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            cache_dtype=cache_dtype,
            enable_prefix_caching=prefix_caching,
            prefix_match_unit=pmu,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=dcp,
            world_size=world if world is not None else tp * pp * pcp,
            distributed_executor_backend=backend,
            nnodes_within_dp=nnodes,
            **parallel,
        ),
        kv_transfer_config=KVTransferConfig(engine_id=engine_id, kv_connector_extra_config=dict(extra or {}))
        if transfer
        else None,
        kv_events_config=None if events is None else KVEventsConfig(enable_kv_cache_events=events),
        use_v2_model_runner=v2,
    )


def rejects(engine_config: EngineConfig, kv: KVCacheConfig) -> OffloadingConfigError:
    with pytest.raises(OffloadingConfigError) as err:
        build_offloading_config(engine_config, kv)
    return err.value


# ------------------------------------------------------------------------------------------------------------
# the seed's rules and error texts
# ------------------------------------------------------------------------------------------------------------


def test_connector_config_and_engine_id_are_required() -> None:
    err = rejects(eng(transfer=False), kvc(group(full())))
    assert (str(err), err.vllm_exception) == ("", "AssertionError")  # vLLM's bare assert
    assert "kv_transfer_config is None" in describe_error(err)
    err = rejects(eng(engine_id=None), kvc(group(full())))
    assert (str(err), err.vllm_exception) == ("", "AssertionError")
    assert "engine_id is None" in err.__notes__[0]


def test_no_eligible_groups() -> None:
    for kv in (
        kvc(group(full(), enable_kv_transfer=False)),
        kvc(group(swa_mla(bounded_replay=True))),
        kvc(group(full()), hisparse_host_num_blocks=4),  # HiSparse on, but no indexer group
        kvc(),
    ):
        err = rejects(eng(), kv)
        assert (str(err), err.vllm_exception) == (
            "KV offloading found no eligible cache groups.",
            "ValueError",
        )


def test_group_selection_skips_untransferable_and_bounded_replay_groups() -> None:
    kv = kvc(
        group(full(), "a"),
        group(swa(), "b", enable_kv_transfer=False),
        group(swa_mla(bounded_replay=True), "c"),
        group(swa_mla(), "d"),
    )
    config = build_offloading_config(eng(), kv)
    assert [(g.group_id, g.layer_names) for g in config.groups] == [(0, ("a",)), (3, ("d",))]


def test_hisparse_selects_indexer_groups_and_sums_their_pages() -> None:
    indexer = wrap(indexer=mla(16, 128, dtype=DType.UINT8))
    kv = kvc(
        group(mla(), "src", role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
        group(indexer, "indexer", role=KVCacheGroupRole.HISPARSE_INDEXER),
        tensors=(KVCacheTensor(size=10**6, layers=("src",), layer_stride=0, block_stride=18432),),
        hisparse_host_num_blocks=4,
    )
    config = build_offloading_config(eng(), kv)
    assert [(g.group_id, g.layer_names) for g in config.groups] == [(1, ("indexer",))]
    assert config.worker_kv_bytes_per_block == 16 * 128  # tensors ignored under HiSparse
    flat = build_offloading_config(eng(), flatten_for_scheduler(kv))
    assert flat.worker_kv_bytes_per_block == config.worker_kv_bytes_per_block


def test_tokens_per_block_must_be_a_multiple_of_tokens_per_hash() -> None:
    # Full 16 + Mamba "none" 24: finer hashing off, hash = lcm = 48.
    err = rejects(eng(), kvc(group(full(16)), group(mamba(24, "none"))))
    assert err.vllm_exception == "AssertionError"
    assert str(err) == (
        "tokens_per_block=16 not divisible by tokens_per_hash=48. Hybrid models (e.g. Mamba+Attention) need "
        "--enable-prefix-caching to align block sizes."
    )


def test_chunking_options() -> None:
    kv = kvc(group(full(16)))
    assert build_offloading_config(eng(), kv).cache.blocks_per_chunk == 1
    assert build_offloading_config(eng(extra={"blocks_per_chunk": 3}), kv).cache.blocks_per_chunk == 3
    assert build_offloading_config(eng(extra={"block_size": 64}), kv).cache.blocks_per_chunk == 4
    assert (
        build_offloading_config(eng(extra={"blocks_per_chunk": None, "block_size": 32}), kv).cache.blocks_per_chunk == 2
    )
    # int() like vLLM: 2.5 -> 2, "4" -> 4, True -> 1.
    for value, expected in ((2.5, 2), ("4", 4), (True, 1), (" 7 ", 7)):
        assert build_offloading_config(eng(extra={"blocks_per_chunk": value}), kv).cache.blocks_per_chunk == expected
    assert build_offloading_config(eng(extra={"block_size": "48"}), kv).cache.blocks_per_chunk == 3
    assert build_offloading_config(eng(extra={"block_size": 64.9}), kv).cache.blocks_per_chunk == 4


def test_chunking_errors() -> None:
    kv = kvc(group(full(16)))
    err = rejects(eng(extra={"blocks_per_chunk": 2, "block_size": 32}), kv)
    assert (str(err), err.vllm_exception) == (
        "Specify only one of 'block_size' or 'blocks_per_chunk' in kv_connector_extra_config.",
        "ValueError",
    )
    for value in (0, -3, "0", 0.5):
        err = rejects(eng(extra={"blocks_per_chunk": value}), kv)
        assert (str(err), err.vllm_exception) == ("'blocks_per_chunk' must be greater than 0.", "ValueError")
    err = rejects(eng(extra={"block_size": 24}), kv)
    assert str(err) == (
        "'block_size'=24 in kv_connector_extra_config must be a multiple of the GPU KV cache block size "
        "(16 tokens). Use 32 instead, or set 'blocks_per_chunk' to express the chunk size in blocks."
    )
    assert err.vllm_exception == "ValueError"
    # vLLM's round_up on a negative value.
    assert "Use -16 instead" in str(rejects(eng(extra={"block_size": -24}), kv))


def test_block_size_needs_one_group_block_size() -> None:
    err = rejects(eng(extra={"block_size": 64}), kvc(group(full(16)), group(full(32))))
    assert err.vllm_exception == "AssertionError"
    assert str(err) == (
        "If 'block_size' is specified in kv_connector_extra_config, there must be at least one KV cache "
        "group, and all groups must have the same block size."
    )


def test_block_size_is_compared_with_the_dcp_scaled_block() -> None:
    err = rejects(eng(dcp=2, extra={"block_size": 16}), kvc(group(full(16))))
    assert "GPU KV cache block size (32 tokens). Use 32 instead" in str(err)
    config = build_offloading_config(eng(dcp=2, extra={"block_size": 64}), kvc(group(full(16))))
    assert (config.groups[0].tokens_per_block, config.cache.blocks_per_chunk) == (32, 2)


def test_edge_cases_vllm_lets_through_are_rejected() -> None:
    kv = kvc(group(full(16)))
    err = rejects(eng(extra={"block_size": 0}), kv)
    assert err.vllm_exception == "ZeroDivisionError"
    assert "'block_size'=0" in str(err) and "blocks_per_chunk=0" in str(err)
    err = rejects(eng(extra={"block_size": -32}), kv)
    assert "positive multiple" in str(err) and "blocks_per_chunk=-2" in str(err)
    err = rejects(eng(extra={"block_size": False}), kvc(group(swa())))
    assert "blocks_per_chunk=0" in str(err)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("blocks_per_chunk", "abc", "kv_connector_extra_config['blocks_per_chunk']='abc' is not an integer"),
        ("block_size", [16], "kv_connector_extra_config['block_size']=[16] is not an integer"),
        ("block_size", {"a": 1}, "kv_connector_extra_config['block_size']={'a': 1} is not an integer"),
        ("blocks_per_chunk", "2.5", "invalid literal for int()"),
        ("blocks_per_chunk", float("inf"), "cannot convert float infinity"),
    ],
)
def test_extra_config_values_int_rejects(key: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_offloading_config(eng(extra={key: value}), kvc(group(full())))
    assert not isinstance(err.value, OffloadingConfigError)
    assert fragment in str(err.value)


def test_sliding_window_size_in_chunks_per_group() -> None:
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=128, dtype=DType.FLOAT16, attention_chunk_size=8192
    )
    kv = kvc(
        group(full(16)),
        group(swa(16, window=1024)),
        group(swa(16, window=1024, extra_retained_tokens=200)),
        group(chunked),
        group(mamba(16)),
        group(mla(16)),
    )
    config = build_offloading_config(eng(extra={"block_size": 256}), kv)
    assert [g.sliding_window_size_in_chunks for g in config.groups] == [None, 4, 5, 32, 1, None]


def test_worker_bytes_from_the_backing_allocation() -> None:
    # vLLM unit-test scenario: 2 layers x 8 B x 4 blocks in one tensor, block_size=32 extra, TP3 x PP2.
    spec = full(16, 1, 1, dtype=DType.INT8)
    for tensors in (
        (KVCacheTensor(size=64, layers=("a", "b"), layer_stride=32, block_stride=8),),
        (
            KVCacheTensor(size=64, layers=("a",), layer_stride=0, block_stride=8),
            KVCacheTensor(size=64, layers=("b",), layer_stride=0, block_stride=8, offset=32),
        ),
    ):
        config = build_offloading_config(
            eng(tp=3, pp=2, extra={"block_size": 32}), kvc(group(spec, "a", "b"), tensors=tensors)
        )
        assert (
            config.worker_kv_bytes_per_block,
            config.parallel.world_size,
            config.cache.blocks_per_chunk,
        ) == (
            16,
            6,
            2,
        )


def test_worker_bytes_fallbacks() -> None:
    assert build_offloading_config(eng(), kvc(group(full()), num_blocks=0)).worker_kv_bytes_per_block == 0
    kv = kvc(group(full(16, 4, 128), "a", "b"), group(mamba(16), "m"), group(full(), "x", enable_kv_transfer=False))
    assert build_offloading_config(eng(), kv).worker_kv_bytes_per_block == 2 * 32768 + 64
    wrapper = wrap(a=mla(16, 576, alignment=4096), b=mla(16, 576, alignment=4096))
    assert build_offloading_config(eng(), kvc(group(wrapper, "a", "b"))).worker_kv_bytes_per_block == 2 * 20480


def test_padded_page_smaller_than_unpadded_fails_like_vllm() -> None:
    err = rejects(eng(), kvc(group(full(page_size_padded=100))))
    assert (str(err), err.vllm_exception) == ("", "AssertionError")
    assert "page_size_padded=100 smaller than its unpadded page (32768 bytes)" in describe_error(err)
    # With tensors the page is never computed, as in vLLM.
    tensors = (KVCacheTensor(size=400, layers=("layer.0",), layer_stride=0, block_stride=100),)
    assert (
        build_offloading_config(
            eng(), kvc(group(full(page_size_padded=100)), tensors=tensors)
        ).worker_kv_bytes_per_block
        == 100
    )


def test_model_dtype_events_and_verbatim_fields() -> None:
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 1 << 30,
        "eviction_policy": "arc",
        "secondary_tiers": [{"type": "fs"}],
    }
    config = build_offloading_config(
        eng(
            cache_dtype=CacheDType.AUTO,
            events=True,
            extra=extra,
            data_parallel_index=2,
            data_parallel_size=4,
            data_parallel_rank_local=1,
            rank=1,
        ),
        kvc(group(full())),
    )
    assert config.model.dtype == "bfloat16" and config.model.name == "test/model" and config.model.max_model_len == 2048
    assert config.enable_kv_cache_events and config.extra_config == extra and config.engine_id == "engine-0"
    p = config.parallel
    assert (p.rank, p.data_parallel_index, p.data_parallel_size, p.data_parallel_rank_local) == (1, 2, 4, 1)
    fp8 = build_offloading_config(eng(cache_dtype=CacheDType.FP8, events=False), kvc(group(full())))
    assert fp8.model.dtype == "fp8" and not fp8.enable_kv_cache_events
    assert not build_offloading_config(eng(), kvc(group(full()))).enable_kv_cache_events


# ------------------------------------------------------------------------------------------------------------
# scenarios of vLLM's translator unit tests
# ------------------------------------------------------------------------------------------------------------


def test_pcp_does_not_scale_blocks() -> None:
    config = build_offloading_config(eng(pcp=2, extra={"block_size": 64}), kvc(group(full(16))))
    assert ([g.tokens_per_block for g in config.groups], config.cache.tokens_per_hash) == ([16], 16)
    assert config.cache.blocks_per_chunk == 4


def test_dcp_scales_attention_not_mamba() -> None:
    config = build_offloading_config(eng(tp=2, dcp=2, world=2), kvc(group(full(16)), group(mamba(16))))
    assert [g.tokens_per_block for g in config.groups] == [32, 16]
    assert config.groups[1].sliding_window_size_in_chunks == 1


@pytest.mark.parametrize(("dcp", "expected"), [(1, 16), (2, 32)])
def test_dcp_on_an_mla_indexer_wrapper(dcp: int, expected: int) -> None:
    wrapper = wrap(attn=mla(16), indexer=mla(16, 128, dtype=DType.UINT8))
    config = build_offloading_config(eng(dcp=dcp, world=1), kvc(group(wrapper, "attn", "indexer")))
    assert (config.groups[0].tokens_per_block, config.cache.tokens_per_hash) == (expected, expected)
    mamba_wrapper = wrap(m0=mamba(16), m1=mamba(16))
    config = build_offloading_config(eng(dcp=dcp, world=1), kvc(group(mamba_wrapper, "m0", "m1")))
    assert config.groups[0].tokens_per_block == 16


def test_hybrid_block_sizes_with_small_engine_block() -> None:
    kv = kvc(group(full(12)), group(mla(16)))
    config = build_offloading_config(eng(block_size=4), kv)
    assert ([g.tokens_per_block for g in config.groups], config.cache.tokens_per_hash) == ([12, 16], 4)
    assert config.cache.blocks_per_chunk == 1
    assert build_offloading_config(eng(block_size=4, extra={"blocks_per_chunk": 2}), kv).cache.blocks_per_chunk == 2


def _mla_tp(tp: int, **kw: Any) -> tuple[EngineConfig, KVCacheConfig]:
    """Pure MLA over TP with the planner's kv_tp_replicas == tp; ``kw`` overrides engine settings."""
    settings: dict[str, Any] = {"tp": tp, "use_mla": True}
    settings.update(kw)
    return eng(**settings), kvc(group(mla(16)), kv_tp_replicas=settings["tp"])


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("v2", [False, True])
def test_replicated_layout_for_pure_mla(tp: int, v2: bool) -> None:
    assert build_offloading_config(*_mla_tp(tp, v2=v2)).replicated_layout


@pytest.mark.parametrize(
    ("gate", "engine_kw", "kv"),
    [
        ("tp>1", {"tp": 1}, None),
        ("use_mla", {"use_mla": False}, None),
        ("pp==1", {"pp": 2}, None),
        ("pcp==1", {"pcp": 2}, None),
        ("dcp==1", {"dcp": 2, "world": 4}, None),
        ("world_size==tp", {"world": 8}, None),
        ("backend==mp", {"backend": "ray"}, None),
        ("backend==mp", {"backend": "uni"}, None),
        ("backend==mp", {"backend": None}, None),
        ("nnodes_within_dp==1", {"nnodes": 2}, None),
        ("kv_tp_replicas==tp", {}, kvc(group(mla(16)))),  # 0.33.0 needs the planner's kv_tp_replicas == tp
        ("worker_kv_bytes_per_block>0", {}, kvc(group(mla(16)), kv_tp_replicas=4, num_blocks=0)),
    ],
)
def test_replicated_layout_gates(gate: str, engine_kw: dict[str, Any], kv: KVCacheConfig | None) -> None:
    engine_config, default_kv = _mla_tp(**{"tp": 4, **engine_kw})
    kv = kv or default_kv
    assert not build_offloading_config(engine_config, kv).replicated_layout
    explanation = explain_offloading_config(engine_config, kv)
    assert gate in {d.topic.split(".", 1)[1] for d in explanation.failing("replicated_layout.")}


def test_replicated_layout_ignores_spec_types_in_the_direct_gate() -> None:
    # vLLM's direct gate relies on kv_tp_replicas == tp only: an MLA + full hybrid with replicas still passes.
    kv = kvc(group(mla(16)), group(full(16)), kv_tp_replicas=2)
    assert build_offloading_config(eng(tp=2, use_mla=True), kv).replicated_layout


def test_is_parallelism_agnostic_direct_gate() -> None:
    assert build_offloading_config(eng(tp=2, total_heads=8), kvc(group(full(heads=4)))).parallel.is_parallelism_agnostic
    negatives = [
        (eng(tp=2, total_heads=8), kvc(group(full(heads=8)))),  # replicated GQA heads
        (eng(tp=1, total_heads=1), kvc(group(mla()))),
        (eng(tp=1), kvc(group(swa()))),
        (eng(tp=1), kvc(group(full()), group(full()))),
        (eng(tp=1, v2=True), kvc(group(full()))),
        (eng(tp=1), kvc(group(full(kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)))),
        (eng(tp=1, dcp=2), kvc(group(full()))),
        (eng(tp=1, pcp=2), kvc(group(full()))),
    ]
    for engine_config, kv in negatives:
        assert not build_offloading_config(engine_config, kv).parallel.is_parallelism_agnostic


def test_is_parallelism_agnostic_differs_per_process_for_a_single_wrapper() -> None:
    kv = kvc(group(wrap(a=full(), b=full()), "a", "b"))
    assert not build_offloading_config(eng(), kv).parallel.is_parallelism_agnostic  # worker: a wrapper
    assert build_offloading_config(eng(), flatten_for_scheduler(kv)).parallel.is_parallelism_agnostic  # scheduler


CANONICAL: dict[str, object] = {"canonical_layout": True}


@pytest.mark.parametrize(
    ("name", "engine_kw", "kv", "agnostic"),
    [
        ("mla latent", {"tp": 2, "total_heads": 128}, kvc(group(mla())), True),
        ("full + swa", {"tp": 2, "total_heads": 8}, kvc(group(full(heads=4)), group(swa(heads=4))), True),
        (
            "gqa replicated heads",
            {"tp": 8, "total_heads": 4},
            kvc(group(full(heads=1)), group(swa(heads=1))),
            True,
        ),
        ("swa-mla", {"tp": 2}, kvc(group(swa_mla())), False),
        ("mamba hybrid", {"tp": 1}, kvc(group(full()), group(mamba())), False),
        ("uniform mla wrapper", {"tp": 2}, kvc(group(wrap(a=mla(), i=mla(head=128)), "a", "i")), True),
        (
            "wrapper with tps=2",
            {"tp": 2},
            kvc(group(wrap(a=mla(), i=mla(tokens_per_state=2)), "a", "i")),
            False,
        ),
        ("canonical + v2", {"tp": 2, "v2": True}, kvc(group(mla())), True),
        (
            "per-token-head",
            {"tp": 1},
            kvc(group(full(kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)), group(swa())),
            False,
        ),
        (
            "heads mismatch",
            {"tp": 2, "total_heads": 8},
            kvc(group(full(heads=8)), group(swa(heads=4))),
            False,
        ),
        (
            "tp not dividing",
            {"tp": 4, "total_heads": 6},
            kvc(group(full(heads=2)), group(swa(heads=2))),
            False,
        ),
        (
            "mla page not per token",
            {"tp": 1},
            kvc(group(mla(16, state_content_bytes=1, num_head_slots=3, page_size_padded=64))),
            True,
        ),
        (
            "chunked local",
            {"tp": 1},
            kvc(
                group(
                    ChunkedLocalAttentionSpec(
                        block_size=16,
                        num_kv_heads=4,
                        head_size=128,
                        dtype=DType.FLOAT16,
                        attention_chunk_size=64,
                    )
                )
            ),
            False,
        ),
        ("world != tp", {"tp": 2, "pp": 2}, kvc(group(mla())), False),
        ("dcp", {"tp": 2, "dcp": 2, "world": 2}, kvc(group(mla())), False),
    ],
)
def test_canonical_certification(name: str, engine_kw: dict[str, Any], kv: KVCacheConfig, agnostic: bool) -> None:
    config = build_offloading_config(eng(extra=CANONICAL, **engine_kw), kv)
    assert config.canonical_layout
    assert config.parallel.is_parallelism_agnostic is agnostic, name


def test_canonical_mla_page_must_split_per_token() -> None:
    # 3 head slots x 16 states x 3 bytes = 144 bytes, divisible by 16 -> certified; 2 x 16 x 3... use 1 state.
    odd = mla(16, tokens_per_state=16, state_content_bytes=3)
    config = build_offloading_config(eng(extra=CANONICAL), kvc(group(odd)))
    assert not config.parallel.is_parallelism_agnostic
    explanation = explain_offloading_config(eng(extra=CANONICAL), kvc(group(odd)))
    assert "tokens_per_state=16 (needs 1)" in explanation.find("canonical.group[0]").reason


def test_canonical_replicated_layout_is_recomputed() -> None:
    # Certified pure MLA -> replicated even without kv_tp_replicas, and even with 'uni' on one worker.
    assert build_offloading_config(eng(tp=2, extra=CANONICAL), kvc(group(mla()))).replicated_layout
    assert build_offloading_config(eng(tp=1, backend="uni", extra=CANONICAL), kvc(group(mla()))).replicated_layout
    assert not build_offloading_config(eng(tp=2, backend="ray", extra=CANONICAL), kvc(group(mla()))).replicated_layout
    assert not build_offloading_config(eng(tp=2, nnodes=2, extra=CANONICAL), kvc(group(mla()))).replicated_layout
    # Certified, but the offloaded layers are not all plain MLA.
    kv = kvc(group(full(heads=4)), group(swa(heads=4)))
    assert not build_offloading_config(eng(tp=1, extra=CANONICAL), kv).replicated_layout
    # Canonical overrides the direct gate: MLA with replicas but not certified -> not replicated.
    engine_config, mla_kv = _mla_tp(2, extra=CANONICAL)
    bad = msgspec.structs.replace(mla_kv, kv_cache_groups=(group(mla()), group(mamba())))
    assert not build_offloading_config(engine_config, bad).replicated_layout


def test_canonical_layout_is_python_truthiness() -> None:
    for value, expected in ((True, True), ("false", True), (1, True), (0, False), ("", False), (None, False)):
        assert (
            build_offloading_config(eng(extra={"canonical_layout": value}), kvc(group(full()))).canonical_layout
            is expected
        )


# ------------------------------------------------------------------------------------------------------------
# wrapped vs flattened invariance
# ------------------------------------------------------------------------------------------------------------

_layer_spec = st.one_of(
    st.builds(
        lambda bs, h, d, dt: full(bs, h, d, dtype=dt),
        st.sampled_from([16, 32]),
        st.integers(1, 8),
        st.sampled_from([64, 128]),
        st.sampled_from(list(DType)),
    ),
    st.builds(
        lambda bs, d, al: mla(bs, d, alignment=al),
        st.sampled_from([16, 64]),
        st.sampled_from([128, 576]),
        st.sampled_from([None, 4096]),
    ),
)


def _other_spec(kind: str, block: int) -> KVCacheSpec:
    specs: dict[str, KVCacheSpec] = {"full": full(block), "mamba": mamba(block), "swa": swa(block)}
    return specs[kind]


@settings(max_examples=60, deadline=None)
@given(
    layer=_layer_spec,
    layers=st.integers(1, 4),
    others=st.lists(st.sampled_from(["full", "mamba", "swa"]), max_size=2),
    tensors=st.booleans(),
    extra=st.sampled_from([{}, {"blocks_per_chunk": 2}, {"canonical_layout": True}]),
    tp=st.sampled_from([1, 2, 4]),
    use_mla=st.booleans(),
)
def test_wrapped_and_flattened_views_agree(
    layer: FullAttentionSpec,
    layers: int,
    others: list[str],
    tensors: bool,
    extra: dict[str, object],
    tp: int,
    use_mla: bool,
) -> None:
    names = tuple(f"w.{i}" for i in range(layers))
    block = layer.block_size
    wrapper = UniformTypeKVCacheSpecs(block_size=block, kv_cache_specs=dict.fromkeys(names, layer))
    extra_groups = [group(_other_spec(kind, block), f"o.{i}") for i, kind in enumerate(others)]
    tensor = (KVCacheTensor(size=1 << 20, layers=names, layer_stride=0, block_stride=0),) if tensors else ()
    kv = kvc(group(wrapper, *names), *extra_groups, tensors=tensor, kv_tp_replicas=tp)
    engine_config = eng(block_size=block, tp=tp, use_mla=use_mla, total_heads=4 * tp, extra=extra)
    wrapped = _outcome(engine_config, kv)
    flat = _outcome(engine_config, flatten_for_scheduler(kv))
    if not extra_groups and "ok" in wrapped and "ok" in flat:
        # vLLM's documented per-process difference (single wrapped group).
        flat["ok"]["parallel"]["is_parallelism_agnostic"] = wrapped["ok"]["parallel"]["is_parallelism_agnostic"]
    assert wrapped == flat


# ------------------------------------------------------------------------------------------------------------
# explain
# ------------------------------------------------------------------------------------------------------------


def test_explain_names_the_failing_gate_of_a_non_replicated_mla_layout() -> None:
    engine_config = eng(tp=8, use_mla=True, backend="ray")
    kv = kvc(group(mla(64)))  # kv_tp_replicas left at 1
    explanation = explain_offloading_config(engine_config, kv)
    assert isinstance(explanation, Explanation) and explanation.ok
    assert explanation.config == build_offloading_config(engine_config, kv)
    failing = {d.topic for d in explanation.failing("replicated_layout.")}
    assert failing == {"replicated_layout.kv_tp_replicas==tp", "replicated_layout.backend==mp"}
    verdict = explanation.find("replicated_layout")
    assert verdict.value is False and "kv_tp_replicas==tp, backend==mp" in verdict.reason
    assert "kv_tp_replicas=1, tensor_parallel_size=8" in explanation.find("replicated_layout.kv_tp_replicas==tp").reason
    text = explanation.render()
    assert "replicated_layout.backend==mp = False" in text and "distributed_executor_backend='ray'" in text


def test_explain_reports_groups_hash_chunk_and_bytes() -> None:
    kv = kvc(
        group(full(16), "a"),
        group(swa(16), "b", enable_kv_transfer=False),
        group(mamba(16), "m"),
        tensors=(KVCacheTensor(size=4096, layers=("a", "b", "m"), layer_stride=0, block_stride=1024),),
    )
    explanation = explain_offloading_config(eng(extra={"block_size": 64}), kv)
    assert explanation.find("groups").value == (0, 2)
    assert explanation.find("group[1].selected").reason == "enable_kv_transfer is False"
    assert "gcd(16, 16, 16)=16" in explanation.find("tokens_per_hash").reason
    assert explanation.find("blocks_per_chunk").value == 4
    assert "'block_size']=64" in explanation.find("blocks_per_chunk").reason
    assert "kv_cache_tensors[0].size=4096 // num_blocks=4" in explanation.find("worker_kv_bytes_per_block").reason
    assert explanation.find("group[2].sliding_window_size_in_chunks").value == 1
    with pytest.raises(KeyError):
        explanation.find("no-such-topic")


def test_explain_canonical_certification_per_layer() -> None:
    wrapper = wrap(attn=mla(), idx=mla(tokens_per_state=2))
    explanation = explain_offloading_config(eng(tp=2, extra=CANONICAL), kvc(group(wrapper, "attn", "idx")))
    assert explanation.find("canonical.group[0].layer[attn]").value is True
    assert explanation.find("canonical.group[0].layer[idx]").value is False
    assert explanation.find("canonical.is_parallelism_agnostic.all_layers_certified").value is False
    assert explanation.config is not None and not explanation.config.parallel.is_parallelism_agnostic


def test_explain_keeps_the_error_and_the_decisions_before_it() -> None:
    explanation = explain_offloading_config(eng(extra={"block_size": 24}), kvc(group(full(16))))
    assert not explanation.ok and explanation.config is None
    assert isinstance(explanation.error, OffloadingConfigError)
    assert explanation.error_type == "ValueError"
    assert explanation.decisions[-1].topic == "tokens_per_hash"
    assert explanation.render().splitlines()[-1].startswith("error (ValueError): 'block_size'=24")
    bare = explain_offloading_config(eng(transfer=False), kvc(group(full())))
    assert bare.error_type == "AssertionError" and "kv_transfer_config is None" in bare.render()


# ------------------------------------------------------------------------------------------------------------
# snapshots
# ------------------------------------------------------------------------------------------------------------


def _snapshot_dict() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(CASES[0]["input"]))
    return doc


def test_load_snapshot_json_and_toml(tmp_path: Path) -> None:
    import tomllib

    from kvoffload._toml import dumps_toml

    doc = _snapshot_dict()
    json_file = tmp_path / "s.json"
    json_file.write_text(json.dumps(doc))
    toml_file = tmp_path / "s.toml"
    toml_file.write_text(dumps_toml(doc))
    assert tomllib.loads(toml_file.read_text())["engine_config"]["model_config"]["model"] == "google/gemma-3-4b"
    a, b = load_snapshot(json_file), load_snapshot(str(toml_file))
    assert isinstance(a, EngineSnapshot) and a == b
    assert translate_snapshot(a) == translate_snapshot(b)
    sniffed = tmp_path / "snapshot.txt"
    sniffed.write_text(dumps_toml(doc))
    assert load_snapshot(sniffed) == a


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (
            lambda d: d["engine_config"]["cache_config"].update(block_size=0),
            "$.engine_config.cache_config.block_size` (got 0)",
        ),
        (lambda d: d["engine_config"]["model_config"].update(dtype="bf16"), "Invalid enum value 'bf16'"),
        (lambda d: d["engine_config"]["model_config"].update(colour=1), "unknown field `colour`"),
        (
            lambda d: d["kv_cache_config"]["kv_cache_groups"][0]["kv_cache_spec"].update(type="nope"),
            '$.kv_cache_config.kv_cache_groups[0].kv_cache_spec.type` (got "nope")',
        ),
        (
            lambda d: d["kv_cache_config"].update(num_blocks="12"),
            'Expected `int`, got `str` - at `$.kv_cache_config.num_blocks` (got "12")',
        ),
    ],
)
def test_load_snapshot_names_file_field_and_value(tmp_path: Path, mutate: Any, fragment: str) -> None:
    doc = _snapshot_dict()
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as err:
        load_snapshot(path)
    assert str(err.value).startswith(f"{path}: ")
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_load_snapshot_syntax_errors(tmp_path: Path) -> None:
    bad_json = tmp_path / "a.json"
    bad_json.write_text('{"engine_config": ')
    with pytest.raises(ConfigError, match=r"a\.json: invalid JSON"):
        load_snapshot(bad_json)
    bad_toml = tmp_path / "a.toml"
    bad_toml.write_text("engine_config = = 1")
    with pytest.raises(ConfigError, match=r"a\.toml: invalid TOML"):
        load_snapshot(bad_toml)
    with pytest.raises(ConfigError, match="cannot read"):
        load_snapshot(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------------------------
# property: any snapshot that decodes translates or raises a ConfigError
# ------------------------------------------------------------------------------------------------------------

_pos = st.integers(1, 8)
_bs = st.sampled_from([1, 2, 4, 8, 12, 16, 24, 32, 64])
_dtype = st.sampled_from([d.value for d in DType])
_quant = st.sampled_from([m.value for m in KVQuantMode])
_mostly = st.sampled_from([True] * 7 + [False])


def _attention_fields(draw: st.DrawFn) -> dict[str, object]:
    return {
        "block_size": draw(_bs),
        "num_kv_heads": draw(_pos),
        "head_size": draw(st.sampled_from([1, 8, 64, 128, 576])),
        "dtype": draw(_dtype),
        "kv_quant_mode": draw(_quant),
        "dcp_sharded": draw(st.booleans()),
        "tokens_per_state": draw(st.sampled_from([1, 1, 1, 2, 4])),
        "page_size_padded": draw(st.one_of(st.none(), st.integers(1, 1 << 20))),
        "num_head_slots": draw(st.one_of(st.none(), _pos)),
        "state_content_bytes": draw(st.one_of(st.none(), st.integers(1, 4096))),
        "max_tp_shards": draw(st.one_of(st.none(), _pos)),
    }


@st.composite
def _layer_specs(draw: st.DrawFn, block: st.SearchStrategy[int] = _bs) -> dict[str, object]:
    kind = draw(
        st.sampled_from(
            [
                "full_attention",
                "mla_attention",
                "sliding_window",
                "sliding_window_mla",
                "chunked_local_attention",
                "mamba",
            ]
        )
    )
    if kind == "mamba":
        return {
            "type": "mamba",
            "block_size": draw(block),
            "shapes": draw(st.lists(st.lists(st.integers(0, 64), max_size=3), max_size=3)),
            "dtypes": draw(st.lists(_dtype, max_size=3)),
            "page_size_padded": draw(st.one_of(st.none(), st.integers(1, 1 << 16))),
            "mamba_cache_mode": draw(st.sampled_from(["none", "align", "all"])),
            "tokens_per_state": draw(st.sampled_from([-1, 0, 2])),
            "dcp_sharded": draw(st.booleans()),
        }
    spec: dict[str, object] = {"type": kind, **_attention_fields(draw), "block_size": draw(block)}
    if kind in ("mla_attention", "sliding_window_mla"):
        spec["alignment"] = draw(st.one_of(st.none(), st.sampled_from([1, 64, 576, 4096])))
    if kind in ("sliding_window", "sliding_window_mla"):
        spec["sliding_window"] = draw(st.integers(1, 4096))
        spec["extra_retained_tokens"] = draw(st.integers(0, 64))
    if kind == "sliding_window_mla":
        spec["bounded_replay"] = draw(st.booleans())
    if kind == "chunked_local_attention":
        spec["attention_chunk_size"] = draw(st.integers(1, 8192))
    return spec


@st.composite
def _snapshots(draw: st.DrawFn) -> dict[str, object]:
    """Varied engine snapshots, biased towards translatable ones (a connector, one engine block size)."""
    engine_bs = draw(_bs)
    block = st.one_of(st.just(engine_bs), st.just(engine_bs), _bs)
    groups = []
    for g in range(draw(st.sampled_from([0, 1, 1, 1, 2, 2, 3, 4]))):
        names = [f"g{g}.l{i}" for i in range(draw(st.integers(1, 3)))]
        if not draw(_mostly):
            spec: dict[str, object] = {
                "type": "uniform_type",
                "block_size": draw(block),
                "kv_cache_specs": {n: draw(_layer_specs(block)) for n in names[: draw(st.integers(0, len(names)))]},
            }
        else:
            spec = draw(_layer_specs(block))
        groups.append(
            {
                "layer_names": names,
                "kv_cache_spec": spec,
                "enable_kv_transfer": draw(_mostly),
                "role": draw(st.sampled_from(["default", "default", "hisparse_source", "hisparse_indexer"])),
            }
        )
    extra_value = st.one_of(
        st.none(),
        st.integers(-64, 1024),
        st.sampled_from([1, 2, 4, 16, 64, 256]),
        st.floats(-4, 512, allow_nan=False),
        st.text(max_size=4),
        st.booleans(),
        st.lists(st.integers(), max_size=2),
    )
    extra = draw(st.dictionaries(st.sampled_from(["canonical_layout", "cpu_bytes_to_use"]), extra_value))
    chunk_keys = draw(
        st.sampled_from([(), (), ("blocks_per_chunk",), ("block_size",), ("blocks_per_chunk", "block_size")])
    )
    extra |= {key: draw(extra_value) for key in chunk_keys}
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    transfer = None
    if draw(_mostly):
        transfer = {
            "engine_id": "e" if draw(_mostly) else None,
            "kv_connector_extra_config": extra,
        }
    return {
        "engine_config": {
            "model_config": {
                "model": "m",
                "dtype": draw(_dtype),
                "use_mla": draw(st.booleans()),
                "total_num_kv_heads": draw(st.integers(1, 16)),
                "max_model_len": draw(st.integers(0, 1 << 17)),
            },
            "cache_config": {
                "block_size": engine_bs,
                "cache_dtype": draw(st.sampled_from([c.value for c in CacheDType])),
                "enable_prefix_caching": draw(st.booleans()),
                "prefix_match_unit": draw(st.one_of(st.none(), st.none(), _bs)),
            },
            "parallel_config": {
                "tensor_parallel_size": tp,
                "pipeline_parallel_size": draw(st.sampled_from([1, 2])),
                "prefill_context_parallel_size": draw(st.sampled_from([1, 2])),
                "decode_context_parallel_size": draw(st.sampled_from([1, 1, 2, 4])),
                "world_size": draw(st.sampled_from([1, tp, 2 * tp])),
                "distributed_executor_backend": draw(st.sampled_from(["mp", "ray", "uni", None])),
                "nnodes_within_dp": draw(st.sampled_from([1, 2])),
            },
            "kv_transfer_config": transfer,
            "kv_events_config": draw(
                st.one_of(st.none(), st.fixed_dictionaries({"enable_kv_cache_events": st.booleans()}))
            ),
            "use_v2_model_runner": draw(st.booleans()),
        },
        "kv_cache_config": {
            "num_blocks": draw(st.integers(0, 64)),
            "kv_cache_tensors": draw(
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "size": st.integers(0, 1 << 24),
                            "layers": st.just([]),
                            "layer_stride": st.just(0),
                            "block_stride": st.just(0),
                        }
                    ),
                    max_size=2,
                )
            ),
            "kv_cache_groups": groups,
            "hisparse_host_num_blocks": draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 8))),
            "kv_tp_replicas": draw(st.sampled_from([1, tp])),
        },
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_snapshots())
def test_any_decodable_snapshot_translates_or_raises_config_error(doc: dict[str, object]) -> None:
    try:
        snapshot = codecs.decode(json.dumps(doc), EngineSnapshot, format="json")
    except msgspec.ValidationError:
        return  # not a valid snapshot: out of scope here
    views = [snapshot.kv_cache_config]
    try:
        views.append(flatten_for_scheduler(snapshot.kv_cache_config))
    except ConfigError as err:
        assert "no layer specs" in str(err)  # an empty wrapper has no first layer
    for kv in views:
        try:
            result = build_offloading_config(snapshot.engine_config, kv)
        except ConfigError as err:
            assert describe_error(err)  # always something to print
            explanation = explain_offloading_config(snapshot.engine_config, kv)
            assert explanation.error is not None and type(explanation.error) is type(err)
            assert str(explanation.error) == str(err)
            continue
        assert isinstance(result, OffloadingConfig)
        assert result.cache.blocks_per_chunk >= 1 and result.cache.tokens_per_hash >= 1
        assert all(g.tokens_per_block % result.cache.tokens_per_hash == 0 for g in result.groups)
        # The output round-trips through the strict decoder (its constraints hold).
        assert codecs.decode(codecs.encode(result, format="json"), OffloadingConfig, format="json") == result
        assert explain_offloading_config(snapshot.engine_config, kv).config == result


@pytest.mark.parametrize(
    ("kind", "field"), [("sliding_window", "sliding_window"), ("chunked_local_attention", "attention_chunk_size")]
)
@pytest.mark.parametrize("value", [0, -16])
def test_non_positive_window_decodes_and_fails_like_vllms_assert(kind: str, field: str, value: int) -> None:
    # vLLM builds such a spec and only its translator's bare `assert window > 0` rejects it.
    spec = {"type": kind, "block_size": 16, "num_kv_heads": 1, "head_size": 64, "dtype": "float16", field: value}
    doc = {
        "engine_config": {
            "model_config": {"model": "m", "dtype": "float16", "use_mla": False, "total_num_kv_heads": 1},
            "cache_config": {"block_size": 16},
            "parallel_config": {},
            "kv_transfer_config": {"engine_id": "e"},
        },
        "kv_cache_config": {
            "num_blocks": 4,
            "kv_cache_tensors": [],
            "kv_cache_groups": [{"layer_names": ["l0"], "kv_cache_spec": spec}],
        },
    }
    snapshot = msgspec.json.decode(json.dumps(doc), type=EngineSnapshot)
    with pytest.raises(OffloadingConfigError) as info:
        translate_snapshot(snapshot)
    assert str(info.value) == "" and info.value.vllm_exception == "AssertionError"
    assert info.value.__notes__ == [f"{field}={value} must be > 0"]


def _one_group_snapshot(spec: dict[str, object]) -> EngineSnapshot:
    doc = {
        "engine_config": {
            "model_config": {"model": "m", "dtype": "float16", "use_mla": True, "total_num_kv_heads": 1},
            "cache_config": {"block_size": 16},
            "parallel_config": {},
            "kv_transfer_config": {"engine_id": "e", "kv_connector_extra_config": {"blocks_per_chunk": 0}},
        },
        "kv_cache_config": {
            "num_blocks": 4,
            "kv_cache_tensors": [],
            "kv_cache_groups": [{"layer_names": ["l0"], "kv_cache_spec": spec}],
        },
    }
    return msgspec.json.decode(json.dumps(doc), type=EngineSnapshot)


def test_spec_construction_errors_come_first_like_vllm() -> None:
    # vLLM raises these while building the spec objects, before the translator's own checks (here the
    # blocks_per_chunk=0 in the extra config would be next).
    base = {"type": "mla_attention", "block_size": 16, "num_kv_heads": 1, "head_size": 576, "dtype": "bfloat16"}
    with pytest.raises(OffloadingConfigError, match=r"^block_stride_alignment must be positive$") as info:
        translate_snapshot(_one_group_snapshot({**base, "block_stride_alignment": 0}))
    assert info.value.vllm_exception == "ValueError"
    swa = {**base, "type": "sliding_window_mla", "sliding_window": 128, "model_version": "deepseek_v3"}
    with pytest.raises(OffloadingConfigError) as info:
        translate_snapshot(_one_group_snapshot(swa))
    assert str(info.value) == "" and info.value.vllm_exception == "AssertionError"
    with pytest.raises(OffloadingConfigError, match="'blocks_per_chunk' must be greater than 0"):
        translate_snapshot(_one_group_snapshot({**base, "block_stride_alignment": 64}))
