"""Wire messages over a ``multiprocessing`` connection: one envelope per message, frames sent in order.

Each message goes as a frame count followed by its frames (the wire envelope first, then any attachment such
as a tensor's bytes). Every receive is bounded by a timeout and every malformed input becomes a
:class:`~kvoffload.errors.WireError`; a peer that hangs up raises :class:`~kvoffload.errors.WorkerError`.
Memory is bounded per message before anything is read whole: frame 0 by the wire's body limit, the attachments
by a count and a total byte budget (``recv_bytes(maxlength)`` refuses a longer frame from its length prefix).
Sends are serialized by a lock, so a heartbeat thread and the main thread can share one channel. A send may
have a deadline: a peer that takes no byte for that long (a stopped process whose buffers are full) gets a
:class:`~kvoffload.errors.DeadlineError` instead of blocking the sender for as long as it is stopped.
"""

from __future__ import annotations

import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from kvoffload import wire
from kvoffload._generated import Message
from kvoffload._ints import check_int
from kvoffload.errors import DeadlineError, WireError, WorkerError

__all__ = ["DEFAULT_MAX_ATTACHMENTS", "DEFAULT_MAX_ATTACHMENT_BYTES", "Channel"]

_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("!i")  # multiprocessing's own frame length prefix (recv_bytes reads it)
_LONG_LENGTH = struct.Struct("!Q")  # after a -1 length: a frame of 2 GiB or more
DEFAULT_MAX_ATTACHMENTS = 8
"""Most attachment frames one received message may carry."""
DEFAULT_MAX_ATTACHMENT_BYTES = 64 * 1024 * 1024
"""Most attachment bytes (all frames together) one received message may carry."""


