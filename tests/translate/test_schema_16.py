"""Schema 1.6 in the translator: several states per token (vLLM's ``tokens_per_state = Fraction(1, n)``), the
circular buffer (never offloaded) and the hidden-state cache (offloaded like MLA, never plain MLA).

Expectations follow the behavioural reference (vLLM 0.33, sections 1.2-1.8, 2.2 and 3): ``num_states = block_size
// tokens_per_state`` (``16 // Fraction(1, 4) == 64``), only an int ``tokens_per_state > 1`` constrains prefix
boundaries, a non-prefix-cacheable group is skipped but its block size still enters the scheduler block, and
``HiddenStateCacheSpec`` fails every exact-type test (``type(spec) is MLAAttentionSpec``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import (
    CacheConfig,
    CacheDType,
    ConfigError,
    DType,
    EngineConfig,
    EngineSnapshot,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVTransferConfig,
    MLAAttentionSpec,
    ModelConfig,
    OffloadingConfigError,
    ParallelConfig,
    SlidingWindowSpec,
    codecs,
)
from kvoffload._generated import CircularBufferSpec, HiddenStateCacheSpec
from kvoffload.translate import build_offloading_config, explain_offloading_config
from kvoffload.translate._spec_math import num_states, page_size_bytes, prefix_cacheable, real_page_size_bytes

# ------------------------------------------------------------------------------------------------------------
# builders
# ------------------------------------------------------------------------------------------------------------


def full(bs: int = 16, heads: int = 4, head: int = 128, **kw: Any) -> FullAttentionSpec:
    kw.setdefault("dtype", DType.FLOAT16)
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, **kw)


def mla(bs: int = 16, head: int = 576, **kw: Any) -> MLAAttentionSpec:
    kw.setdefault("dtype", DType.BFLOAT16)
    return MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=head, **kw)


def hidden(bs: int = 16, head: int = 576, **kw: Any) -> HiddenStateCacheSpec:
    kw.setdefault("dtype", DType.BFLOAT16)
    return HiddenStateCacheSpec(block_size=bs, num_kv_heads=1, head_size=head, **kw)


def ring(bs: int = 64, **kw: Any) -> CircularBufferSpec:
    kw.setdefault("dtype", DType.FLOAT16)
    return CircularBufferSpec(block_size=bs, num_kv_heads=4, head_size=128, **kw)


def group(spec: KVCacheSpec, *names: str, **kw: Any) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layer_names=names or ("layer.0",), kv_cache_spec=spec, **kw)


def kvc(*groups: KVCacheGroupSpec, num_blocks: int = 4, tensors: tuple[KVCacheTensor, ...] = ()) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def eng(
    *,
    block_size: int = 16,
    extra: Mapping[str, object] | None = None,
    tp: int = 1,
    use_mla: bool = False,
    total_heads: int = 4,
    prefix_caching: bool = True,
) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(
            model="test/model", dtype=DType.BFLOAT16, use_mla=use_mla, total_num_kv_heads=total_heads
        ),
        cache_config=CacheConfig(
            block_size=block_size, cache_dtype=CacheDType.FLOAT16, enable_prefix_caching=prefix_caching
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, world_size=tp, distributed_executor_backend="mp"),
        kv_transfer_config=KVTransferConfig(engine_id="engine-0", kv_connector_extra_config=dict(extra or {})),
    )


# ------------------------------------------------------------------------------------------------------------
# several states per token
# ------------------------------------------------------------------------------------------------------------


def test_states_per_token_defaults_to_one_state_per_token() -> None:
    spec = full()
    assert spec.states_per_token == 1 and spec.tokens_per_state == 1
    old_document = {"type": "full_attention", "block_size": 16, "num_kv_heads": 4, "head_size": 128}
    decoded = msgspec.convert({**old_document, "dtype": "float16"}, KVCacheSpec)  # a 1.5 document decodes
    assert decoded == spec


def test_reference_worked_example_fraction_one_quarter_gives_64_states() -> None:
    # reference 1.3: tokens_per_state=Fraction(1,4), bs=16 -> N=64 states; Full(bs=16, H=4, D=128, fp16) -> C=512
    spec = full(16, states_per_token=4)
    assert num_states(spec) == 64 == 16 // Fraction(1, 4)
    assert real_page_size_bytes(spec) == 4 * 64 * 512 == 4 * real_page_size_bytes(full(16))


def test_the_schema_bound_names_the_field() -> None:
    doc = {"type": "full_attention", "block_size": 16, "num_kv_heads": 4, "head_size": 128, "dtype": "float16"}
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int` >= 1 - at `\$.states_per_token`"):
        msgspec.convert({**doc, "states_per_token": 0}, KVCacheSpec)


def test_compressed_and_split_states_together_are_refused_naming_both() -> None:
    spec = full(16, tokens_per_state=2, states_per_token=4)
    with pytest.raises(ConfigError, match=r"states_per_token=4 with tokens_per_state=2") as info:
        real_page_size_bytes(spec)
    assert not isinstance(info.value, OffloadingConfigError)
    with pytest.raises(ConfigError) as err:
        build_offloading_config(eng(), kvc(group(full()), group(spec)))
    message = str(err.value)
    assert message.startswith("kv_cache_groups[1].kv_cache_spec: full_attention spec has states_per_token=4")
    assert "needs tokens_per_state=1" in message
    explanation = explain_offloading_config(eng(), kvc(group(spec)))
    assert explanation.config is None and isinstance(explanation.error, ConfigError)


def test_a_wrapped_layer_with_both_is_named_by_its_layer() -> None:
    from kvoffload import UniformTypeKVCacheSpecs

    wrapper = UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={"a": full(), "b": full(tokens_per_state=4, states_per_token=2)}
    )
    with pytest.raises(ConfigError, match=r"^kv_cache_groups\[0\]\.kv_cache_spec\.kv_cache_specs\['b'\]: "):
        build_offloading_config(eng(), kvc(group(wrapper, "a", "b")))


def test_worker_bytes_from_pages_scale_with_states_per_token() -> None:
    base = build_offloading_config(eng(), kvc(group(full(), "a", "b")))
    split = build_offloading_config(eng(), kvc(group(full(states_per_token=3), "a", "b")))
    assert base.worker_kv_bytes_per_block == 2 * 32768
    assert split.worker_kv_bytes_per_block == 3 * base.worker_kv_bytes_per_block
    assert msgspec.structs.replace(split, worker_kv_bytes_per_block=0) == msgspec.structs.replace(
        base, worker_kv_bytes_per_block=0
    )


def test_only_whole_token_compression_constrains_prefix_boundaries() -> None:
    # Two groups of 16 and 48 tokens: the scheduler block is 48 and the hash block 16 (gcd). An int
    # tokens_per_state of 5 does not divide 48 (vLLM's ValueError); Fraction(1, 5) is not collected at all.
    compressed = kvc(group(full(16)), group(full(48, tokens_per_state=5)))
    with pytest.raises(OffloadingConfigError, match=r"per-state compression\. Got alignments=\[5\]"):
        build_offloading_config(eng(), compressed)
    split = kvc(group(full(16)), group(full(48, states_per_token=5)))
    config = build_offloading_config(eng(), split)
    assert config.cache.tokens_per_hash == 16
    assert [g.tokens_per_block for g in config.groups] == [16, 48]


def test_canonical_certification_refuses_mla_with_several_states_per_token() -> None:
    extra = {"canonical_layout": True}
    kv = kvc(group(mla(states_per_token=2)))
    explanation = explain_offloading_config(eng(extra=extra, use_mla=True, total_heads=1), kv)
    assert explanation.config is not None and not explanation.config.parallel.is_parallelism_agnostic
    reason = explanation.find("canonical.group[0]").reason
    assert "tokens_per_state=1/2 (needs 1)" in reason
    plain = build_offloading_config(eng(extra=extra, use_mla=True, total_heads=1), kvc(group(mla())))
    assert plain.parallel.is_parallelism_agnostic  # the same spec with one state per token certifies


_SPLIT = st.integers(1, 16)
_BLOCK = st.sampled_from([1, 4, 16, 64, 128])


@given(bs=_BLOCK, n=_SPLIT, heads=st.integers(1, 8), head=st.sampled_from([8, 64, 128, 576]))
def test_states_per_token_is_vllms_fraction(bs: int, n: int, heads: int, head: int) -> None:
    """For every spec kind with heads, ``states_per_token = n`` pages exactly as vLLM's ``Fraction(1, n)``."""
    for spec in (
        full(bs, heads, head, states_per_token=n),
        mla(bs, head, states_per_token=n),
        hidden(bs, head, states_per_token=n),
        ring(bs, states_per_token=n),
        SlidingWindowSpec(
            block_size=bs, num_kv_heads=heads, head_size=head, dtype=DType.FLOAT32, sliding_window=8, states_per_token=n
        ),
    ):
        vllm_states = bs // Fraction(1, n)
        assert num_states(spec) == vllm_states == bs * n
        one = msgspec.structs.replace(spec, states_per_token=1)
        assert real_page_size_bytes(spec) == n * real_page_size_bytes(one)


