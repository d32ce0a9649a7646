"""The publisher's side of ZMTP 3.0 for one peer: framing, the handshake, subscriptions and the inbound byte rate."""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, field

from kvoffload.errors import WireError

_RETRY_S = 0.001  # first wait after ZMQ refused a chunk (the peer reads slowly)
_RATE_BYTES, _BURST_BYTES = 4096, 64 << 10  # what a peer may send per second, and at once


# ZMTP 3.0 (rfc.zeromq.org/spec/23), NULL mechanism: what a ZMQ SUB socket speaks to a PUB socket.
def _frame(data: bytes, flags: int = 0) -> bytes:
    """One ZMTP frame: flags (1 more, 2 long, 4 command), a 1- or 8-byte size, the body."""
    if len(data) > 255:
        return bytes([flags | 2]) + len(data).to_bytes(8, "big") + data
    return bytes([flags, len(data)]) + data


_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x01" + bytes(31)
_READY = _frame(b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB", 4)  # a command: name, then metadata
_SUB_TYPE = re.compile(rb"\x0bsocket-type\x00\x00\x00(?:\x03SUB|\x04XSUB)", re.IGNORECASE)  # in a peer's READY


@dataclass(eq=False)
class _Peer:
    """One connection's ZMTP state: bytes not parsed yet, its handshake, its subscriptions, what it is sent."""

    limits: tuple[bytes, int, int]  # our topic, the largest frame taken, max_subscriptions
    since: float = field(default_factory=time.monotonic)
    quiet: float = field(default_factory=time.monotonic)  # since when it holds no subscription to our topic
    at: float = field(default_factory=time.monotonic)  # when it last sent
    budget: float = _BURST_BYTES  # bytes it may send now (a token bucket)
    buf: bytearray = field(default_factory=bytearray)
    greeted: bool = False
    ready: bool = False
    topics: set[bytes] = field(default_factory=set)  # its subscriptions that match our topic
    others: int = 0  # its other subscriptions, only counted
    closing: bool = False  # dropped, but its connection is not closed yet
    out: deque[tuple[bytes, bool]] = field(default_factory=deque)  # to send it: (ZMTP bytes, whether a batch)
    offset: int = 0  # bytes of out[0] sent already
    queued: int = 0  # bytes in out not sent yet
    retry_at: float = 0.0  # when to try again after ZMQ refused a chunk
    backoff: float = _RETRY_S

    def feed(self, data: bytes) -> bytes:
        """Take bytes the peer sent; return what to answer. A :class:`WireError` means: disconnect it."""
        now, buf, out = time.monotonic(), self.buf, b""
        self.budget = min(_BURST_BYTES, self.budget + (now - self.at) * _RATE_BYTES) - len(data)
        if self.budget < 0:
            raise WireError(f"sending over {_RATE_BYTES} bytes/s (a subscriber sends a few bytes)")
        self.at = now
        buf.extend(data)
        if not self.greeted:
            if buf[0] != 0xFF or (len(buf) >= 10 and not buf[9] & 1):
                raise WireError("not a ZMTP peer")
            if len(buf) < 64:
                return out
            if buf[10] < 3 or bytes(buf[12:32]).rstrip(b"\x00") != b"NULL":
                raise WireError("not a ZMTP 3 peer with the NULL mechanism")
            del buf[:64]
            self.greeted, out = True, _READY
        while len(buf) >= 2:
            flags, head = buf[0], 9 if buf[0] & 2 else 2
            if flags & ~0x07:
                raise WireError(f"bad frame flags {flags:#x}")
            size = int.from_bytes(buf[1:head], "big") if len(buf) >= head else 0
            if size > self.limits[1]:
                raise WireError(f"a {size}-byte frame exceeds the {self.limits[1]}-byte bound")
            if len(buf) < head + size:
                break
            body = bytes(buf[head : head + size])
            del buf[: head + size]
            if flags & 4:
                out += self._command(body)
            elif not self.ready:
                raise WireError("a message before READY")
            elif body[:1] in (b"\x00", b"\x01"):
                self._subscribe(body[:1] == b"\x01", body[1:])
        return out

    def _command(self, body: bytes) -> bytes:
        name = body[1 : 1 + body[0]] if body else b""
        rest = body[1 + len(name) :]
        if not self.ready:
            if name != b"READY" or not _SUB_TYPE.search(rest):
                raise WireError("a READY command from a SUB or XSUB socket was expected")
            self.ready = True
        elif name == b"PING":  # a heartbeat: answered with its context
            return _frame(b"\x04PONG" + rest[2:18], 4)
        elif name in (b"SUBSCRIBE", b"CANCEL"):  # as ZMTP 3.1 peers send them
            self._subscribe(name == b"SUBSCRIBE", rest)
        return b""

    def _subscribe(self, on: bool, prefix: bytes) -> None:
        topic, _, max_subscriptions = self.limits
        if topic.startswith(prefix):
            subscribed = bool(self.topics)
            (self.topics.add if on else self.topics.discard)(prefix)
            if subscribed and not self.topics:
                self.quiet = time.monotonic()
        else:
            self.others = max(0, self.others + (1 if on else -1))
        if len(self.topics) + self.others > max_subscriptions:
            raise WireError(f"more than max_subscriptions={max_subscriptions} subscriptions")
