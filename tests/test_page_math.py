"""Page-size formulas, spec helpers, group selection and block-size resolution as vLLM 0.33 computes them, with
worked examples from vLLM's specs and every branch and error text of ``resolve_kv_cache_block_sizes``."""

from __future__ import annotations

import pytest

from kvoffload import (
    CacheConfig,
    ChunkedLocalAttentionSpec,
    ConfigError,
    DType,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVQuantMode,
    KVTransferConfig,
    MambaSpec,
    MLAAttentionSpec,
    ModelConfig,
    OffloadingConfigError,
    ParallelConfig,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    _ints,
)
from kvoffload.translate import _rules as R
from kvoffload.translate import _spec_math as L
from kvoffload.translate._translate import offloading_group_ids
from tests.helpers import flatten_for_scheduler

# ------------------------------------------------------------------------------------------------------------
# builders
# ------------------------------------------------------------------------------------------------------------


def full(
    bs: int = 16, heads: int = 4, head: int = 128, dtype: DType = DType.FLOAT16, **kw: object
) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype=dtype, **kw)  # type: ignore[arg-type]


def mla(bs: int = 16, head: int = 576, dtype: DType = DType.BFLOAT16, **kw: object) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=head, dtype=dtype, **kw)  # type: ignore[arg-type]


def swa(bs: int = 16, window: int = 128, **kw: object) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs,
        num_kv_heads=2,
        head_size=64,
        dtype=DType.BFLOAT16,
        sliding_window=window,
        **kw,  # type: ignore[arg-type]
    )


def mamba(bs: int = 16, mode: str = "align", **kw: object) -> MambaSpec:
    return MambaSpec(
        block_size=bs,
        shapes=((16, 1),),
        dtypes=(DType.FLOAT32,),
        mamba_cache_mode=mode,
        **kw,  # type: ignore[arg-type]
    )


def group(spec: KVCacheSpec, *names: str, **kw: object) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layer_names=names or ("l0",), kv_cache_spec=spec, **kw)  # type: ignore[arg-type]


def kv(*groups: KVCacheGroupSpec, **kw: object) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=(), kv_cache_groups=groups, **kw)  # type: ignore[arg-type]


def engine(
    block_size: int = 16,
    *,
    dcp: int = 1,
    prefix_caching: bool = True,
    connector: bool = True,
    pmu: int | None = None,
) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(model="m", dtype=DType.BFLOAT16, use_mla=False, total_num_kv_heads=4),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching, prefix_match_unit=pmu),
        parallel_config=ParallelConfig(decode_context_parallel_size=dcp),
        kv_transfer_config=KVTransferConfig(engine_id="e") if connector else None,
    )


# ------------------------------------------------------------------------------------------------------------
# dtypes and quantization modes
# ------------------------------------------------------------------------------------------------------------


