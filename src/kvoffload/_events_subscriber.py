"""The KV-event subscriber (a ZMQ SUB socket and the generated codec) and the endpoint check both sides use."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from kvoffload import wire
from kvoffload._generated import KVEvent, KVEventBatch
from kvoffload._ints import check_int
from kvoffload.errors import ConfigError, WireError

__all__ = ["DEFAULT_TOPIC", "SUBSCRIBER_MESSAGE_BYTES", "KVEventSubscriber", "ReceivedBatch", "SequenceGap"]

DEFAULT_TOPIC = b"kvoffload.events"
"""Topic frame of every published batch."""
SUBSCRIBER_MESSAGE_BYTES = 64 << 20  # default bound on a frame a KVEventSubscriber accepts


def _check_endpoint(endpoint: str, *, bind: bool) -> str:
    """``endpoint`` if it is a ZMQ endpoint; a tcp one needs a port in 1..65535 (0 or * too, to bind any free)."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ConfigError(f"KV events endpoint must be a ZMQ endpoint like 'tcp://127.0.0.1:5557', got {endpoint!r}")
    transport, _, address = endpoint.partition("://")
    if bind and transport not in ("tcp", "ipc"):
        raise ConfigError(f"KV events endpoint {endpoint!r}: a publisher binds tcp:// or ipc://")
    port, low = address.rpartition(":")[2], (0 if bind else 1)  # [source;]host:port, host maybe [IPv6]
    valid = (bind and port == "*") or (port.isascii() and port.isdigit() and low <= int(port) < 65536)
    if transport == "tcp" and not valid:
        free = ", or 0 or * for any free one" if bind else ""
        raise ConfigError(f"KV events endpoint {endpoint!r}: the port must be from 1 to 65535{free}, got {port!r}")
    return endpoint


@dataclass(frozen=True, slots=True)
class SequenceGap:
    """Batches of one publisher a subscriber never received: ``expected`` up to ``received - 1``."""

    engine_id: str
    expected: int
    received: int

    @property
    def missed(self) -> int:
        """How many batches are missing."""
        return self.received - self.expected


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """One decoded batch and the gap (if any) just before it."""

    batch: KVEventBatch
    gap: SequenceGap | None

    @property
    def events(self) -> tuple[KVEvent, ...]:
        """The batch's events, in order."""
        return self.batch.events


class KVEventSubscriber:
    """Connects a ZMQ SUB socket to a publisher, decodes batches with the generated codec and reports gaps.

    Sequence numbers are tracked per ``engine_id``; a number lower than expected means the publisher restarted
    (counted in :attr:`restarts`, not a gap). The first batch seen from a publisher starts its count. A frame
    over ``max_message_bytes`` makes ZMQ drop the connection (it reconnects; the batch shows as a gap).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: bytes = DEFAULT_TOPIC,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        hwm: int = 100_000,
        max_message_bytes: int = SUBSCRIBER_MESSAGE_BYTES,
    ) -> None:
        _check_endpoint(endpoint, bind=False)
        check_int("hwm", hwm, 1), check_int("max_message_bytes", max_message_bytes, 1)
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        for option, value in ((zmq.RCVHWM, hwm), (zmq.MAXMSGSIZE, max_message_bytes), (zmq.LINGER, 0)):
            self._sock.setsockopt(option, value)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise ConfigError(f"cannot connect to KV events endpoint {endpoint!r}: {exc}") from None
        self._next: dict[str, int] = {}
        self.gaps: list[SequenceGap] = []
        """Every gap seen, in order."""
        self.restarts = self.received = 0

    @property
    def missed(self) -> int:
        """Total batches missed over all gaps."""
        return sum(g.missed for g in self.gaps)

    def recv(self, timeout_s: float | None = None) -> ReceivedBatch | None:
        """The next batch, or None when nothing arrives within ``timeout_s`` (None: wait forever).

        A message that is not a well-formed batch raises :class:`WireError` (or ``SchemaMismatchError``).
        """
        timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            return None
        frames = self._sock.recv_multipart(copy=True)
        if len(frames) != 2:
            raise WireError(f"a KV event message has 2 frames (topic, batch), got {len(frames)}")
        batch = wire.decode([frames[1]]).expect(KVEventBatch)
        self.received += 1
        expected = self._next.get(batch.engine_id)
        gap = None
        if expected is not None:
            if batch.seq > expected:
                gap = SequenceGap(batch.engine_id, expected, batch.seq)
                self.gaps.append(gap)
            elif batch.seq < expected:
                self.restarts += 1
        self._next[batch.engine_id] = batch.seq + 1
        return ReceivedBatch(batch, gap)

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
