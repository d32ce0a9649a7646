"""KV cache events for external indexers (a KV-aware router): a ZMQ publisher and a typed subscriber.

The scheduler's stored/removed events (:meth:`OffloadScheduler.take_events`: ``BlockStored`` / ``BlockRemoved``,
each carrying the medium it concerns, ``CPU`` for the host pool, ``STORAGE`` for disk tiers) are published as one
:class:`KVEventBatch` per call. On the socket each batch is a two-frame ZMQ message::

    frame 0   topic (default b"kvoffload.events")
    frame 1   the wire envelope: 24-byte header (magic, schema version, fingerprint, kind 5) + msgpack KVEventBatch

so the format is versioned like every kvoffload wire message (``kvoffload.wire``: a subscriber on another
minor version decodes through the compatible path). ``KVEventBatch.seq`` counts batches per publisher from 0
and ``engine_id`` names the publisher: a jump in ``seq`` tells a subscriber it missed batches.

Any ZMQ ``SUB`` / ``XSUB`` socket subscribes, over ``tcp://`` or ``ipc://``. No peer can block or grow the
publisher: ``publish()`` hands the batch to the publisher's thread, which gives each subscriber its own queue and
reads what peers send, speaking ZMTP 3.0 (NULL mechanism) on a ZMQ ``STREAM`` socket (an XPUB socket keeps every
subscription any peer sends and allocates any frame size a peer announces); it disconnects a peer that breaks
the protocol or a bound (frame size, subscriptions, bytes sent, handshake time, peers connected).

Memory is bounded in bytes. A subscriber's queue holds at most ``max_peer_bytes`` (and ``hwm`` batches), or its
equal share of ``max_queued_bytes`` when that is less: ``max_queued_bytes / (subscribers + 1)``, one share kept for
handshakes. A batch that does not fit is dropped for that subscriber only (it sees the gap; one that reads keeps
everything, nobody is disconnected for being slow), and queues over a share that shrinks lose their newest batches.
ZMQ holds at most 80 KiB more per connection (4 chunks of 16 KiB, and one being written), and batches waiting for
the thread are bounded by ``queue`` and by ``max_queued_bytes`` too. ``max_peers`` connections are kept; when they
are all open, a new one replaces a peer that has held no subscription for ``handshake_s`` (or is refused).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Sequence

import zmq

from kvoffload import wire
from kvoffload._events_subscriber import (
    DEFAULT_TOPIC,
    KVEventSubscriber,
    ReceivedBatch,
    SequenceGap,
    _check_endpoint,
)
from kvoffload._events_zmtp import _GREETING, _RETRY_S, _frame, _Peer
from kvoffload._generated import KVEvent, KVEventBatch
from kvoffload._ints import check_int
from kvoffload.errors import ConfigError, WireError

__all__ = ["DEFAULT_TOPIC", "KVEventPublisher", "KVEventSubscriber", "ReceivedBatch", "SequenceGap"]

MAX_INBOUND_BYTES = 1024  # the largest frame a publisher takes from a peer (or its topic's length + 64)
MAX_SUBSCRIPTIONS = 64  # default bound on the subscriptions one peer holds
MAX_PEERS = 1024  # default bound on the connections a publisher keeps at once
HANDSHAKE_S = 10.0  # default seconds a peer has to complete its ZMTP handshake (and then to subscribe)
PEER_BYTES = 4 << 20  # default bound on the bytes queued for one subscriber
QUEUED_BYTES = 128 << 20  # default bound on the bytes queued for all of them

_TURN = 256  # batches forwarded, or peer messages read, per turn of the publisher's loop: neither starves
_INBOUND_HWM = 16  # chunks (up to 8 KiB each) queued per peer before ZMQ stops reading it
_CHUNK, _PIPE_CHUNKS = 16 << 10, 4  # queued bytes go to ZMQ in chunks this big, this many at most per connection
_RETRY_MAX_S = 0.1  # the longest wait after ZMQ refused chunks (the peer reads slowly)
_queue_ids = itertools.count()
_log = logging.getLogger(__name__)


class KVEventPublisher:
    """Publishes KV event batches to ZMQ subscribers from a thread of its own (see the module docstring).

    ``endpoint`` is bound (``tcp://127.0.0.1:0`` picks a free port: read :attr:`endpoint`). ``queue`` batches may
    wait for the publisher's thread and ``hwm`` for each subscriber before new ones are dropped; the bytes
    queued are bounded by ``max_peer_bytes`` per subscriber and ``max_queued_bytes`` in all (:attr:`queued_bytes`).
    ``max_subscriptions`` bounds the subscriptions one peer may hold, ``max_peers`` the connections, and
    ``handshake_s`` the seconds a peer has to shake hands (and then to subscribe, once ``max_peers`` are open).
    One thread publishes. Counted: ``sent`` (batches handed to the thread), ``dropped`` (its queue was full, or it
    was closed), ``undelivered`` (batches one subscriber missed, its queue full: it sees the gap),
    ``peers_dropped`` (connections closed for breaking the protocol or a bound); ``subscribers`` is the number of
    connected subscribers to the topic.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        engine_id: str = wire.DEFAULT_ENGINE_ID,
        topic: bytes = DEFAULT_TOPIC,
        hwm: int = 10_000,
        queue: int = 10_000,
        max_subscriptions: int = MAX_SUBSCRIPTIONS,
        max_peer_bytes: int = PEER_BYTES,
        max_queued_bytes: int = QUEUED_BYTES,
        max_peers: int = MAX_PEERS,
        handshake_s: float = HANDSHAKE_S,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        _check_endpoint(endpoint, bind=True)
        for name, value in (
            ("hwm", hwm),
            ("queue", queue),
            ("max_subscriptions", max_subscriptions),
            ("max_peer_bytes", max_peer_bytes),
            ("max_queued_bytes", max_queued_bytes),
            ("max_peers", max_peers),
        ):
            check_int(name, value, 1)
        if isinstance(handshake_s, bool) or not isinstance(handshake_s, int | float) or not 0 < handshake_s < 1e9:
            raise ConfigError(f"handshake_s must be a finite number of seconds > 0, got {handshake_s!r}")
        if not isinstance(topic, bytes):
            raise ConfigError(f"topic must be bytes, got {topic!r}")
        self.engine_id, self.topic = engine_id, topic
        self._limits = (topic, max(MAX_INBOUND_BYTES, len(topic) + 64), max_subscriptions)
        self._hwm, self._max_peers, self._handshake_s = hwm, max_peers, float(handshake_s)
        self._max_peer_bytes, self._max_queued = max_peer_bytes, max_queued_bytes
        self._share = min(max_peer_bytes, max_queued_bytes)  # what one subscriber may have queued now
        ctx = context or zmq.Context.instance()
        self._stream, self._pull, self._push = (ctx.socket(t) for t in (zmq.STREAM, zmq.PULL, zmq.PUSH))
        for sock, high_water in ((self._stream, _PIPE_CHUNKS), (self._pull, queue), (self._push, queue)):
            sock.set_hwm(high_water)  # SNDHWM and RCVHWM
            sock.setsockopt(zmq.LINGER, 0)
        self._stream.setsockopt(zmq.RCVHWM, _INBOUND_HWM)
        try:
            self._stream.bind(endpoint)
        except zmq.ZMQError as exc:
            for sock in (self._stream, self._pull, self._push):
                sock.close(0)
            raise ConfigError(f"cannot bind KV events endpoint {endpoint!r}: {exc}") from None
        self._endpoint = self._stream.getsockopt_string(zmq.LAST_ENDPOINT)
        address = f"inproc://kvoffload-events-{os.getpid()}-{next(_queue_ids)}"
        self._pull.bind(address)
        self._push.connect(address)
        self._seq, self._closed, self._broken = 0, False, False  # _broken: the thread ended on an error
        self._handed = self._taken = 0  # bytes handed to the thread (by publish) and taken (by it): one writer each
        self._peers: dict[bytes, _Peer] = {}  # by ZMQ routing id
        self._sending: dict[bytes, _Peer] = {}  # the peers with bytes queued
        self._queued = 0  # bytes queued over all peers
        self._changed = threading.Condition()
        self.subscribers = self.sent = self.dropped = self.undelivered = self.peers_dropped = 0
        self._thread = threading.Thread(target=self._run, name="kvoffload-kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The bound endpoint, its port resolved (``tcp://127.0.0.1:41234`` after asking for port 0)."""
        return self._endpoint

    @property
    def next_seq(self) -> int:
        """Sequence number of the next batch."""
        return self._seq

    @property
    def queued_bytes(self) -> int:
        """Bytes queued for peers and not yet handed to ZMQ: at most ``max_queued_bytes``."""
        return self._queued

    def publish(self, events: Sequence[KVEvent]) -> bool:
        """Publish ``events`` as one batch, never blocking; False when dropped (its seq makes a gap) or empty."""
        if not events:
            return False
        batch = KVEventBatch(ts=time.time(), events=tuple(events), seq=self._seq, engine_id=self.engine_id)
        self._seq += 1
        try:
            if self._closed or self._broken:
                raise zmq.Again
            data = wire.encode(batch)[0]
            if self._handed - self._taken + len(data) > self._max_queued:  # the thread is behind by that much
                raise zmq.Again
            self._push.send(data, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped += 1
            return False
        self._handed += len(data)
        self.sent += 1
        return True

    def wait_for_subscriber(self, timeout_s: float) -> bool:
        """True once a subscriber to our topic is connected (it misses what came before), False after ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: self.subscribers > 0, max(0.0, timeout_s))

    def close(self) -> None:
        """Stop the thread and close the sockets (undelivered batches are discarded: events are best effort)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(zmq.ZMQError):  # a full queue: the thread sees _closed within a poll
            self._push.send(b"", flags=zmq.NOBLOCK)  # wakes the thread up, behind the batches handed over
        self._thread.join(5.0)
        self._push.close(0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        """The publisher's thread, the only user of the STREAM and PULL sockets."""
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._stream, zmq.POLLIN)
        swept = time.monotonic()
        try:
            while not self._closed or self._pull.poll(0):
                ready = dict(poller.poll(self._send_queued()))
                if self._stream in ready:
                    self._read_peers()
                if self._pull in ready and not self._forward():
                    break
                if time.monotonic() - swept > 1.0:
                    swept = time.monotonic()
                    for peer_id, peer in list(self._peers.items()):
                        if peer.closing or (not peer.ready and swept - peer.since > self._handshake_s):
                            self._drop(peer_id, "no ZMTP handshake")
        except zmq.ZMQError as exc:  # the context was terminated
            self._broken = True
            _log.error("KV events publisher on %s stopped: %s", self._endpoint, exc)
        finally:
            self._stream.close(0)
            self._pull.close(0)

    def _forward(self) -> bool:
        """Queue (one turn of) the batches handed over for every subscriber; False at close()'s empty frame."""
        for _ in range(_TURN):
            try:
                frame = self._pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            if len(frame) == 0:
                return False
            self._taken += len(frame)
            payload, now = _frame(self.topic, 1) + _frame(frame.bytes), time.monotonic()
            for peer_id, peer in self._peers.items():
                if not (peer.ready and peer.topics):
                    continue
                if not self._enqueue(peer_id, peer, payload, batch=True):
                    self.undelivered += 1  # its queue is full: only this subscriber misses the batch
                elif peer.queued >= _CHUNK and peer.retry_at <= now:  # a subscriber that reads keeps up in a burst
                    self._send_chunks(peer_id, peer, now)
        return True

    def _read_peers(self) -> None:
        """Handle (one turn of) connections, disconnections and what peers sent."""
        for _ in range(_TURN):
            try:
                peer_id, data = self._stream.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            peer = self._peers.get(peer_id)
            if peer is None and not data:  # a new connection
                if len(self._peers) >= self._max_peers:
                    self._drop_a_silent_peer()
                self._peers[peer_id] = peer = _Peer(self._limits)
                if len(self._peers) > self._max_peers:
                    self._drop(peer_id, f"more than max_peers={self._max_peers} connections")
                else:
                    self._enqueue(peer_id, peer, _GREETING, batch=False)
            elif peer is not None and not data:  # it disconnected
                self._release(peer)
                del self._peers[peer_id]
            elif peer is not None and not peer.closing:
                try:
                    reply = peer.feed(data)
                except WireError as exc:  # it broke the protocol or a bound
                    self._drop(peer_id, str(exc))
                    continue
                if reply:
                    self._enqueue(peer_id, peer, reply, batch=False)
        subscribers = sum(1 for p in self._peers.values() if p.ready and p.topics)
        if subscribers != self.subscribers:
            self._reshare(subscribers)
            with self._changed:
                self.subscribers = subscribers
                self._changed.notify_all()

    def _drop_a_silent_peer(self) -> None:
        """Make room for a new connection: drop the peer longest without a subscription, past ``handshake_s``."""
        now = time.monotonic()
        silent = min(((p.quiet, i) for i, p in self._peers.items() if not (p.topics or p.closing)), default=None)
        if silent is not None and now - silent[0] > self._handshake_s:
            why = f"no subscription for {self._handshake_s:g} s while max_peers={self._max_peers} are connected"
            self._drop(silent[1], why)

    def _reshare(self, subscribers: int) -> None:
        """Give every subscriber an equal share of ``max_queued_bytes``; queues over it lose their newest batches."""
        self._share = min(self._max_peer_bytes, self._max_queued // (subscribers + 1))
        for peer in self._sending.values():
            out = peer.out
            while peer.queued > self._share and len(out) > (peer.offset > 0) and out[-1][1]:
                self._account(peer, -len(out.pop()[0]))
                self.undelivered += 1

    def _enqueue(self, peer_id: bytes, peer: _Peer, data: bytes, *, batch: bool) -> bool:
        """Queue ``data`` for a peer; False (not queued) over ``hwm``, its share or ``max_queued_bytes``."""
        size = len(data)
        over_hwm = batch and len(peer.out) >= self._hwm
        if over_hwm or peer.queued + size > self._share or self._queued + size > self._max_queued:
            return False
        peer.out.append((data, batch))
        self._account(peer, size)
        self._sending[peer_id] = peer
        return True

    def _account(self, peer: _Peer, size: int) -> None:
        peer.queued += size
        self._queued += size

    def _release(self, peer: _Peer) -> None:
        """Forget what was queued for a peer that is gone or dropped."""
        self._account(peer, -peer.queued)
        peer.out.clear()
        peer.offset = 0

    def _send_queued(self) -> int:
        """Hand ZMQ what peers have queued, as far as it takes it; the milliseconds until the next retry (<= 100)."""
        now, wait = time.monotonic(), _RETRY_MAX_S
        for peer_id, peer in list(self._sending.items()):
            if peer.retry_at <= now:
                self._send_chunks(peer_id, peer, now)
            if peer.out:
                wait = min(wait, peer.retry_at - now)
            else:
                del self._sending[peer_id]
        return max(1, math.ceil(wait * 1000))

    def _send_chunks(self, peer_id: bytes, peer: _Peer, now: float) -> None:
        """Send a peer's queue in chunks until ZMQ refuses one (its queue is full: retried after a backoff)."""
        while peer.out:
            parts: list[memoryview] = []
            size, offset = 0, peer.offset
            for data, _ in peer.out:
                parts.append(memoryview(data)[offset : offset + _CHUNK - size])
                size, offset = size + len(parts[-1]), 0
                if size == _CHUNK:
                    break
            try:
                self._stream.send_multipart([peer_id, b"".join(parts)], flags=zmq.NOBLOCK)
            except zmq.Again:
                peer.retry_at, peer.backoff = now + peer.backoff, min(2 * peer.backoff, _RETRY_MAX_S)
                return
            except zmq.ZMQError:  # it is gone
                self._release(peer)
                return
            self._account(peer, -size)
            peer.backoff, size = _RETRY_S, size + peer.offset
            while size and size >= len(peer.out[0][0]):
                size -= len(peer.out.popleft()[0])
            peer.offset = size

    def _drop(self, peer_id: bytes, why: str) -> None:
        """Close a connection (an empty frame); a full queue refuses it: it gets no batch, the sweep tries again."""
        peer = self._peers[peer_id]
        if not peer.closing:
            self.peers_dropped += 1
            _log.debug("KV events on %s: disconnecting a peer: %s", self._endpoint, why)
        peer.closing, peer.topics = True, set()
        self._release(peer)
        try:
            self._stream.send_multipart([peer_id, b""], flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        except zmq.ZMQError:
            pass  # gone already
        del self._peers[peer_id]
