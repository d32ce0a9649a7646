"""Every generated type round-trips through msgpack and JSON; engine snapshots decode strictly."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvoffload
from codegen import Schema, load_schema
from codegen.loader import Field
from codegen.typeref import TypeRef
from kvoffload import ArgumentTypeError, ConfigError, codecs
from kvoffload._generated import types as gen
from kvoffload._packed import Int32Array, Int64Array, pack_int32, pack_int64

ROOT = Path(__file__).resolve().parent.parent
SCHEMA: Schema = load_schema(ROOT / "schema" / "kvoffload.toml")
INT64 = (-(2**63), 2**63 - 1)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(*INT64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _bounds(f: Field | None) -> dict[str, int | float]:
    return dict(f.constraints) if f is not None else {}


def strategy(tref: TypeRef, f: Field | None = None) -> st.SearchStrategy[object]:
    """A strategy producing valid values of a schema type, honouring the field's constraints."""
    bounds = _bounds(f)
    if tref.kind == "optional":
        return st.none() | strategy(tref.inner, f)
    if tref.kind == "primitive":
        if tref.name == "bool":
            return st.booleans()
        if tref.name == "int":
            lo = int(bounds.get("ge", bounds.get("gt", INT64[0] - 1) + 1))
            hi = int(bounds.get("le", bounds.get("lt", INT64[1] + 1) - 1))
            return st.integers(lo, hi)
        if tref.name == "float":
            return st.floats(
                min_value=bounds.get("ge", bounds.get("gt")),
                max_value=bounds.get("le", bounds.get("lt")),
                exclude_min="gt" in bounds,
                exclude_max="lt" in bounds,
                allow_nan=False,
                allow_infinity=False,
            )
        if tref.name == "str":
            shortest = int(bounds.get("min_length", 0))
            return st.text(min_size=shortest, max_size=max(12, shortest))
        if tref.name == "bytes":
            return st.binary(max_size=40)
        return json_values
    if tref.kind == "list":
        return st.lists(strategy(tref.inner), max_size=3).map(tuple)
    if tref.kind == "map":
        return st.dictionaries(st.text(max_size=8), strategy(tref.inner), max_size=3)
    if tref.kind == "array":
        if tref.name == "int32":
            return st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20).map(pack_int32)
        return st.lists(st.integers(*INT64), max_size=20).map(pack_int64)
    return named(tref.name)


@cache
def named(name: str) -> st.SearchStrategy[object]:
    if name in SCHEMA.enums:
        return st.sampled_from(list(getattr(gen, name)))
    if name in SCHEMA.unions:
        return st.deferred(lambda: st.one_of([named(m) for m in SCHEMA.unions[name].members]))
    struct = SCHEMA.structs[name]
    cls = getattr(gen, name)
    fields = {f.name: strategy(f.type, f) for f in struct.live_fields}
    return st.deferred(lambda: st.builds(cls, **fields))


CONCRETE = [s.name for s in SCHEMA.structs.values() if not s.abstract]


def test_every_schema_type_is_generated() -> None:
    for name in [*SCHEMA.enums, *SCHEMA.structs, *SCHEMA.unions]:
        assert hasattr(gen, name), name
    assert SCHEMA.version == gen.SCHEMA_VERSION
    assert SCHEMA.fingerprint == gen.SCHEMA_FINGERPRINT


@pytest.mark.parametrize("name", CONCRETE)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip(name: str, data: st.DataObject) -> None:
    cls = getattr(gen, name)
    value = data.draw(named(name))
    packed = codecs.encode(value)
    assert msgspec.msgpack.decode(packed, type=cls) == value
    text = codecs.encode(value, format="json")
    assert msgspec.json.decode(text, type=cls) == value


ROOTS = [s.name for s in SCHEMA.structs.values() if (s.root or s.message_id is not None) and not s.abstract]


@pytest.mark.parametrize("name", ROOTS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_codec_verbs_round_trip_every_top_level_type(name: str, data: st.DataObject) -> None:
    cls = getattr(gen, name)
    value = data.draw(named(name))
    packed = codecs.encode(value)
    assert packed == codecs.encode(value, format="msgpack") == msgspec.msgpack.encode(value)
    assert codecs.decode(packed, cls) == value
    assert codecs.decode(memoryview(packed), type=cls, format="msgpack") == value
    text = codecs.encode(value, format="json")
    assert text == msgspec.json.encode(value)
    assert codecs.decode(text, cls, format="json") == value
    assert codecs.decode(text.decode(), cls, format="json") == value
    buffer = bytearray(b"head")
    codecs.encode_into(value, buffer, 4)
    assert buffer[:4] == b"head" and bytes(buffer[4:]) == packed
    if (message_id := SCHEMA.structs[name].message_id) is not None:
        assert codecs.MESSAGE_DECODERS[message_id](packed) == value


def test_codec_verbs_name_an_unknown_type_or_format() -> None:
    plan = gen.StepPlan(step=1, load_jobs=(), store_jobs=())
    with pytest.raises(ArgumentTypeError, match=r"type=TransferJob is not a top-level type .*'StepPlan'"):
        codecs.decode(b"", gen.TransferJob)  # type: ignore[type-var]  # a nested struct: decode it through its top-level type
    with pytest.raises(ArgumentTypeError, match="type=TransferJob"):
        codecs.decode(b"{}", gen.TransferJob, format="json")  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match=r"format must be one of \['msgpack', 'json'\], got 'yaml'"):
        codecs.encode(plan, format="yaml")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="got 'yaml'"):
        codecs.encode_into(plan, bytearray(), format="yaml")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="got 'yaml'"):
        codecs.decode(codecs.encode(plan), gen.StepPlan, format="yaml")  # type: ignore[call-overload]


