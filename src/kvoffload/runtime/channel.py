"""Wire messages over a ``multiprocessing`` connection: one envelope per message, frames sent in order.

Each message goes as a frame count followed by its frames (the wire envelope first, then any attachment such
as a tensor's bytes). Every receive is bounded by a timeout and every malformed input becomes a
:class:`~kvoffload.errors.WireError`; a peer that hangs up raises :class:`~kvoffload.errors.WorkerError`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from multiprocessing.connection import Connection

from .. import wire
from .._generated import Message
from ..errors import WireError, WorkerError

__all__ = ["Channel"]

_COUNT = struct.Struct("<I")
MAX_FRAMES = 64
"""Most frames one message may have (the envelope plus attachments)."""


class Channel:
    """Sends and receives wire messages over one end of a ``multiprocessing.Pipe``."""

    def __init__(self, conn: Connection, *, max_frame_bytes: int = 1 << 30) -> None:
        self.conn = conn
        self.max_frame_bytes = max_frame_bytes

    def send(self, message: Message, attachments: Sequence[bytes | bytearray | memoryview] = ()) -> None:
        """Encode and send one message; raises WorkerError if the peer is gone."""
        frames = wire.encode(message, attachments)
        try:
            self.conn.send_bytes(_COUNT.pack(len(frames)))
            for frame in frames:
                self.conn.send_bytes(frame)
        except (BrokenPipeError, ConnectionError, EOFError, OSError) as exc:
            raise WorkerError(f"peer hung up while sending {type(message).__name__}: {exc}") from None

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send pre-built frames as one message (tests use this to inject corrupted frames)."""
        self.conn.send_bytes(_COUNT.pack(len(frames)))
        for frame in frames:
            self.conn.send_bytes(frame)

    def recv(self, timeout: float | None) -> wire.Decoded:
        """Receive and decode one message within ``timeout`` seconds (None: wait forever).

        Raises TimeoutError when nothing arrives in time, WorkerError when the peer hung up, and WireError
        for malformed frames (the connection stays usable only if the peer keeps framing intact).
        """
        head = self._recv_frame(timeout, what="frame count")
        if len(head) != _COUNT.size:
            raise WireError(f"frame count header has {len(head)} bytes, expected {_COUNT.size}")
        (count,) = _COUNT.unpack(head)
        if not 1 <= count <= MAX_FRAMES:
            raise WireError(f"message announces {count} frames; expected 1..{MAX_FRAMES}")
        frames = [self._recv_frame(timeout, what=f"frame {i + 1}/{count}") for i in range(count)]
        return wire.decode(frames)

    def _recv_frame(self, timeout: float | None, *, what: str) -> bytes:
        try:
            ready = timeout is None or self.conn.poll(timeout)
            if ready:
                return self.conn.recv_bytes(self.max_frame_bytes)
        except (EOFError, ConnectionError, BrokenPipeError) as exc:
            raise WorkerError(f"peer hung up ({what}): {exc or 'EOF'}") from None
        except OSError as exc:
            # recv_bytes raises OSError for a frame above max_frame_bytes and closes the connection.
            raise WireError(f"{what} is larger than {self.max_frame_bytes} bytes or unreadable: {exc}") from None
        raise TimeoutError(f"no {what} within {timeout}s")

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()