def test_dtype_table_covers_every_dtype() -> None:
    assert set(L.DTYPE_SIZES) == set(DType)
    expected = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
    expected |= {"uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8}
    assert {d.value: L.dtype_size(d) for d in DType} == expected


def test_quant_mode_predicates() -> None:
    per_token = {m for m in KVQuantMode if L.is_per_token_head(m)}
    assert per_token == {
        KVQuantMode.INT8_PER_TOKEN_HEAD,
        KVQuantMode.FP8_PER_TOKEN_HEAD,
        KVQuantMode.INT4_PER_TOKEN_HEAD,
    }


# ------------------------------------------------------------------------------------------------------------
# page sizes (worked examples)
# ------------------------------------------------------------------------------------------------------------


def test_full_attention_worked_examples() -> None:
    spec = full(16, 4, 128, DType.FLOAT16)
    assert L.state_content_size_bytes(spec) == 512
    assert L.num_states(spec) == 16
    assert L.page_size_bytes(spec) == 32768 == L.real_page_size_bytes(spec)
    assert L.page_size_bytes(full(16, 1, 1, DType.FLOAT32)) == 128
    assert L.page_size_bytes(full(16, 4, 128, DType.FLOAT32)) == 65536


def test_attention_overrides() -> None:
    assert L.num_heads(full(heads=4, num_head_slots=6)) == 6
    assert L.page_size_bytes(full(heads=4, num_head_slots=6)) == 6 * 16 * 512
    assert L.state_content_size_bytes(full(state_content_bytes=100)) == 100
    assert L.page_size_bytes(full(16, 2, 128, DType.FLOAT16, head_size_v=64)) == 2 * 16 * (128 + 64) * 2
    assert L.head_size_v(full(head=96)) == 96
    spec = full(16, 1, 128, DType.FLOAT16, tokens_per_state=4)
    assert L.num_states(spec) == 4
    assert L.page_size_bytes(spec) == 4 * 512


def test_page_size_padded() -> None:
    assert L.page_size_bytes(full(16, 4, 128, DType.FLOAT16, page_size_padded=40000)) == 40000
    assert L.real_page_size_bytes(full(16, 4, 128, DType.FLOAT16, page_size_padded=40000)) == 32768
    with pytest.raises(ConfigError, match=r"page_size_padded=1000 smaller than its unpadded page \(32768 bytes\)"):
        L.page_size_bytes(full(16, 4, 128, DType.FLOAT16, page_size_padded=1000))


def test_mla_worked_examples_and_alignment() -> None:
    assert L.page_size_bytes(mla(16, 576, DType.BFLOAT16)) == 18432
    assert L.page_size_bytes(mla(16, 512, DType.FLOAT32)) == 32768
    assert L.page_size_bytes(mla(16, 576, alignment=4096)) == 20480
    assert L.real_page_size_bytes(mla(16, 576, alignment=4096)) == 18432
    # Non-trivial alignment padding overrides an explicit page_size_padded ...
    assert L.page_size_bytes(mla(16, 576, alignment=4096, page_size_padded=50000)) == 20480
    # ... while a trivial one (already aligned) keeps it.
    assert L.page_size_bytes(mla(16, 576, alignment=1024, page_size_padded=50000)) == 50000
    assert L.page_size_padded(mla(16, 576, alignment=1024)) is None


def test_swa_mla_alignment() -> None:
    spec = SlidingWindowMLASpec(
        block_size=64, num_kv_heads=1, head_size=656, dtype=DType.FLOAT32, sliding_window=512, alignment=576
    )
    assert L.real_page_size_bytes(spec) == 64 * 656 * 4
    assert L.page_size_bytes(spec) == 168192


def test_mamba_pages() -> None:
    assert L.page_size_bytes(mamba()) == 64
    assert L.state_content_size_bytes(mamba()) == 64
    assert L.num_states(mamba()) == 1
    spec = MambaSpec(block_size=16, shapes=((2, 3), (4,), ()), dtypes=(DType.BFLOAT16, DType.INT8, DType.INT64))
    assert L.page_size_bytes(spec) == 12 + 4 + 8
    assert L.page_size_bytes(mamba(page_size_padded=128)) == 128
    assert L.real_page_size_bytes(mamba(page_size_padded=128)) == 64
    with pytest.raises(ConfigError, match="page_size_padded=32"):
        L.page_size_bytes(mamba(page_size_padded=32))
    # Like vLLM's zip(), extra shapes without a dtype are ignored.
    assert L.page_size_bytes(MambaSpec(block_size=16, shapes=((4,), (8,)), dtypes=(DType.FLOAT32,))) == 16
    assert L.num_heads(MambaSpec(block_size=16, shapes=(), dtypes=(), num_heads=3)) == 3


def test_uniform_type_sums_layer_pages() -> None:
    wrapper = UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={"a": mla(16, 576, alignment=4096), "b": mla(16, 128)}
    )
    assert L.page_size_bytes(wrapper) == 20480 + 4096
    assert L.real_page_size_bytes(wrapper) == 18432 + 4096
    assert L.iter_layer_specs(wrapper) == (mla(16, 576, alignment=4096), mla(16, 128))
    assert L.iter_layer_specs(full()) == (full(),)
    assert L.first_layer_spec(wrapper) == mla(16, 576, alignment=4096)
    with pytest.raises(ConfigError, match="no layer specs"):
        L.first_layer_spec(UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={}))


def test_spec_flags() -> None:
    assert L.dcp_sharded(full()) and not L.dcp_sharded(mamba())
    assert not L.dcp_sharded(full(dcp_sharded=False))
    wrapper_of_mamba = UniformTypeKVCacheSpecs(block_size=16, dcp_sharded=True, kv_cache_specs={"m": mamba()})
    assert not L.dcp_sharded(wrapper_of_mamba)  # post-init copies the first layer's flag
    assert L.dcp_sharded(UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full()}))
    assert L.dcp_sharded(UniformTypeKVCacheSpecs(block_size=16, dcp_sharded=True, kv_cache_specs={}))
    bounded = SlidingWindowMLASpec(
        block_size=16,
        num_kv_heads=1,
        head_size=512,
        dtype=DType.BFLOAT16,
        sliding_window=64,
        bounded_replay=True,
    )
    assert not L.prefix_cacheable(bounded)
    assert L.prefix_cacheable(msgspec_replace(bounded, bounded_replay=False))
    assert L.prefix_cacheable(full()) and L.prefix_cacheable(mamba()) and L.prefix_cacheable(swa())
    assert not L.prefix_cacheable(UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full(), "b": bounded}))
    assert L.spec_kind(bounded) == "sliding_window_mla"