@given(bs=_BLOCK, n=_SPLIT, layers=st.integers(1, 4), mla_kind=st.booleans())
def test_translation_only_sees_states_per_token_in_page_bytes(bs: int, n: int, layers: int, mla_kind: bool) -> None:
    """States per token change no rule but the page: with tensors the translation is identical, without
    tensors the worker bytes are the layers' pages."""
    names = tuple(f"l{i}" for i in range(layers))
    spec: KVCacheSpec = mla(bs, states_per_token=n) if mla_kind else full(bs, states_per_token=n)
    one = msgspec.structs.replace(spec, states_per_token=1)
    tensors = (KVCacheTensor(size=4 * 4096, layers=list(names), layer_stride=4096 * 4, block_stride=4096),)
    with_tensors = [
        build_offloading_config(eng(block_size=bs), kvc(group(s, *names), tensors=tensors)) for s in (spec, one)
    ]
    assert with_tensors[0] == with_tensors[1]
    config = build_offloading_config(eng(block_size=bs), kvc(group(spec, *names)))
    assert config.worker_kv_bytes_per_block == layers * page_size_bytes(spec)
    assert config.worker_kv_bytes_per_block == n * layers * page_size_bytes(one)


# ------------------------------------------------------------------------------------------------------------
# the circular buffer: never an offloading group
# ------------------------------------------------------------------------------------------------------------


