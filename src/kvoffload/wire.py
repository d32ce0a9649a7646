"""The versioned wire: envelope, frames and handshake around the generated msgpack codecs.

A wire message is a list of frames. Frame 0 is a fixed 24-byte header followed by the msgpack body of
one generated message; every further frame is an opaque attachment (tensor bytes, never inlined in the
body, so they can travel zero-copy)::

    offset  size  field
    0       4     magic b"KVOW"
    4       1     schema major version
    5       1     schema minor version
    6       1     flags (bits 0-3 must be understood: unknown ones are refused; bits 4-7 are ignored)
    7       1     message kind (the schema's `message_id`)
    8       8     schema fingerprint (SCHEMA_FINGERPRINT as 8 raw bytes)
    16      4     body length in bytes (little-endian, like every header integer)
    20      2     number of attachment frames
    22      2     reserved (written as zero, ignored on read)

Versioning: another major version is refused with SchemaMismatchError (naming both versions); the same
major with another fingerprint decodes through the compatible path, where msgspec skips trailing fields
it does not know and fills defaults for fields the sender did not have. Messages never forbid unknown
fields, so that path needs no per-version code. Anything malformed raises WireError: decoding never
returns a half-built message and never raises anything else for bad bytes.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, TypeVar

import msgspec

from kvoffload._generated import codecs
from kvoffload._generated.types import (
    MESSAGE_TYPES,
    SCHEMA_FINGERPRINT,
    SCHEMA_VERSION,
    EngineSnapshot,
    Hello,
    Message,
    PeerRole,
)
from kvoffload._ints import check_int
from kvoffload._packed import Buffer
from kvoffload.errors import ArgumentTypeError, ConfigError, SchemaMismatchError, WireError

__all__ = [
    "DEFAULT_ENGINE_ID",
    "DEFAULT_MAX_BODY_BYTES",
    "HEADER_SIZE",
    "LOCAL_MAJOR",
    "LOCAL_MINOR",
    "MAGIC",
    "Buffer",
    "Decoded",
    "HandshakeResult",
    "Header",
    "check_hello",
    "decode",
    "encode",
    "engine_id_of",
    "handshake",
    "make_hello",
    "parse_header",
]

_M = TypeVar("_M", bound=msgspec.Struct)

MAGIC: Final = b"KVOW"
"""First four bytes of every frame 0."""

_HEADER: Final = struct.Struct("<4sBBBB8sIHH")
HEADER_SIZE: Final = _HEADER.size
"""Bytes of the fixed header in front of the body (24)."""

DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
"""Largest body `decode` accepts unless told otherwise; tensors belong in attachments, not the body."""

_CRITICAL_FLAGS: Final = 0x0F
_KNOWN_FLAGS: Final = 0x00
_MAX_ATTACHMENTS: Final = 0xFFFF


def _local_version() -> tuple[int, int]:
    major, _, minor = SCHEMA_VERSION.partition(".")
    if not (major.isdigit() and minor.isdigit() and int(major) < 256 and int(minor) < 256):
        raise ImportError(f"schema version {SCHEMA_VERSION!r} does not fit the wire header (u8.u8)")
    return int(major), int(minor)


LOCAL_MAJOR: Final = _local_version()[0]
"""Major version of this process's schema (the header's byte 4)."""
LOCAL_MINOR: Final = _local_version()[1]
"""Minor version of this process's schema (the header's byte 5)."""
_LOCAL_FINGERPRINT: Final = bytes.fromhex(SCHEMA_FINGERPRINT)
if len(_LOCAL_FINGERPRINT) != 8:  # pragma: no cover - the generator emits 16 hex digits
    raise ImportError(f"schema fingerprint {SCHEMA_FINGERPRINT!r} is not 8 bytes")

_KIND_OF: Final[dict[type[msgspec.Struct], int]] = {cls: kind for kind, cls in MESSAGE_TYPES.items()}
_DECODERS: Final = codecs.MESSAGE_DECODERS
_KIND_NAMES: Final = {kind: cls.__name__ for kind, cls in MESSAGE_TYPES.items()}
_encode_into: Final = codecs.encode_into


class Header(msgspec.Struct, frozen=True, gc=False):
    """The fixed header of frame 0 (a msgspec Struct: built on every decode, so it must be cheap)."""

    major: int
    minor: int
    flags: int
    kind: int
    fingerprint: bytes
    body_len: int
    attachments: int

    @property
    def version(self) -> str:
        """The sender's schema version, `major.minor`."""
        return f"{self.major}.{self.minor}"

    def to_bytes(self) -> bytes:
        """Pack the header (24 bytes); raises WireError when a value does not fit its field."""
        if len(self.fingerprint) != 8:
            raise WireError(f"header fingerprint must be 8 bytes, got {len(self.fingerprint)}")
        try:
            return _HEADER.pack(
                MAGIC,
                self.major,
                self.minor,
                self.flags,
                self.kind,
                self.fingerprint,
                self.body_len,
                self.attachments,
                0,
            )
        except struct.error as exc:
            raise WireError(f"header does not fit the wire format: {exc}") from None