def msgspec_replace(spec: SlidingWindowMLASpec, **kw: object) -> SlidingWindowMLASpec:
    import msgspec

    return msgspec.structs.replace(spec, **kw)


def test_math_helpers() -> None:
    assert _ints.cdiv(7, 2) == 4 and _ints.cdiv(8, 2) == 4 and _ints.cdiv(0, 5) == 0
    assert _ints.round_up(24, 16) == 32 and _ints.round_up(32, 16) == 32
    assert _ints.round_up(-24, 16) == -16


# ------------------------------------------------------------------------------------------------------------
# groups
# ------------------------------------------------------------------------------------------------------------


def test_offloading_group_selection() -> None:
    bounded = SlidingWindowMLASpec(
        block_size=16,
        num_kv_heads=1,
        head_size=512,
        dtype=DType.BFLOAT16,
        sliding_window=64,
        bounded_replay=True,
    )
    config = kv(group(full()), group(full(), enable_kv_transfer=False), group(bounded), group(mamba()))
    notes: list[tuple[str, object, str]] = []
    assert offloading_group_ids(config, lambda t, v, r: notes.append((t, v, r))) == (0, 3)
    assert ("group[1].selected", False, "enable_kv_transfer is False") in notes
    assert any(t == "group[2].selected" and "bounded_replay" in r for t, _, r in notes)

    hisparse = kv(
        group(mla(), "src", role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
        group(mla(head=128), "indexer", role=KVCacheGroupRole.HISPARSE_INDEXER, enable_kv_transfer=False),
        hisparse_host_num_blocks=4,
    )
    assert offloading_group_ids(hisparse) == (1,)


def test_group_bytes_in_both_views() -> None:
    layers: dict[str, KVCacheSpec] = {"a": mla(16, 576), "b": mla(16, 576)}
    wrapped = group(UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=layers), "a", "b")
    assert L.group_kv_bytes_per_block(wrapped) == 2 * 18432
    config = kv(wrapped, group(mamba(), "m0", "m1"))
    flat = flatten_for_scheduler(config)
    assert flat.kv_cache_groups[0].kv_cache_spec == mla(16, 576)
    assert flat.kv_cache_groups[1] == config.kv_cache_groups[1]
    assert L.group_kv_bytes_per_block(flat.kv_cache_groups[0]) == L.group_kv_bytes_per_block(wrapped)
    assert L.group_kv_bytes_per_block(config.kv_cache_groups[1]) == 2 * 64
    plain = kv(group(full()))
    assert flatten_for_scheduler(plain) is plain


# ------------------------------------------------------------------------------------------------------------
# block sizes
# ------------------------------------------------------------------------------------------------------------


def test_resolve_dcp_kv_block_size() -> None:
    assert L.resolve_dcp_kv_block_size(full(16), 4) == 64
    assert L.resolve_dcp_kv_block_size(mla(16), 2) == 32
    assert L.resolve_dcp_kv_block_size(mamba(16), 4) == 16
    assert L.resolve_dcp_kv_block_size(full(16, dcp_sharded=False), 4) == 16
    wrapper = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": mla(16), "i": mla(16, 128)})
    assert L.resolve_dcp_kv_block_size(wrapper, 2) == 32
    mamba_wrapper = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"m": mamba(16)})
    assert L.resolve_dcp_kv_block_size(mamba_wrapper, 2) == 16


def test_single_group_uses_engine_block_size_not_the_spec() -> None:
    assert R.resolve_kv_cache_block_sizes(kv(group(full(64))), engine(16)) == (16, 16)
    assert R.resolve_kv_cache_block_sizes(kv(group(full(16))), engine(16, dcp=4)) == (64, 64)
    # dcp falls back to 1 when the single group is not DCP-sharded ...
    assert R.resolve_kv_cache_block_sizes(kv(group(mamba(16))), engine(16, dcp=4)) == (16, 16)
    # ... but not with zero groups.
    assert R.resolve_kv_cache_block_sizes(kv(), engine(16, dcp=4)) == (64, 64)