def test_circular_buffer_is_attention_but_not_prefix_cacheable() -> None:
    spec = ring()
    assert spec.dcp_sharded is True and not prefix_cacheable(spec)
    assert real_page_size_bytes(spec) == 4 * 64 * 512


def test_a_circular_buffer_group_is_skipped_with_the_reason() -> None:
    kv = kvc(group(full(), "attn"), group(ring(), "ring"))
    explanation = explain_offloading_config(eng(), kv)
    config = explanation.config
    assert config is not None
    assert [(g.group_id, g.layer_names, g.tokens_per_block) for g in config.groups] == [(0, ("attn",), 16)]
    assert explanation.find("group[1].selected").reason == "its circular_buffer spec is not prefix-cacheable"
    # vLLM: the ring's 64 tokens enter the scheduler block (lcm) but not the hash block (prefix-cacheable only)
    assert config.cache.tokens_per_hash == 16
    assert "scheduler block lcm=64" in explanation.find("tokens_per_hash").reason
    assert not config.parallel.is_parallelism_agnostic  # two groups


def test_only_circular_buffers_means_no_eligible_groups() -> None:
    with pytest.raises(OffloadingConfigError) as err:
        build_offloading_config(eng(block_size=64), kvc(group(ring())))
    assert (str(err.value), err.value.vllm_exception) == ("KV offloading found no eligible cache groups.", "ValueError")