def test_enum_alias_and_values() -> None:
    assert kvoffload.KVQuantMode.CUSTOM is kvoffload.KVQuantMode.OCTAVE_K3V4
    assert len(list(kvoffload.KVQuantMode)) == 15
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'custom'"):
        msgspec.json.decode(b'"custom"', type=kvoffload.KVQuantMode)


def test_spec_defaults_follow_vllm() -> None:
    full = kvoffload.FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=kvoffload.DType.FLOAT16)
    assert full.dcp_sharded is True and full.head_size_v is None and full.tokens_per_state == 1
    mla = kvoffload.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=kvoffload.DType.BFLOAT16)
    assert mla.head_size_v == 0 and isinstance(mla, kvoffload.FullAttentionSpec)
    swa_mla = kvoffload.SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=kvoffload.DType.BFLOAT16, sliding_window=128
    )
    assert swa_mla.head_size_v == 0 and isinstance(swa_mla, kvoffload.SlidingWindowSpec)
    mamba = kvoffload.MambaSpec(block_size=16, shapes=((16, 1),), dtypes=(kvoffload.DType.FLOAT32,))
    assert mamba.dcp_sharded is False and mamba.tokens_per_state == -1


def test_shared_samples_decode_and_reencode_losslessly(translate_cases: list[dict[str, object]]) -> None:
    assert len(translate_cases) == 37
    for case in translate_cases:
        raw = json.dumps(case["input"]).encode()
        snapshot = msgspec.json.decode(raw, type=kvoffload.EngineSnapshot)
        again = codecs.encode(snapshot, format="json")
        assert codecs.decode(again, kvoffload.EngineSnapshot, format="json") == snapshot
        assert codecs.decode(codecs.encode(snapshot), kvoffload.EngineSnapshot) == snapshot
        _assert_subset(case["input"], json.loads(again), str(case["name"]))


def _assert_subset(expected: object, actual: object, where: str) -> None:
    """Every key/value of the input survives re-encoding (defaults may be added)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} lost"
            _assert_subset(value, actual[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _assert_subset(e, a, f"{where}[{i}]")
    else:
        assert expected == actual and type(expected) is type(actual), f"{where}: {expected!r} != {actual!r}"


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: d["engine_config"]["cache_config"].update(blok_size=16), "unknown field `blok_size`"),
        (lambda d: d["engine_config"]["cache_config"].update(block_size="16"), "Expected `int`, got `str`"),
        (lambda d: d["engine_config"]["cache_config"].update(block_size=0), "Expected `int` >= 1"),
        (lambda d: d["kv_cache_config"]["kv_cache_groups"][0]["kv_cache_spec"].update(type="fool"), "Invalid value"),
        (lambda d: d["kv_cache_config"]["kv_cache_groups"][0]["kv_cache_spec"].update(dtype="float17"), "float17"),
        (lambda d: d["kv_cache_config"].pop("num_blocks"), "missing required field `num_blocks`"),
    ],
)
def test_bad_snapshots_are_rejected_with_a_path(
    translate_cases: list[dict[str, object]], mutate: object, fragment: str
) -> None:
    doc = json.loads(json.dumps(translate_cases[0]["input"]))
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(json.dumps(doc), type=kvoffload.EngineSnapshot)
    assert fragment in str(info.value)
    assert "$." in str(info.value) or "unknown field" in str(info.value) or "missing" in str(info.value)


def test_json_schema_export() -> None:
    schema = codecs.json_schema(kvoffload.EngineSnapshot)
    defs = schema["$defs"]
    assert isinstance(defs, dict)
    assert "EngineSnapshot" in defs and "MLAAttentionSpec" in defs
    assert defs["CacheConfig"]["additionalProperties"] is False


def test_messages_are_lenient_and_configs_strict() -> None:
    for s in SCHEMA.structs.values():
        cls = getattr(gen, s.name)
        assert cls.__struct_config__.forbid_unknown_fields == (s.kind == "config"), s.name
        assert cls.__struct_config__.array_like == (s.layout == "array"), s.name
        assert cls.__struct_config__.frozen, s.name


def test_packed_arrays() -> None:
    arr = Int64Array([1, -2, 3])
    assert arr.tolist() == [1, -2, 3] and len(arr) == 3 and arr[1] == -2 and arr[1:].tolist() == [-2, 3]
    assert Int64Array.from_buffer(arr.tobytes()) == arr
    assert arr.to_tensor().tolist() == [1, -2, 3]
    import torch

    assert Int32Array.from_tensor(torch.arange(5)).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(OverflowError, match="2147483648"):
        Int32Array([2**31])
    with pytest.raises(kvoffload.WireError, match="multiple of 8"):
        Int64Array.from_buffer(b"abc")
