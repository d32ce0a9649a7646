"""The record format every secondary tier stores: a small header, the chunk key, then the chunk's bytes.

Record format (little-endian)::

    offset  size  field
    0       4     magic  b"KVOR"
    4       2     format version (FORMAT_VERSION = 2)
    6       2     key length in bytes
    8       8     payload length in bytes
    16      8     xxh3_64 of the payload
    24      16    namespace tag: the first 16 bytes of the sha256 of the namespace's fields
    40      16    MAC: keyed BLAKE2b-128 of bytes 0..40, the key and the payload (zeros without a secret)
    56      8     xxh3_64 of bytes 0..56 and the key (guards the header itself)
    64      k     the chunk key
    64+k    n     the payload (one host chunk row of one rank)

Everything a reader needs to reject a record is in it: a wrong magic or version, a record of another namespace
(another rank, model or layout copied or planted under this one's path), a record stored under another key, a
truncated or padded payload and flipped bits all fail with a :class:`RecordError`, and the tiers treat such a
record as a miss, count it and delete it. The xxh3 checksums catch accidents, not forgeries: anyone who can write
the directory or the server can write a record with valid checksums. With a secret
(``KVOFFLOAD_RECORD_SECRET`` in the environment of every process that reads or writes the tier), every record
carries a MAC that only holders of the secret can compute, and a record without a valid one is refused. Readers
may find bytes after the payload (O_DIRECT writes pad files to the device block size); they are ignored.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import xxhash

from kvoffload._packed import Buffer
from kvoffload.errors import RecordError

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "SECRET_ENV",
    "RecordHeader",
    "encode_header",
    "parse_header",
    "payload_checksum",
    "record_secret",
    "verify_payload",
]

MAGIC = b"KVOR"
FORMAT_VERSION = 2
_FIXED = struct.Struct("<4sHHQQ16s16sQ")
HEADER_SIZE = _FIXED.size
"""Bytes of the fixed header before the key."""
_MAC_FROM = 40  # bytes 0..40 (magic .. namespace tag) are covered by the MAC
_GUARD_FROM = 56  # bytes 0..56 (everything but the guard) are covered by the guard
_NO_MAC = bytes(16)
_MAX_KEY = 1024
SECRET_ENV = "KVOFFLOAD_RECORD_SECRET"
"""The environment variable holding the records' MAC secret (unset or empty: no MAC)."""


def record_secret() -> bytes | None:
    """The MAC secret from :data:`SECRET_ENV`, or None (records are then checksummed, not authenticated).

    Read as bytes where the platform has them (``os.environb``), so any byte string is a secret, UTF-8 or not.
    """
    if os.supports_bytes_environ:
        value = os.environb.get(SECRET_ENV.encode(), b"")
    else:  # Windows: the environment is text
        value = os.environ.get(SECRET_ENV, "").encode("utf-8", "surrogatepass")
    return value or None


def _mac(secret: bytes, prefix: bytes, key: bytes, payload: Buffer) -> bytes:
    if len(secret) > 64:  # BLAKE2b takes keys of up to 64 bytes
        secret = hashlib.sha512(secret).digest()
    mac = hashlib.blake2b(prefix, key=secret, digest_size=16)
    mac.update(key)
    mac.update(payload)
    return mac.digest()


def payload_checksum(payload: Buffer) -> int:
    """xxh3_64 of the payload (about 30 GB/s here: a third of a copy of the same bytes)."""
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(key: bytes, payload: Buffer, *, namespace: bytes, secret: bytes | None = None) -> bytes:
    """Header plus key for ``payload``, bound to the ``namespace`` tag (16 bytes) and MACed with ``secret``."""
    if not 0 < len(key) <= _MAX_KEY:
        raise RecordError(f"record key must have 1..{_MAX_KEY} bytes, got {len(key)}")
    if len(namespace) != 16:
        raise RecordError(f"record namespace tag must have 16 bytes, got {len(namespace)}")
    checksum = payload_checksum(payload)
    prefix = _FIXED.pack(MAGIC, FORMAT_VERSION, len(key), len(payload), checksum, namespace, _NO_MAC, 0)[:_MAC_FROM]
    mac = _NO_MAC if secret is None else _mac(secret, prefix, key, payload)
    head = prefix + mac
    guard = xxhash.xxh3_64_intdigest(head + key)
    return head + guard.to_bytes(8, "little") + key


class RecordHeader:
    """A parsed, self-consistent header: the key, the payload length and its checksum."""

    __slots__ = ("checksum", "key", "mac", "payload_len", "prefix")

    def __init__(self, key: bytes, payload_len: int, checksum: int, prefix: bytes, mac: bytes) -> None:
        self.key = key
        self.payload_len = payload_len
        self.checksum = checksum
        self.prefix = prefix  # the bytes the MAC covers before the key
        self.mac = mac

    @property
    def size(self) -> int:
        """Bytes before the payload (fixed header plus key)."""
        return HEADER_SIZE + len(self.key)

    @property
    def authenticated(self) -> bool:
        """Whether the record carries a MAC (its writer had a secret)."""
        return self.mac != _NO_MAC


def parse_header(buf: Buffer, *, expected_key: bytes, expected_len: int, expected_namespace: bytes) -> RecordHeader:
    """Parse and check the header at the start of ``buf`` against what the reader asked for.

    Raises :class:`RecordError` naming the first mismatch (magic, version, header checksum, namespace, key,
    length).
    """
    if len(buf) < HEADER_SIZE:
        raise RecordError(f"record is truncated: {len(buf)} bytes, a header needs {HEADER_SIZE}")
    magic, version, key_len, payload_len, checksum, namespace, mac, guard = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RecordError(f"record has magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise RecordError(f"record has format version {version}, this reader knows {FORMAT_VERSION}")
    if len(buf) < HEADER_SIZE + key_len:
        raise RecordError(f"record is truncated inside its key ({len(buf)} bytes)")
    key = bytes(buf[HEADER_SIZE : HEADER_SIZE + key_len])
    if xxhash.xxh3_64_intdigest(bytes(buf[:_GUARD_FROM]) + key) != guard:
        raise RecordError("record header checksum mismatch")
    if namespace != expected_namespace:
        raise RecordError(f"record belongs to namespace {namespace.hex()}, expected {expected_namespace.hex()}")
    if key != expected_key:
        raise RecordError(f"record holds key {key.hex()}, expected {expected_key.hex()}")
    if payload_len != expected_len:
        raise RecordError(f"record payload has {payload_len} bytes, expected {expected_len}")
    return RecordHeader(key, payload_len, checksum, bytes(buf[:_MAC_FROM]), mac)


def verify_payload(header: RecordHeader, payload: Buffer, *, secret: bytes | None = None) -> None:
    """Raise :class:`RecordError` unless ``payload`` has the header's length and checksum (and, with a
    ``secret``, the record carries a MAC of it made with that secret)."""
    if len(payload) != header.payload_len:
        raise RecordError(f"record payload is truncated: {len(payload)} of {header.payload_len} bytes")
    if payload_checksum(payload) != header.checksum:
        raise RecordError(f"record payload checksum mismatch for key {header.key.hex()}")
    if secret is not None:
        if not header.authenticated:
            raise RecordError(f"record of key {header.key.hex()} is not authenticated (it carries no MAC)")
        if not hmac.compare_digest(header.mac, _mac(secret, header.prefix, header.key, payload)):
            raise RecordError(f"record of key {header.key.hex()} has an invalid MAC (not written with this secret)")
