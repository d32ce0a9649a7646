"""The record format every secondary tier stores: a small header, the chunk key, then the chunk's bytes.

Record format (little-endian)::

    offset  size  field
    0       4     magic  b"KVOR"
    4       2     format version: 2 (FORMAT_VERSION; a MAC is keyed BLAKE2b) or 3 (the same, the MAC keyed BLAKE3)
    6       2     key length in bytes
    8       8     payload length in bytes
    16      8     xxh3_64 of the payload
    24      16    namespace tag: the first 16 bytes of the sha256 of the namespace's fields
    40      16    MAC: keyed BLAKE2b-128 (version 2) or BLAKE3-128 (version 3) of bytes 0..40, the key and the
                  payload (zeros without a secret)
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

The MAC is keyed BLAKE3 where the ``blake3`` package is installed (several GB/s per thread, against about 1.2 for
the standard library's BLAKE2b): such records carry version 3 and a reader without ``blake3`` refuses them under a
secret (a miss, said in the error; the record is sound, so the tier keeps it for the readers that can verify it:
``RecordError.damaged`` is False). Records without a MAC keep version 2, so only authenticated tiers see version 3.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import os
import struct
from types import ModuleType

import xxhash

from kvoffload._packed import Buffer
from kvoffload.errors import ConfigError, RecordError

_blake3: ModuleType | None
try:
    _blake3 = importlib.import_module("blake3")
except ImportError:  # optional: the MAC falls back to the standard library's BLAKE2b
    _blake3 = None

__all__ = [
    "BLAKE3_VERSION",
    "FORMAT_VERSION",
    "HAVE_BLAKE3",
    "HEADER_SIZE",
    "MAC_ENV",
    "MAGIC",
    "SECRET_ENV",
    "RecordHeader",
    "encode_header",
    "parse_header",
    "payload_checksum",
    "record_mac_blake3",
    "record_secret",
    "unpack_record",
    "verify_payload",
]

MAGIC = b"KVOR"
FORMAT_VERSION = 2
"""The record layout (part of every namespace's fields): version 2 records, and version 3 ones (BLAKE3 MAC)."""
BLAKE3_VERSION = 3
"""The version field of a record whose MAC is keyed BLAKE3 (the layout is version 2's)."""
HAVE_BLAKE3 = _blake3 is not None
"""Whether this process MACs records with BLAKE3 (the ``blake3`` package is installed)."""
_FIXED = struct.Struct("<4sHHQQ16s16sQ")
HEADER_SIZE = _FIXED.size
"""Bytes of the fixed header before the key."""
_MAC_FROM = 40  # bytes 0..40 (magic .. namespace tag) are covered by the MAC
_GUARD_FROM = 56  # bytes 0..56 (everything but the guard) are covered by the guard
_NO_MAC = bytes(16)
_MAX_KEY = 1024
SECRET_ENV = "KVOFFLOAD_RECORD_SECRET"
"""The environment variable holding the records' MAC secret (unset or empty: no MAC)."""
MAC_ENV = "KVOFFLOAD_RECORD_MAC"
"""The environment variable naming the MAC writers use: ``blake3`` (the default where the package is installed) or
``blake2b`` (version 2 records, which readers without ``blake3`` verify: for a fleet still being upgraded)."""


def record_mac_blake3() -> bool:
    """Whether this process's writers MAC records with BLAKE3 (see :data:`MAC_ENV`); a ConfigError names a value
    that is not a MAC, or ``blake3`` without the package."""
    value = os.environ.get(MAC_ENV, "").strip().lower()
    if value not in ("", "blake3", "blake2b"):
        raise ConfigError(f"{MAC_ENV}={value!r} is not a record MAC (blake3 or blake2b)")
    if value == "blake3" and _blake3 is None:
        raise ConfigError(f"{MAC_ENV}=blake3 needs the blake3 package (pip install blake3), or set it to blake2b")
    return HAVE_BLAKE3 if not value else value == "blake3"


def record_secret() -> bytes | None:
    """The MAC secret from :data:`SECRET_ENV`, or None (records are then checksummed, not authenticated).

    Read as bytes where the platform has them (``os.environb``), so any byte string is a secret, UTF-8 or not.
    """
    if os.supports_bytes_environ:
        value = os.environb.get(SECRET_ENV.encode(), b"")
    else:  # Windows: the environment is text
        value = os.environ.get(SECRET_ENV, "").encode("utf-8", "surrogatepass")
    return value or None


def _mac(version: int, secret: bytes, prefix: bytes, key: bytes, payload: Buffer) -> bytes:
    if version == BLAKE3_VERSION:
        if _blake3 is None:
            raise RecordError(
                "record is MACed with BLAKE3 (version 3): install the blake3 package to verify it", damaged=False
            )
        keyed = _blake3.blake3(prefix, key=hashlib.blake2b(secret, digest_size=32).digest())
        keyed.update(key)
        keyed.update(payload)
        digest: bytes = keyed.digest(16)
        return digest
    if len(secret) > 64:  # BLAKE2b takes keys of up to 64 bytes
        secret = hashlib.sha512(secret).digest()
    mac = hashlib.blake2b(prefix, key=secret, digest_size=16)
    mac.update(key)
    mac.update(payload)
    return mac.digest()


def payload_checksum(payload: Buffer) -> int:
    """xxh3_64 of the payload (about 30 GB/s here: a third of a copy of the same bytes)."""
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(
    key: bytes, payload: Buffer, *, namespace: bytes, secret: bytes | None = None, blake3: bool = HAVE_BLAKE3
) -> bytes:
    """Header plus key for ``payload``, bound to the ``namespace`` tag (16 bytes) and MACed with ``secret``
    (keyed BLAKE3 with ``blake3``, the default where installed, else BLAKE2b)."""
    if not 0 < len(key) <= _MAX_KEY:
        raise RecordError(f"record key must have 1..{_MAX_KEY} bytes, got {len(key)}")
    if len(namespace) != 16:
        raise RecordError(f"record namespace tag must have 16 bytes, got {len(namespace)}")
    if blake3 and _blake3 is None:
        raise RecordError("a BLAKE3 MAC needs the blake3 package")
    version = BLAKE3_VERSION if secret is not None and blake3 else FORMAT_VERSION
    checksum = payload_checksum(payload)
    prefix = _FIXED.pack(MAGIC, version, len(key), len(payload), checksum, namespace, _NO_MAC, 0)[:_MAC_FROM]
    mac = _NO_MAC if secret is None else _mac(version, secret, prefix, key, payload)
    head = prefix + mac
    guard = xxhash.xxh3_64_intdigest(head + key)
    return head + guard.to_bytes(8, "little") + key


class RecordHeader:
    """A parsed, self-consistent header: the key, the payload length and its checksum."""

    __slots__ = ("checksum", "key", "mac", "payload_len", "prefix", "version")

    def __init__(self, key: bytes, payload_len: int, checksum: int, prefix: bytes, mac: bytes, version: int) -> None:
        self.version = version
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
    if version not in (FORMAT_VERSION, BLAKE3_VERSION):
        known = f"{FORMAT_VERSION} and {BLAKE3_VERSION}"
        raise RecordError(f"record has format version {version}, this reader knows {known}")
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
    return RecordHeader(key, payload_len, checksum, bytes(buf[:_MAC_FROM]), mac, version)


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
        if not hmac.compare_digest(header.mac, _mac(header.version, secret, header.prefix, header.key, payload)):
            raise RecordError(f"record of key {header.key.hex()} has an invalid MAC (not written with this secret)")


def unpack_record(
    record: memoryview, *, key: bytes, payload_len: int, namespace: bytes, secret: bytes | None
) -> tuple[RecordHeader, memoryview]:
    """The header and payload of a whole record held in memory (a Valkey value, an object), both verified: a
    :class:`RecordError` for a record that is not ``key``'s of ``namespace`` with a sound payload."""
    head_len = HEADER_SIZE + len(key)
    header = parse_header(record[:head_len], expected_key=key, expected_len=payload_len, expected_namespace=namespace)
    payload = record[head_len : head_len + payload_len]
    verify_payload(header, payload, secret=secret)
    return header, payload