def test_a_circular_buffer_never_constrains_prefix_boundaries_and_is_never_certified() -> None:
    # A prefix-cacheable tokens_per_state=3 would not divide the scheduler block of 16; the ring's is not looked at.
    kv = kvc(group(full(16)), group(ring(16, tokens_per_state=3)))
    config = build_offloading_config(eng(), kv)
    assert [g.group_id for g in config.groups] == [0]
    explanation = explain_offloading_config(eng(extra={"canonical_layout": True}), kv)
    assert explanation.config is not None and not explanation.config.parallel.is_parallelism_agnostic
    assert (
        "circular_buffer is neither full attention nor sliding window" in explanation.find("canonical.group[1]").reason
    )


def test_the_tensors_of_a_ring_still_count_in_the_worker_bytes() -> None:
    tensors = (
        KVCacheTensor(size=4 * (32768 + 131072), layers=["attn", "ring"], layer_stride=32768, block_stride=163840),
    )
    config = build_offloading_config(eng(), kvc(group(full(), "attn"), group(ring(), "ring"), tensors=tensors))
    assert config.worker_kv_bytes_per_block == 32768 + 131072  # the whole backing allocation per block (rule 8)
    no_tensors = build_offloading_config(eng(), kvc(group(full(), "attn"), group(ring(), "ring")))
    assert no_tensors.worker_kv_bytes_per_block == 32768  # the selected groups' pages only


# ------------------------------------------------------------------------------------------------------------
# the hidden-state cache: MLA in every rule but the exact-type tests
# ------------------------------------------------------------------------------------------------------------


def test_hidden_state_cache_is_an_mla_spec_with_mla_pages() -> None:
    spec = hidden(alignment=4096)
    assert isinstance(spec, MLAAttentionSpec) and isinstance(spec, FullAttentionSpec)
    assert spec.head_size_v == 0 and prefix_cacheable(spec)
    assert real_page_size_bytes(spec) == 18432 and page_size_bytes(spec) == 20480  # reference 1.5 example


def test_hidden_state_cache_is_offloaded_as_full_attention() -> None:
    config = build_offloading_config(eng(use_mla=True, total_heads=1), kvc(group(hidden(), "h0", "h1")))
    (only,) = config.groups
    assert (only.group_id, only.layer_names, only.sliding_window_size_in_chunks) == (0, ("h0", "h1"), None)
    assert config.worker_kv_bytes_per_block == 2 * 18432
    assert not config.parallel.is_parallelism_agnostic  # direct gate: MLA family


def test_hidden_state_cache_is_never_certified_nor_canonically_replicated() -> None:
    engine = eng(extra={"canonical_layout": True}, use_mla=True, total_heads=1, tp=2)
    kv = kvc(group(hidden()))
    explanation = explain_offloading_config(engine, kv)
    assert explanation.config is not None
    assert not explanation.config.parallel.is_parallelism_agnostic and not explanation.config.replicated_layout
    assert "never certified" in explanation.find("canonical.group[0]").reason
    mla_config = build_offloading_config(engine, kvc(group(mla())))
    assert mla_config.parallel.is_parallelism_agnostic and mla_config.replicated_layout


@given(
    bs=_BLOCK,
    layers=st.integers(1, 3),
    alignment=st.sampled_from([None, 64, 4096]),
    tp=st.sampled_from([1, 2, 4]),
    replicas=st.booleans(),
    tensors=st.booleans(),
)
def test_hidden_state_translates_exactly_as_mla_without_canonical_pages(
    bs: int, layers: int, alignment: int | None, tp: int, replicas: bool, tensors: bool
) -> None:
    """vLLM tests the hidden-state cache's type only in the canonical gates: everything else is MLA's answer."""
    names = tuple(f"l{i}" for i in range(layers))
    placed = (KVCacheTensor(size=8 * 4096, layers=list(names), layer_stride=4096, block_stride=4096 * 4),)
    answers = []
    for spec in (hidden(bs, alignment=alignment), mla(bs, alignment=alignment)):
        kv = KVCacheConfig(
            num_blocks=8,
            kv_cache_tensors=placed if tensors else (),
            kv_cache_groups=(group(spec, *names),),
            kv_tp_replicas=tp if replicas else 1,
        )
        answers.append(build_offloading_config(eng(block_size=bs, use_mla=True, total_heads=1, tp=tp), kv))
    assert answers[0] == answers[1]