def test_single_group_prefix_match_unit() -> None:
    assert R.resolve_kv_cache_block_sizes(kv(group(full())), engine(16, pmu=16)) == (16, 16)
    with pytest.raises(OffloadingConfigError) as err:
        R.resolve_kv_cache_block_sizes(kv(group(full(64))), engine(64, pmu=8))
    assert str(err.value) == (
        "Invalid prefix_match_unit=8; with a single KV cache group, prefix-cache hits land on the block size "
        "(64). Unset it or set it to 64."
    )
    assert err.value.vllm_exception == "ValueError"
    # The DCP-scaled size is the one that counts.
    assert R.resolve_kv_cache_block_sizes(kv(group(full(16))), engine(16, dcp=2, pmu=32)) == (32, 32)
    # Without prefix caching and without a connector the knob is ignored; zero groups never check it.
    assert R.resolve_kv_cache_block_sizes(
        kv(group(full())), engine(16, pmu=8, prefix_caching=False, connector=False)
    ) == (16, 16)
    with pytest.raises(OffloadingConfigError):
        R.resolve_kv_cache_block_sizes(kv(group(full())), engine(16, pmu=8, prefix_caching=False))
    assert R.resolve_kv_cache_block_sizes(kv(), engine(16, pmu=8)) == (16, 16)


def test_multi_group_lcm_and_gcd() -> None:
    config = kv(group(full(16)), group(full(32)))
    assert R.resolve_kv_cache_block_sizes(config, engine()) == (32, 16)
    assert R.resolve_kv_cache_block_sizes(config, engine(pmu=8)) == (32, 8)
    assert R.resolve_kv_cache_block_sizes(kv(group(full(12)), group(mla(16))), engine(4)) == (48, 4)
    # DCP scales attention groups, not Mamba.
    assert R.resolve_kv_cache_block_sizes(kv(group(full(16)), group(mamba(16))), engine(dcp=2)) == (32, 16)


def test_multi_group_without_hashing_consumers_uses_lcm() -> None:
    config = kv(group(full(16)), group(full(32)))
    assert R.resolve_kv_cache_block_sizes(config, engine(prefix_caching=False, connector=False)) == (32, 32)
    assert R.resolve_kv_cache_block_sizes(config, engine(prefix_caching=False, connector=True)) == (32, 16)
    assert R.resolve_kv_cache_block_sizes(config, engine(prefix_caching=True, connector=False)) == (32, 16)


def test_multi_group_mamba_outside_align_mode_falls_back() -> None:
    config = kv(group(full(16)), group(mamba(24, "none")))
    assert R.resolve_kv_cache_block_sizes(config, engine()) == (48, 48)
    wrapped = kv(group(full(16)), group(UniformTypeKVCacheSpecs(block_size=24, kv_cache_specs={"m": mamba(24, "all")})))
    assert R.resolve_kv_cache_block_sizes(wrapped, engine()) == (48, 48)
    assert R.resolve_kv_cache_block_sizes(kv(group(full(16)), group(mamba(32))), engine()) == (32, 16)


def test_multi_group_prefix_match_unit_must_divide_prefix_cacheable_sizes() -> None:
    with pytest.raises(OffloadingConfigError) as err:
        R.resolve_kv_cache_block_sizes(kv(group(full(16)), group(full(24))), engine(pmu=16))
    assert str(err.value) == (
        "Invalid prefix_match_unit=16; prefix-cacheable KV cache group block sizes must be divisible by "
        "prefix_match_unit. Got group block sizes=[16, 24], prefix-cacheable=[16, 24]."
    )
    assert err.value.vllm_exception == "ValueError"


def test_only_prefix_cacheable_groups_set_the_hash() -> None:
    bounded = SlidingWindowMLASpec(
        block_size=8,
        num_kv_heads=1,
        head_size=512,
        dtype=DType.BFLOAT16,
        sliding_window=64,
        bounded_replay=True,
    )
    config = kv(group(mla(32)), group(bounded))
    assert R.resolve_kv_cache_block_sizes(config, engine()) == (32, 32)
    with pytest.raises(OffloadingConfigError, match=r"Got group block sizes=\[32, 8\], prefix-cacheable=\[32\]"):
        R.resolve_kv_cache_block_sizes(config, engine(pmu=64))
    # When no group is prefix-cacheable, every size counts.
    only_bounded = kv(group(bounded), group(msgspec_replace(bounded, block_size=12)))
    assert R.resolve_kv_cache_block_sizes(only_bounded, engine()) == (24, 4)