class Decoded(msgspec.Struct, frozen=True):
    """A decoded wire message: the typed message, its attachment frames and the sender's header."""

    message: Message
    attachments: tuple[memoryview, ...]
    """Attachment frames as zero-copy views of the received frames (valid while those are)."""
    header: Header

    @property
    def compatible(self) -> bool:
        """True when the sender's schema differs from ours (decoded through the compatible path)."""
        return self.header.fingerprint != _LOCAL_FINGERPRINT

    def expect(self, cls: type[_M]) -> _M:
        """The message as `cls`; WireError when the peer sent another kind."""
        message = self.message
        if not isinstance(message, cls):
            raise WireError(f"expected a {cls.__name__} message, got {type(message).__name__}")
        return message


def encode(msg: Message, attachments: Sequence[Buffer] = ()) -> list[bytes | memoryview]:
    """Encode one message into frames: [header + msgpack body, *attachments].

    Attachments are passed through untouched (bytes stay bytes, anything else becomes a memoryview), so a
    tensor's buffer is never copied here. Raises ArgumentTypeError (a TypeError) for a non-message or a
    non-buffer attachment, WireError for more attachments than the header can count.
    """
    kind = _KIND_OF.get(type(msg))
    if kind is None:
        raise ArgumentTypeError(f"{type(msg).__name__} is not a wire message (known: {sorted(_KIND_NAMES.values())})")
    count = len(attachments)
    if count > _MAX_ATTACHMENTS:
        raise WireError(f"{count} attachments exceed the wire limit of {_MAX_ATTACHMENTS}")
    frame = bytearray(HEADER_SIZE)
    _encode_into(msg, frame, HEADER_SIZE)
    _HEADER.pack_into(
        frame,
        0,
        MAGIC,
        LOCAL_MAJOR,
        LOCAL_MINOR,
        0,
        kind,
        _LOCAL_FINGERPRINT,
        len(frame) - HEADER_SIZE,
        count,
        0,
    )
    frames: list[bytes | memoryview] = [memoryview(frame)]
    for index, item in enumerate(attachments):
        if isinstance(item, bytes):
            frames.append(item)
            continue
        try:
            frames.append(memoryview(item))
        except TypeError:
            raise ArgumentTypeError(f"attachment {index} is a {type(item).__name__}, not a bytes-like object") from None
    return frames


