"""The tier record format: round trip, and every kind of damage is detected (RecordError, never bad bytes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.errors import RecordError, TierError
from kvoffload.tiers import FsTier
from kvoffload.tiers._record import HEADER_SIZE, SECRET_ENV, encode_header, parse_header, record_secret, verify_payload
from tests.tiers import rows as rows_helpers

NS = bytes(range(16))


def _record(key: bytes, payload: bytes, *, namespace: bytes = NS, secret: bytes | None = None) -> bytes:
    return encode_header(key, payload, namespace=namespace, secret=secret) + payload


def _read(record: bytes, key: bytes, n: int, *, namespace: bytes = NS, secret: bytes | None = None) -> bytes:
    header = parse_header(
        record[: HEADER_SIZE + len(key)], expected_key=key, expected_len=n, expected_namespace=namespace
    )
    payload = record[header.size : header.size + n]
    verify_payload(header, payload, secret=secret)
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


def test_a_record_of_another_namespace_is_refused() -> None:
    """A record copied from another rank's, model's or layout's namespace never passes for this one's."""
    key, payload = b"k" * 36, bytes(range(100))
    other = _record(key, payload, namespace=b"\xff" * 16)
    with pytest.raises(RecordError, match="namespace"):
        _read(other, key, len(payload))
    assert _read(other, key, len(payload), namespace=b"\xff" * 16) == payload


@given(payload=st.binary(min_size=1, max_size=2048), secret=st.binary(min_size=1, max_size=100))
def test_a_mac_binds_the_record_to_the_secret(payload: bytes, secret: bytes) -> None:
    key = b"m" * 36
    record = _record(key, payload, secret=secret)
    assert _read(record, key, len(payload), secret=secret) == payload
    assert _read(record, key, len(payload)) == payload  # a reader without the secret checks the checksums only
    with pytest.raises(RecordError, match="invalid MAC"):
        _read(record, key, len(payload), secret=secret + b"x")


def test_a_forged_record_with_valid_checksums_is_refused_under_a_secret() -> None:
    """Anyone who can write the store can write valid xxh3 checksums: only the MAC tells a forgery."""
    key, payload, secret = b"f" * 36, bytes(range(64)), b"s3cret"
    forged = _record(key, bytes(64))  # checksummed, no MAC
    with pytest.raises(RecordError, match="not authenticated"):
        _read(forged, key, 64, secret=secret)
    genuine = _record(key, payload, secret=secret)
    header_len = HEADER_SIZE + len(key)
    # The attacker changes the payload and recomputes every unkeyed field (payload checksum, header guard),
    # keeping the genuine record's MAC: the MAC covers the payload, so the record is refused.
    changed = bytes(64)
    unkeyed = _record(key, changed)[:header_len]
    head = unkeyed[:40] + genuine[40:56]
    guard = xxhash.xxh3_64_intdigest(head + key).to_bytes(8, "little")
    tampered = head + guard + key + changed
    with pytest.raises(RecordError, match="invalid MAC"):
        _read(tampered, key, len(payload), secret=secret)


@pytest.mark.skipif(not os.supports_bytes_environ, reason="the environment is text here")
def test_a_secret_that_is_not_utf8_is_taken_as_its_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """R7: ``KVOFFLOAD_RECORD_SECRET`` set to bytes that are no UTF-8 used to raise UnicodeEncodeError (a traceback
    at the first tier opened); the secret is its bytes, and records MACed with it need exactly those bytes."""
    secret = b"\xff\xfe s3cret \x80"
    monkeypatch.setitem(os.environb, SECRET_ENV.encode(), secret)
    assert record_secret() == secret
    row = 4096
    ns = rows_helpers.namespace(row)
    rows, keys = rows_helpers.random_rows(3, row, seed=7), rows_helpers.keys(3)
    with FsTier(tmp_path, ns) as tier:
        assert rows_helpers.store(tier, keys, rows) == ()
        out, failed = rows_helpers.load(tier, keys, row)
        assert failed == () and torch.equal(out, rows)
    monkeypatch.setitem(os.environb, SECRET_ENV.encode(), secret[:-1])  # another secret: every MAC is refused
    with FsTier(tmp_path, ns) as tier:
        assert rows_helpers.load(tier, keys, row)[1] == (0, 1, 2) and tier.stats().corrupt_records == 3
    monkeypatch.setitem(os.environb, SECRET_ENV.encode(), b"")
    assert record_secret() is None, "empty: no secret"