def test_per_state_compression_must_align_with_hits() -> None:
    compressed = full(16, tokens_per_state=3)
    with pytest.raises(OffloadingConfigError) as err:
        R.resolve_kv_cache_block_sizes(kv(group(compressed), group(full(32))), engine())
    assert str(err.value) == (
        "Invalid prefix_match_unit=16; prefix-cache boundaries must align with each spec's per-state "
        "compression. Got alignments=[3]."
    )
    # Aligned compression at the scheduler block (lcm 64) is fine.
    ok = kv(group(full(16)), group(full(64, tokens_per_state=32)))
    assert R.resolve_kv_cache_block_sizes(ok, engine()) == (64, 16)


def test_partial_mamba_hits_align_to_the_hash_block() -> None:
    compressed = full(64, tokens_per_state=32)
    partial = kv(group(full(16)), group(mamba(64)), group(compressed))
    assert R.partial_hash_hits_enabled(partial.kv_cache_groups, 16, 1)
    with pytest.raises(OffloadingConfigError, match=r"Got alignments=\[32\]"):
        R.resolve_kv_cache_block_sizes(partial, engine())
    whole = kv(group(full(16)), group(mamba(16)), group(compressed))
    assert not R.partial_hash_hits_enabled(whole.kv_cache_groups, 16, 1)
    assert R.resolve_kv_cache_block_sizes(whole, engine()) == (64, 16)
    # With DCP, a Mamba block equal to the hash block already enables partial hits.
    dcp_groups = kv(group(full(16)), group(mamba(16))).kv_cache_groups
    assert R.partial_hash_hits_enabled(dcp_groups, 16, 2)
    assert not R.partial_hash_hits_enabled(dcp_groups, 16, 1)


def test_resolution_records_its_reason() -> None:
    notes: list[tuple[str, object, str]] = []
    R.resolve_kv_cache_block_sizes(
        kv(group(full(16)), group(full(32))), engine(), lambda t, v, r: notes.append((t, v, r))
    )
    assert notes == [("tokens_per_hash", 16, notes[0][2])]
    assert "gcd(16, 32)=16" in notes[0][2]


# ------------------------------------------------------------------------------------------------------------
# windows in chunks
# ------------------------------------------------------------------------------------------------------------


def test_sliding_window_size_in_chunks() -> None:
    assert R.sliding_window_size_in_chunks(swa(window=128), 64) == 2
    assert R.sliding_window_size_in_chunks(swa(window=129), 64) == 3
    assert R.sliding_window_size_in_chunks(swa(window=128, extra_retained_tokens=2), 64) == 3
    assert R.sliding_window_size_in_chunks(swa(window=1), 16) == 1
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=DType.BFLOAT16, attention_chunk_size=8192
    )
    assert R.sliding_window_size_in_chunks(chunked, 256) == 32
    assert R.sliding_window_size_in_chunks(mamba(), 16) == 1
    assert R.sliding_window_size_in_chunks(full(), 16) is None
    assert R.sliding_window_size_in_chunks(mla(), 16) is None
    assert R.sliding_window_size_in_chunks(full(sliding_window=128), 16) is None
    wrapper = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"s": swa(window=100), "f": full()})
    assert R.sliding_window_size_in_chunks(wrapper, 32) == 4


def test_sliding_window_guards() -> None:
    with pytest.raises(OffloadingConfigError) as err:
        R.sliding_window_size_in_chunks(swa(), 0)
    assert err.value.vllm_exception == "ZeroDivisionError"
    assert "at least one token" in str(err.value)
    assert R.sliding_window_size_in_chunks(full(), 0) is None  # no division for full attention
    # A window the schema would reject (built in code): vLLM's bare assert, empty message plus a note.
    zero = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=DType.INT8, sliding_window=0)
    with pytest.raises(OffloadingConfigError) as err:
        R.sliding_window_size_in_chunks(zero, 16)
    assert str(err.value) == "" and err.value.vllm_exception == "AssertionError"
    assert err.value.__notes__ == ["sliding_window=0 must be > 0"]
    nested = UniformTypeKVCacheSpecs(
        block_size=16,
        kv_cache_specs={"x": UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"y": full()})},
    )
    with pytest.raises(OffloadingConfigError) as err:
        R.sliding_window_size_in_chunks(nested, 16)
    assert err.value.vllm_exception == "AssertionError"
