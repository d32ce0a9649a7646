"""KV cache events for external indexers (a KV-aware router): a ZMQ publisher and a typed subscriber.

The scheduler's stored/removed events (:meth:`OffloadScheduler.take_events`: ``BlockStored`` / ``BlockRemoved``,
each carrying the medium it concerns, ``CPU`` for the host pool, ``STORAGE`` for disk tiers) are published as one
:class:`KVEventBatch` per call. On the socket each batch is a two-frame ZMQ message::

    frame 0   topic (default b"kvoffload.events")
    frame 1   the wire envelope: 24-byte header (magic, schema version, fingerprint, kind 5) + msgpack KVEventBatch

so the format is versioned like every kvoffload wire message (``kvoffload.wire``: a subscriber on another
minor version decodes through the compatible path). ``KVEventBatch.seq`` counts batches per publisher from 0
and ``engine_id`` names the publisher: a jump in ``seq`` tells a subscriber it missed batches.

The publisher never blocks the engine: it is an XPUB socket with ``XPUB_NODROP`` and a send high-water mark,
sending without blocking, so a batch a slow subscriber cannot take is dropped and counted (its sequence number
is used anyway, so the subscriber sees the gap).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvoffload import wire
from kvoffload._generated import KVEvent, KVEventBatch
from kvoffload._ints import check_int
from kvoffload.errors import ConfigError, WireError

__all__ = ["DEFAULT_TOPIC", "KVEventPublisher", "KVEventSubscriber", "ReceivedBatch", "SequenceGap"]

DEFAULT_TOPIC = b"kvoffload.events"
"""Topic frame of every published batch."""


def _check_endpoint(endpoint: str) -> str:
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ConfigError(f"KV events endpoint must be a ZMQ endpoint like 'tcp://127.0.0.1:5557', got {endpoint!r}")
    return endpoint


class KVEventPublisher:
    """Publishes KV event batches on a bound ZMQ XPUB socket (see module docstring).

    ``endpoint`` is bound (``tcp://127.0.0.1:0`` picks a free port: read :attr:`endpoint`); ``hwm`` is the number
    of batches queued per subscriber before new ones are dropped.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        engine_id: str = wire.DEFAULT_ENGINE_ID,
        topic: bytes = DEFAULT_TOPIC,
        hwm: int = 10_000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        _check_endpoint(endpoint)
        check_int("hwm", hwm, 1)
        if not isinstance(topic, bytes):
            raise ConfigError(f"topic must be bytes, got {topic!r}")
        self.engine_id = engine_id
        self.topic = topic
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise ConfigError(f"cannot bind KV events endpoint {endpoint!r}: {exc}") from None
        last = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = last.decode() if isinstance(last, bytes) else str(last)
        self._seq = 0
        self.subscriptions = 0
        """Subscriptions seen so far (minus unsubscriptions): how many subscribers listen, as far as XPUB tells."""
        self.sent = 0
        """Batches handed to ZMQ."""
        self.dropped = 0
        """Batches dropped because a subscriber's queue was full."""

    @property
    def next_seq(self) -> int:
        """Sequence number of the next batch."""
        return self._seq

    def publish(self, events: Sequence[KVEvent]) -> bool:
        """Publish ``events`` as one batch without blocking; False when it was dropped (or ``events`` is empty).

        An empty list publishes nothing and uses no sequence number.
        """
        if not events:
            return False
        batch = KVEventBatch(ts=time.time(), events=tuple(events), seq=self._seq, engine_id=self.engine_id)
        self._seq += 1
        frame = wire.encode(batch)[0]
        try:
            self._sock.send_multipart([self.topic, frame], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        self._drain_subscriptions()
        return True

    def _drain_subscriptions(self, timeout_ms: int = 0) -> None:
        """Read the (un)subscribe messages XPUB queues for us (first byte 1 / 0), so they never pile up."""
        sock = self._sock
        while sock.poll(timeout_ms, zmq.POLLIN):
            message = sock.recv(zmq.NOBLOCK)
            if message[:1] == b"\x01":
                self.subscriptions += 1
            elif message[:1] == b"\x00":
                self.subscriptions -= 1
            timeout_ms = 0

    def wait_for_subscriber(self, timeout_s: float) -> bool:
        """Wait until at least one subscriber has subscribed (True), or ``timeout_s`` passed (False).

        A ZMQ subscriber that just connected misses what is published before its subscription arrives; an
        application that must not lose the first batches waits here first.
        """
        deadline = time.monotonic() + timeout_s
        while self.subscriptions <= 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._drain_subscriptions(max(1, int(left * 1000)))
        return True

    def close(self) -> None:
        """Close the socket (undelivered batches are discarded: events are best effort)."""
        self._sock.close(0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    (counted in :attr:`restarts`, not a gap). The first batch seen from a publisher starts its count.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: bytes = DEFAULT_TOPIC,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        hwm: int = 100_000,
    ) -> None:
        _check_endpoint(endpoint)
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise ConfigError(f"cannot connect to KV events endpoint {endpoint!r}: {exc}") from None
        self._next: dict[str, int] = {}
        self.gaps: list[SequenceGap] = []
        """Every gap seen, in order."""
        self.restarts = 0
        self.received = 0

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