# ------------------------------------------------------------------------------------------------------------
# snapshots
# ------------------------------------------------------------------------------------------------------------


def test_snapshot_documents_of_the_new_kinds_round_trip() -> None:
    specs = [
        {"type": "circular_buffer", "block_size": 64, "num_kv_heads": 4, "head_size": 128, "dtype": "float16"},
        {"type": "hidden_state_cache", "block_size": 16, "num_kv_heads": 1, "head_size": 576, "dtype": "bfloat16"},
        {
            "type": "full_attention",
            "block_size": 16,
            "num_kv_heads": 4,
            "head_size": 128,
            "dtype": "float16",
            "states_per_token": 4,
        },
    ]
    snapshot = {
        "engine_config": json.loads(codecs.encode(eng(), format="json")),
        "kv_cache_config": {
            "num_blocks": 4,
            "kv_cache_tensors": [],
            "kv_cache_groups": [{"layer_names": [f"l{i}"], "kv_cache_spec": s} for i, s in enumerate(specs)],
        },
    }
    decoded = codecs.decode(json.dumps(snapshot), EngineSnapshot, format="json")
    kinds = [type(g.kv_cache_spec) for g in decoded.kv_cache_config.kv_cache_groups]
    assert kinds == [CircularBufferSpec, HiddenStateCacheSpec, FullAttentionSpec]
    assert codecs.decode(codecs.encode(decoded), EngineSnapshot) == decoded
    config = build_offloading_config(decoded.engine_config, decoded.kv_cache_config)
    assert [g.group_id for g in config.groups] == [1, 2]


_GROUP_SPECS = st.one_of(
    st.builds(full, st.sampled_from([16, 32, 64]), st.integers(1, 4)),
    st.builds(mla, st.sampled_from([16, 32, 64])),
    st.builds(hidden, st.sampled_from([16, 32, 64])),
    st.builds(
        lambda bs, w: SlidingWindowSpec(
            block_size=bs, num_kv_heads=2, head_size=64, dtype=DType.FLOAT16, sliding_window=w
        ),
        st.sampled_from([16, 32, 64]),
        st.integers(1, 512),
    ),
)


@given(
    specs=st.lists(_GROUP_SPECS, min_size=2, max_size=4),
    ring_block=st.sampled_from([16, 48, 64, 96, 128]),
    ring_tps=st.sampled_from([1, 3]),
    tensors=st.booleans(),
)
def test_a_circular_buffer_group_changes_nothing_of_a_multi_group_plan(
    specs: list[KVCacheSpec], ring_block: int, ring_tps: int, tensors: bool
) -> None:
    """With two or more groups already, a ring group after them is skipped and alters no rule's answer: its block
    size only widens the scheduler block (the LCM), which keeps every prefix alignment that held."""
    groups = [group(s, f"g{i}") for i, s in enumerate(specs)]
    placed = (KVCacheTensor(size=4 * 65536, layers=["g0"], layer_stride=0, block_stride=65536),) if tensors else ()
    without = kvc(*groups, tensors=placed)
    with_ring = kvc(*groups, group(ring(ring_block, tokens_per_state=ring_tps), "ring"), tensors=placed)
    try:
        expected = build_offloading_config(eng(), without)
    except OffloadingConfigError as err:
        with pytest.raises(OffloadingConfigError) as again:
            build_offloading_config(eng(), with_ring)
        assert str(again.value) == str(err)
        return
    assert build_offloading_config(eng(), with_ring) == expected
