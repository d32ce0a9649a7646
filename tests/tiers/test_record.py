"""The tier record format: round trip, and every kind of damage is detected (RecordError, never bad bytes)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.errors import RecordError, TierError
from kvoffload.tiers._record import HEADER_SIZE, encode_header, parse_header, payload_checksum, verify_payload


def _record(key: bytes, payload: bytes) -> bytes:
    return encode_header(key, len(payload), payload_checksum(payload)) + payload


def _read(record: bytes, key: bytes, n: int) -> bytes:
    header = parse_header(record[: HEADER_SIZE + len(key)], expected_key=key, expected_len=n)
    payload = record[header.size : header.size + n]
    verify_payload(header, payload)
    return payload


@given(key=st.binary(min_size=1, max_size=64), payload=st.binary(max_size=4096))
def test_round_trip(key: bytes, payload: bytes) -> None:
    assert _read(_record(key, payload), key, len(payload)) == payload


@given(
    key=st.binary(min_size=1, max_size=40),
    payload=st.binary(min_size=1, max_size=512),
    data=st.data(),
)
def test_any_flipped_bit_is_detected(key: bytes, payload: bytes, data: st.DataObject) -> None:
    record = bytearray(_record(key, payload))
    pos = data.draw(st.integers(0, len(record) - 1))
    bit = data.draw(st.integers(0, 7))
    record[pos] ^= 1 << bit
    with pytest.raises(RecordError):
        _read(bytes(record), key, len(payload))


def test_wrong_key_length_and_truncation_are_errors() -> None:
    key, payload = b"k" * 36, bytes(range(200))
    record = _record(key, payload)
    with pytest.raises(RecordError, match="expected"):
        _read(record, b"x" * 36, len(payload))
    with pytest.raises(RecordError, match="payload has 200 bytes, expected 100"):
        _read(record, key, 100)
    with pytest.raises(RecordError, match="truncated"):
        _read(record[:-1], key, len(payload))
    with pytest.raises(RecordError, match="truncated"):
        _read(record[:10], key, len(payload))
    with pytest.raises(RecordError, match="magic"):
        _read(b"XXXX" + record[4:], key, len(payload))
    assert issubclass(RecordError, TierError) and issubclass(RecordError, OSError)