class Channel:
    """Sends and receives wire messages over one end of a ``multiprocessing.Pipe``.

    ``max_body_bytes`` bounds frame 0 (the header plus the message body), ``max_attachments`` and
    ``max_attachment_bytes`` the attachment frames of one received message.
    """

    def __init__(
        self,
        conn: Connection,
        *,
        max_body_bytes: int = wire.DEFAULT_MAX_BODY_BYTES,
        max_attachments: int = DEFAULT_MAX_ATTACHMENTS,
        max_attachment_bytes: int = DEFAULT_MAX_ATTACHMENT_BYTES,
    ) -> None:
        for name, value in (
            ("max_body_bytes", max_body_bytes),
            ("max_attachments", max_attachments),
            ("max_attachment_bytes", max_attachment_bytes),
        ):
            check_int(name, value, value_first=True)
        self.conn = conn
        self.max_body_bytes = max_body_bytes
        self.max_attachments = max_attachments
        self.max_attachment_bytes = max_attachment_bytes
        self._send_lock = threading.Lock()
        self._sock: socket.socket | None = None  # a duplicate of a socket connection, for non-blocking sends
        self._cut = False  # a send with a deadline stopped mid-message: the stream can no longer be framed

    def send(self, message: Message, attachments: Sequence[wire.Buffer] = (), *, timeout: float | None = None) -> None:
        """Encode and send one message; raises WorkerError if the peer is gone.

        With ``timeout``, DeadlineError (a TimeoutError) when the peer takes no byte for ``timeout`` seconds (a
        stopped peer); a message cut off that way leaves the channel unusable (later sends raise WorkerError).
        """
        frames = wire.encode(message, attachments)
        try:
            with self._send_lock:
                if self._cut:
                    raise WorkerError(f"cannot send {type(message).__name__}: an earlier send timed out mid-message")
                if timeout is None:
                    self.conn.send_bytes(_COUNT.pack(len(frames)))
                    for frame in frames:
                        self.conn.send_bytes(frame)
                else:
                    self._send_within([_COUNT.pack(len(frames)), *frames], timeout, type(message).__name__)
        except DeadlineError:
            raise
        except (BrokenPipeError, ConnectionError, EOFError, OSError) as exc:
            raise WorkerError(f"peer hung up while sending {type(message).__name__}: {exc}") from None

    def _send_within(self, frames: Sequence[bytes | memoryview], timeout: float, what: str) -> None:
        """Write ``frames`` as ``send_bytes`` frames them, never blocking: wait for room at most ``timeout``
        seconds at a time (any byte taken restarts the wait)."""
        fd = self.conn.fileno()
        if self._sock is None and stat.S_ISSOCK(os.fstat(fd).st_mode):
            self._sock = socket.socket(fileno=os.dup(fd))
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        sent = 0
        for frame in frames:
            body = memoryview(frame).cast("B")
            n = body.nbytes
            length = _LENGTH.pack(n) if n <= 0x7FFFFFFF else _LENGTH.pack(-1) + _LONG_LENGTH.pack(n)
            for view in (memoryview(length), body):
                idle_until = time.monotonic() + timeout
                while view:
                    written = self._write_some(fd, view, poller)
                    if written:
                        view, sent = view[written:], sent + written
                        idle_until = time.monotonic() + timeout
                        continue
                    left = idle_until - time.monotonic()
                    if left <= 0 or not poller.poll(max(1, int(left * 1000))):
                        self._cut = sent > 0
                        raise DeadlineError(f"the peer took no byte of {what} for {timeout:g}s")

    def _write_some(self, fd: int, view: memoryview, poller: select.poll) -> int:
        """Write what fits now of ``view`` (0 when nothing does): a socket takes what it can without blocking, a
        pipe that polls writable has room for ``PIPE_BUF`` bytes."""
        try:
            if self._sock is not None:
                return self._sock.send(view, socket.MSG_DONTWAIT)
            return os.write(fd, view[: select.PIPE_BUF]) if poller.poll(0) else 0
        except BlockingIOError:
            return 0

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send pre-built frames as one message (tests use this to inject corrupted frames)."""
        with self._send_lock:
            self.conn.send_bytes(_COUNT.pack(len(frames)))
            for frame in frames:
                self.conn.send_bytes(frame)

    def recv(self, timeout: float | None) -> wire.Decoded:
        """Receive and decode one message within ``timeout`` seconds (None: wait forever).

        Raises DeadlineError (a TimeoutError) when nothing arrives in time, WorkerError when the peer hung up,
        and WireError for malformed or oversized frames (naming the limit); after an oversized frame the
        connection is unusable, as its stream can no longer be framed.
        """
        head = self._recv_frame(timeout, 64, what="frame count")
        if len(head) != _COUNT.size:
            raise WireError(f"frame count header has {len(head)} bytes, expected {_COUNT.size}")
        (count,) = _COUNT.unpack(head)
        if not 1 <= count <= 1 + self.max_attachments:
            raise WireError(
                f"message announces {count} frames; expected 1..{1 + self.max_attachments} "
                f"(the envelope plus at most max_attachments={self.max_attachments})"
            )
        first_limit = wire.HEADER_SIZE + self.max_body_bytes
        frames = [
            self._recv_frame(timeout, first_limit, what=f"frame 1/{count} (limit max_body_bytes={self.max_body_bytes})")
        ]
        budget = self.max_attachment_bytes
        for i in range(1, count):
            what = f"frame {i + 1}/{count} (attachments over max_attachment_bytes={self.max_attachment_bytes})"
            frame = self._recv_frame(timeout, budget, what=what)
            budget -= len(frame)
            frames.append(frame)
        return wire.decode(frames, max_body_bytes=self.max_body_bytes)

    def _recv_frame(self, timeout: float | None, limit: int, *, what: str) -> bytes:
        try:
            ready = timeout is None or self.conn.poll(timeout)
            if ready:
                return self.conn.recv_bytes(limit)
        except (EOFError, ConnectionError, BrokenPipeError) as exc:
            raise WorkerError(f"peer hung up ({what}): {exc or 'EOF'}") from None
        except OSError as exc:
            # recv_bytes refuses a frame longer than `limit` from its length prefix, before reading it, and
            # leaves the connection unreadable.
            raise WireError(f"{what}: frame is larger than {limit} bytes or unreadable: {exc}") from None
        raise DeadlineError(f"no {what} within {timeout}s")

    def close(self) -> None:
        """Close the connection."""
        if self._sock is not None:
            self._sock.close()
        self.conn.close()