def parse_header(frame: Buffer, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Header:
    """Read and validate the header of frame 0 (magic, major version, flags, kind, body length).

    Raises WireError for a frame that is not ours, oversized or cut short, SchemaMismatchError for
    another major version.
    """
    return _parse_header(_bytes_view(frame, "frame 0"), max_body_bytes)


def _bytes_view(frame: Buffer, what: str) -> memoryview:
    try:
        return memoryview(frame).cast("B")
    except TypeError as exc:
        raise WireError(f"{what} is not a contiguous bytes-like object ({type(frame).__name__}): {exc}") from None


def _parse_header(view: memoryview, max_body_bytes: int) -> Header:
    size = view.nbytes
    if size < HEADER_SIZE:
        raise WireError(f"truncated header: frame 0 has {size} bytes, the header needs {HEADER_SIZE}")
    magic, major, minor, flags, kind, fingerprint, body_len, attachments, _ = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a kvoffload frame")
    if major != LOCAL_MAJOR:
        remote = f"{major}.{minor}"
        raise SchemaMismatchError(
            f"peer speaks schema {remote}, this process speaks {SCHEMA_VERSION}: major versions differ",
            local_version=SCHEMA_VERSION,
            remote_version=remote,
        )
    unknown = flags & _CRITICAL_FLAGS & ~_KNOWN_FLAGS
    if unknown:
        raise WireError(f"unsupported header flags 0x{unknown:02x} (peer schema {major}.{minor})")
    if kind not in _DECODERS:
        raise WireError(
            f"unknown message kind {kind} (peer schema {major}.{minor}; schema {SCHEMA_VERSION} knows "
            f"{', '.join(f'{k}={n}' for k, n in _KIND_NAMES.items())})"
        )
    if body_len > max_body_bytes:
        raise WireError(f"body of {body_len} bytes exceeds max_body_bytes={max_body_bytes}")
    held = size - HEADER_SIZE
    if held < body_len:
        raise WireError(f"truncated body: header announces {body_len} bytes, frame 0 holds {held}")
    if held > body_len:
        raise WireError(f"frame 0 has {held - body_len} stray bytes after the {body_len}-byte body")
    return Header(major, minor, flags, kind, fingerprint, body_len, attachments)


def decode(frames: Sequence[Buffer], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Decoded:
    """Decode frames produced by `encode` (possibly by a peer on another minor version).

    Raises WireError (truncated, oversized, corrupted, unknown kind, wrong frame count) or
    SchemaMismatchError (another major version); never returns a partly decoded message. Packed array
    fields arrive as bytes (decoded natively, the fast path); their length is checked when they are viewed
    (`unpack_int64`, `Int64Array.from_buffer`), which raises WireError for a length that is not a whole
    number of items.
    """
    if not frames:
        raise WireError("no frames: a wire message has at least the header frame")
    view = _bytes_view(frames[0], "frame 0")
    header = _parse_header(view, max_body_bytes)
    if header.attachments != len(frames) - 1:
        raise WireError(f"header announces {header.attachments} attachment frame(s), received {len(frames) - 1}")
    try:
        message = _DECODERS[header.kind](view[HEADER_SIZE:])
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise WireError(f"corrupted {_KIND_NAMES[header.kind]} body from schema {header.version}: {exc}") from None
    attachments = tuple(_bytes_view(frame, f"attachment frame {i}") for i, frame in enumerate(frames[1:], 1))
    return Decoded(message, attachments, header)


# -- handshake ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HandshakeResult:
    """Outcome of a handshake: `fast` (identical schema) or `compatible` (same major, other minor/build)."""

    mode: Literal["fast", "compatible"]
    local: Hello
    remote: Hello

    @property
    def remote_version(self) -> str:
        """The peer's schema version."""
        return self.remote.schema_version


DEFAULT_ENGINE_ID: Final = "kvoffload"
"""The engine id of an engine whose snapshot names none (a Hello and a KV event batch always carry one)."""


def engine_id_of(snapshot: EngineSnapshot) -> str:
    """The engine id the snapshot's connector config names, or DEFAULT_ENGINE_ID when it names none.

    The scheduler and every worker derive it the same way, so their Hellos agree.
    """
    transfer = snapshot.engine_config.kv_transfer_config
    return (transfer.engine_id if transfer else None) or DEFAULT_ENGINE_ID


def make_hello(role: PeerRole | str, rank: int, world_size: int, engine_id: str) -> Hello:
    """This process's Hello: our schema version and fingerprint, role, rank, world size, engine id and pid.

    Raises ConfigError (a ValueError) for an unknown role, a negative rank, a world size below 1, a
    worker rank outside the world, or an empty engine id.
    """
    try:
        peer_role = PeerRole(role)
    except ValueError:
        raise ConfigError(f"role {role!r} is not one of {[r.value for r in PeerRole]}") from None
    check_int("rank", rank)
    check_int("world_size", world_size, 1)
    if peer_role is PeerRole.WORKER and rank >= world_size:
        raise ConfigError(f"worker rank {rank} is outside world_size {world_size}")
    if not isinstance(engine_id, str) or not engine_id:
        raise ConfigError(f"engine_id must be a non-empty str, got {engine_id!r}")
    return Hello(
        schema_version=SCHEMA_VERSION,
        fingerprint=SCHEMA_FINGERPRINT,
        role=peer_role,
        rank=rank,
        world_size=world_size,
        engine_id=engine_id,
        pid=os.getpid(),
    )


_VERSION_RE: Final = re.compile(r"([0-9]{1,3})\.([0-9]{1,3})")


def _major_of(version: str) -> int:
    # ASCII digits only, at most 3 each: str.isdigit() accepts "²" (which int() refuses), and int() of a
    # 5000-digit string raises ValueError (Python's int max str digits guard).
    match = _VERSION_RE.fullmatch(version) if isinstance(version, str) else None
    if match is None:
        text = str(version)
        shown = repr(text) if len(text) <= 40 else f"{text[:40]!r}... ({len(text)} characters)"
        raise WireError(f"peer sent a malformed schema version {shown} (expected major.minor, ASCII digits)")
    return int(match.group(1))


def check_hello(local: Hello, remote: Hello) -> HandshakeResult:
    """Decide how to talk to a peer from both Hellos.

    Same fingerprint -> `fast`; same major -> `compatible`; another major -> SchemaMismatchError naming
    both versions. A different engine id, two peers of the same role, or disagreeing world sizes -> WireError.
    """
    local_major = _major_of(local.schema_version)
    remote_major = _major_of(remote.schema_version)
    if local_major != remote_major:
        raise SchemaMismatchError(
            f"peer speaks schema {remote.schema_version}, this process speaks {local.schema_version}: "
            "major versions differ",
            local_version=local.schema_version,
            remote_version=remote.schema_version,
        )
    if remote.engine_id != local.engine_id:
        raise WireError(f"engine id mismatch: this process serves {local.engine_id!r}, peer {remote.engine_id!r}")
    if remote.role == local.role:
        raise WireError(f"both peers are {local.role.value}s (rank {local.rank} and rank {remote.rank})")
    if remote.world_size != local.world_size:
        raise WireError(f"world size mismatch: this process expects {local.world_size}, peer {remote.world_size}")
    mode: Literal["fast", "compatible"] = "fast" if remote.fingerprint == local.fingerprint else "compatible"
    return HandshakeResult(mode=mode, local=local, remote=remote)


def handshake(
    send: Callable[[list[bytes]], None],
    recv: Callable[[float], Sequence[bytes]],
    local: Hello,
    timeout: float,
) -> HandshakeResult:
    """Send our Hello, receive the peer's (waiting up to `timeout` seconds) and check both.

    Transport-agnostic: `send` ships a list of frames, `recv(timeout)` returns the next message's frames
    (and raises TimeoutError, say, when nothing arrives). Raises WireError or SchemaMismatchError when
    the peer cannot be talked to.
    """
    send([bytes(frame) for frame in encode(local)])
    decoded = decode(recv(timeout))
    remote = decoded.expect(Hello)
    if remote.schema_version != decoded.header.version:
        raise WireError(
            f"peer Hello says schema {remote.schema_version} but its envelope says {decoded.header.version}"
        )
    return check_hello(local, remote)
