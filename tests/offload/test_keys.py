"""Offload keys, chunk arithmetic and the reference block hasher."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.errors import ConfigError
from kvoffload.offload.keys import (
    DEFAULT_HASH_SEED,
    MAX_GROUP_ID,
    chunk_keys,
    hash_token_blocks,
    hashes_per_chunk,
    make_offload_key,
    offload_key_group,
    offload_key_hash,
)

# --------------------------------------------------------------------------- key packing


def test_key_is_hash_plus_big_endian_group_id() -> None:
    assert make_offload_key(b"\xaa\xbb", 0x01020304) == b"\xaa\xbb\x01\x02\x03\x04"
    assert make_offload_key(b"h", 0) == b"h\x00\x00\x00\x00"
    assert make_offload_key(b"h", 1) == b"h\x00\x00\x00\x01"
    assert make_offload_key(b"h", MAX_GROUP_ID) == b"h\xff\xff\xff\xff"
    assert MAX_GROUP_ID == 4_294_967_295


def test_vllm_test_keys_encoding() -> None:
    # vLLM's manager tests build keys as make_offload_key(str(i).encode(), 0).
    assert make_offload_key(str(12).encode(), 0) == b"12\x00\x00\x00\x00"


@pytest.mark.parametrize("group_id", [-1, 2**32, 2**40])
def test_group_id_out_of_range_is_config_error(group_id: int) -> None:
    with pytest.raises(ConfigError, match=str(group_id)) as info:
        make_offload_key(b"h", group_id)
    assert "group_id" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("group_id", [True, 1.0, "1", None])
def test_group_id_must_be_int(group_id: object) -> None:
    with pytest.raises(ConfigError, match="group_id"):
        make_offload_key(b"h", group_id)  # type: ignore[arg-type]


def test_block_hash_must_be_bytes() -> None:
    with pytest.raises(ConfigError, match="block_hash"):
        make_offload_key("abc", 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block_hash"):
        make_offload_key(bytearray(b"abc"), 0)  # type: ignore[arg-type]


@given(block_hash=st.binary(max_size=64), group_id=st.integers(0, MAX_GROUP_ID))
def test_key_round_trip(block_hash: bytes, group_id: int) -> None:
    key = make_offload_key(block_hash, group_id)
    assert len(key) == len(block_hash) + 4
    assert offload_key_hash(key) == block_hash
    assert offload_key_group(key) == group_id


def test_key_parts_of_a_hand_made_key() -> None:
    key = bytes(range(32)) + b"\x00\x00\x01\x00"
    assert offload_key_hash(key) == bytes(range(32))
    assert offload_key_group(key) == 256


@pytest.mark.parametrize("bad", [b"", b"abc", "abcdef", None])
def test_malformed_keys_are_rejected(bad: object) -> None:
    with pytest.raises(ConfigError, match="offload key"):
        offload_key_hash(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="offload key"):
        offload_key_group(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- chunk arithmetic


@pytest.mark.parametrize(
    ("tpb", "bpc", "tph", "expected"),
    [(16, 1, 16, 1), (16, 4, 16, 4), (16, 2, 32, 1), (12, 4, 4, 12), (32, 3, 16, 6), (4, 1, 4, 1)],
)
def test_hashes_per_chunk(tpb: int, bpc: int, tph: int, expected: int) -> None:
    assert hashes_per_chunk(tpb, bpc, tph) == expected


@pytest.mark.parametrize(("tpb", "bpc", "tph"), [(16, 1, 32), (12, 1, 8), (16, 3, 32), (12, 1, 16)])
def test_hashes_per_chunk_must_be_integral(tpb: int, bpc: int, tph: int) -> None:
    with pytest.raises(ConfigError, match="tokens_per_hash") as info:
        hashes_per_chunk(tpb, bpc, tph)
    assert str(tph) in str(info.value)


@pytest.mark.parametrize(
    ("args", "field"),
    [((0, 1, 16), "tokens_per_block"), ((16, 0, 16), "blocks_per_chunk"), ((16, 1, 0), "tokens_per_hash")],
)
def test_hashes_per_chunk_rejects_zero(args: tuple[int, int, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        hashes_per_chunk(*args)


def _hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 4 for i in range(n)]


def test_chunk_key_is_last_hash_of_each_complete_chunk() -> None:
    hashes = _hashes(10)
    suffix = b"\x00\x00\x00\x07"
    assert chunk_keys(hashes, 7, 3) == [hashes[2] + suffix, hashes[5] + suffix, hashes[8] + suffix]
    assert chunk_keys(hashes, 7, 3, start_chunk=1) == [hashes[5] + suffix, hashes[8] + suffix]
    assert chunk_keys(hashes, 7, 3, start_chunk=3) == []
    assert chunk_keys(hashes, 7, 5) == [hashes[4] + suffix, hashes[9] + suffix]
    assert chunk_keys(hashes[:2], 7, 3) == []
    assert chunk_keys(hashes, 0, 1) == [h + b"\x00\x00\x00\x00" for h in hashes]


@given(
    n=st.integers(0, 40),
    hpc=st.integers(1, 8),
    start=st.integers(0, 10),
    group_id=st.integers(0, MAX_GROUP_ID),
)
def test_chunk_keys_formula(n: int, hpc: int, start: int, group_id: int) -> None:
    hashes = _hashes(n)
    keys = chunk_keys(hashes, group_id, hpc, start)
    expected = [make_offload_key(hashes[(i + 1) * hpc - 1], group_id) for i in range(start, n // hpc)]
    assert keys == expected
    assert len(keys) == max(0, n // hpc - start)


def test_chunk_keys_validates_arguments() -> None:
    with pytest.raises(ConfigError, match="hashes_per_chunk"):
        chunk_keys(_hashes(4), 0, 0)
    with pytest.raises(ConfigError, match="start_chunk"):
        chunk_keys(_hashes(4), 0, 1, start_chunk=-1)
    with pytest.raises(ConfigError, match="group_id"):
        chunk_keys(_hashes(4), 2**32, 1)


# --------------------------------------------------------------------------- reference hasher


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_hash_token_blocks_documented_encoding() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    none_hash = _sha(DEFAULT_HASH_SEED)
    h0 = _sha(none_hash + struct.pack("<4q", 1, 2, 3, 4))
    h1 = _sha(h0 + struct.pack("<4q", 5, 6, 7, 8))
    assert hash_token_blocks(tokens, 4) == [h0, h1]  # token 9 is a partial block


def test_hash_token_blocks_golden_value() -> None:
    # Pinned so that an accidental change of seed or encoding is caught.
    assert DEFAULT_HASH_SEED == b"kvoffload/block-hash/v1"
    [digest] = hash_token_blocks([1, 2, 3, 4], 4)
    assert digest.hex() == "42416aa8d6a58817498e1e1704448dba7b737a4beb4af4271810a1c0fc54e56f"


def test_hash_token_blocks_parent_continues_the_chain() -> None:
    tokens = list(range(100, 124))
    whole = hash_token_blocks(tokens, 4)
    first = hash_token_blocks(tokens[:8], 4)
    rest = hash_token_blocks(tokens[8:], 4, parent=first[-1])
    assert len(whole) == 6
    assert first + rest == whole


def test_hash_token_blocks_is_prefix_sensitive() -> None:
    a = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_token_blocks([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different prefix
    assert hash_token_blocks([1, 2, 3, 4], 4, seed=b"other") != a[:1]
    assert hash_token_blocks([1, 2, 3, 4], 2) != hash_token_blocks([1, 2, 3, 4], 4)


def test_hash_token_blocks_edges() -> None:
    assert hash_token_blocks([], 4) == []
    assert hash_token_blocks([1, 2, 3], 4) == []
    assert hash_token_blocks(range(8), 4) == hash_token_blocks(list(range(8)), 4)
    low = hash_token_blocks([-(2**63), 2**63 - 1], 2)
    assert low == [_sha(_sha(DEFAULT_HASH_SEED) + struct.pack("<2q", -(2**63), 2**63 - 1))]


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 1.5, "1"])
def test_hash_token_blocks_rejects_non_int64_tokens(bad: object) -> None:
    with pytest.raises(ConfigError, match="64-bit") as info:
        hash_token_blocks([0, 1, bad, 3], 4)  # type: ignore[list-item]
    assert repr(bad) in str(info.value)


def test_hash_token_blocks_validates_arguments() -> None:
    with pytest.raises(ConfigError, match="tokens_per_hash"):
        hash_token_blocks([1, 2], 0)
    with pytest.raises(ConfigError, match="parent"):
        hash_token_blocks([1, 2], 2, parent="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="seed"):
        hash_token_blocks([1, 2], 2, seed="x")  # type: ignore[arg-type]


@given(tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40), tph=st.integers(1, 8))
def test_hash_token_blocks_matches_chained_sha256(tokens: list[int], tph: int) -> None:
    expected = []
    prev = _sha(DEFAULT_HASH_SEED)
    for j in range(len(tokens) // tph):
        prev = _sha(prev + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[j * tph : (j + 1) * tph]))
        expected.append(prev)
    assert hash_token_blocks(tokens, tph) == expected
