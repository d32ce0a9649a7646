"""The tier record format: round trip, and every kind of damage is detected (RecordError, never bad bytes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.errors import ConfigError, RecordError, TierError
from kvoffload.tiers import FsTier
from kvoffload.tiers import _record as record_module
from kvoffload.tiers._record import (
    BLAKE3_VERSION,
    FORMAT_VERSION,
    HAVE_BLAKE3,
    HEADER_SIZE,
    MAC_ENV,
    SECRET_ENV,
    encode_header,
    parse_header,
    record_secret,
    verify_payload,
)
from tests.tiers import rows as rows_helpers

NS = bytes(range(16))


def _record(
    key: bytes, payload: bytes, *, namespace: bytes = NS, secret: bytes | None = None, blake3: bool = HAVE_BLAKE3
) -> bytes:
    return encode_header(key, payload, namespace=namespace, secret=secret, blake3=blake3) + payload


def _version(record: bytes) -> int:
    return int.from_bytes(record[4:6], "little")


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


needs_blake3 = pytest.mark.skipif(not HAVE_BLAKE3, reason="the blake3 package is not installed (a dev dependency)")


@needs_blake3
@given(payload=st.binary(min_size=1, max_size=4096), secret=st.binary(min_size=1, max_size=100))
def test_with_blake3_installed_records_are_maced_with_blake3_and_old_blake2b_ones_still_verify(
    payload: bytes, secret: bytes
) -> None:
    """A mixed fleet: writers with blake3 write version 3, writers without it version 2; a reader verifies both,
    and neither MAC passes for another secret or under the other algorithm's version."""
    key = b"b" * 36
    new, old = _record(key, payload, secret=secret), _record(key, payload, secret=secret, blake3=False)
    assert (_version(new), _version(old)) == (BLAKE3_VERSION, FORMAT_VERSION)
    assert _read(new, key, len(payload), secret=secret) == payload
    assert _read(old, key, len(payload), secret=secret) == payload
    for record in (new, old):
        with pytest.raises(RecordError, match="invalid MAC"):
            _read(record, key, len(payload), secret=secret + b"x")
    # the BLAKE3 MAC relabelled as version 2 (header guard recomputed) is no BLAKE2b MAC
    head = new[:4] + FORMAT_VERSION.to_bytes(2, "little") + new[6:56]
    relabelled = head + xxhash.xxh3_64_intdigest(head + key).to_bytes(8, "little") + new[64:]
    with pytest.raises(RecordError, match="invalid MAC"):
        _read(relabelled, key, len(payload), secret=secret)


def test_records_without_a_secret_keep_version_2() -> None:
    """Only authenticated records change version: tiers without a secret read and write what they always did."""
    assert _version(_record(b"k" * 36, b"payload")) == FORMAT_VERSION


@needs_blake3
def test_a_reader_without_blake3_refuses_a_blake3_record_under_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    key, payload, secret = b"r" * 36, bytes(range(200)), b"s3cret"
    record = _record(key, payload, secret=secret)
    monkeypatch.setattr(record_module, "_blake3", None)  # this process as one without the package
    with pytest.raises(RecordError, match="install the blake3 package"):
        _read(record, key, len(payload), secret=secret)
    assert _read(record, key, len(payload)) == payload, "without a secret only the checksums are checked"
    assert _read(_record(key, payload, secret=secret, blake3=False), key, len(payload), secret=secret) == payload


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


@needs_blake3
@pytest.mark.parametrize(("mac", "version"), [("", BLAKE3_VERSION), ("blake2b", FORMAT_VERSION)])
def test_the_writers_mac_is_chosen_by_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mac: str, version: int
) -> None:
    """``KVOFFLOAD_RECORD_MAC=blake2b`` keeps writing version 2 records (readers without blake3 verify them, for a
    fleet still being upgraded); either way the same secret reads both."""
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    monkeypatch.setenv(MAC_ENV, mac)
    row = 4096
    ns = rows_helpers.namespace(row)
    rows, keys = rows_helpers.random_rows(2, row, seed=3), rows_helpers.keys(2)
    with FsTier(tmp_path, ns) as tier:
        assert rows_helpers.store(tier, keys, rows) == ()
    records = sorted(tmp_path.rglob("*.bin"))
    assert len(records) == 2 and {_version(r.read_bytes()) for r in records} == {version}
    monkeypatch.setenv(MAC_ENV, "blake2b" if mac == "" else "blake3")
    with FsTier(tmp_path, ns) as tier:
        out, failed = rows_helpers.load(tier, keys, row)
        assert failed == () and torch.equal(out, rows)


def test_a_mac_that_is_not_one_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAC_ENV, "sha1")
    with pytest.raises(ConfigError, match="KVOFFLOAD_RECORD_MAC='sha1' is not a record MAC"):
        FsTier(tmp_path, rows_helpers.namespace(4096))
