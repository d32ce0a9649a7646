"""The KV event publisher against bad peers (issue 22, item 3), over real sockets: a subscriber that stops reading,
a raw ZMTP client announcing a huge frame, one sending unique subscriptions or junk without end, ports outside
1..65535. Every peer here is bounded (a byte count, a deadline) and closed; memory is this process's RSS."""

from __future__ import annotations

import contextlib
import inspect
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvoffload import BlockStored, ConfigError
from kvoffload._events import DEFAULT_TOPIC, KVEventPublisher, KVEventSubscriber

EVENTS = [BlockStored(block_hashes=tuple(i.to_bytes(32, "big") for i in range(30)))]  # about 1 KiB a batch
MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


needs_proc = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")


def _frame(data: bytes, flags: int = 0) -> bytes:
    if len(data) > 255:
        return bytes([flags | 2]) + len(data).to_bytes(8, "big") + data
    return bytes([flags, len(data)]) + data


def _read(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        more = sock.recv(n - len(got))
        if not more:
            raise ConnectionError("closed during the handshake")
        got += more
    return got


def _zmtp_peer(endpoint: str, socket_type: bytes = b"SUB") -> socket.socket:
    """A raw TCP client that shakes hands as a ZMQ SUB does (ZMTP 3.0, NULL mechanism); it sends what a test says."""
    port = int(endpoint.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
    _read(sock, 64)  # the publisher's greeting
    metadata = b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    sock.sendall(_frame(b"\x05READY" + metadata, 4))
    _read(sock, _read(sock, 2)[1])  # its READY command
    return sock


def _hung_up(sock: socket.socket, timeout_s: float = 10.0) -> bool:
    """Whether the other side closes ``sock`` within ``timeout_s`` (what it sends meanwhile is discarded)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset
        pass
    return True


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _connected(pub: KVEventPublisher, *subs: KVEventSubscriber) -> None:
    """Publish probes until every subscriber received the latest one, and drain them."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        assert pub.publish(EVENTS)
        latest = pub.next_seq - 1
        seen = []
        for sub in subs:
            last = -1
            while (got := sub.recv(timeout_s=0.05)) is not None:
                last = got.batch.seq
            seen.append(last == latest)
        if all(seen):
            return
    raise AssertionError("the subscribers did not connect within 10 s")


def _still_serves(pub: KVEventPublisher, sub: KVEventSubscriber) -> None:
    assert pub.publish(EVENTS)
    last = pub.next_seq - 1
    while (got := sub.recv(timeout_s=10.0)) is not None and got.batch.seq != last:
        pass
    assert got is not None, "the subscriber no longer receives"


def test_a_stalled_subscriber_costs_the_others_nothing_and_sees_its_losses_as_a_gap(tmp_path: Path) -> None:
    n = 5000
    with (
        KVEventPublisher(f"ipc://{tmp_path}/ev", hwm=1000) as pub,
        KVEventSubscriber(pub.endpoint, hwm=1) as stalled,
        KVEventSubscriber(pub.endpoint) as reader,
    ):
        _connected(pub, stalled, reader)
        first, reader_missed, stalled_missed = pub.next_seq, reader.missed, stalled.missed
        outcomes: list[bool] = []
        seqs: list[int] = []
        # publish in steps the reader takes in (a reader that lags behind may lose batches too); stalled reads none
        while len(outcomes) < n and len(seqs) == len(outcomes):
            outcomes += [pub.publish(EVENTS) for _ in range(100)]
            while len(seqs) < len(outcomes) and (got := reader.recv(timeout_s=5.0)) is not None:
                seqs.append(got.batch.seq)
        # the reader got every batch, as if nobody were stalled
        assert outcomes.count(False) == 0 and pub.dropped == 0
        assert seqs == list(range(first, first + n)) and reader.missed == reader_missed

        # the stalled subscriber lost what did not fit its queue, and only that, and the next batch tells it so
        kept = []
        while (got := stalled.recv(timeout_s=0.5)) is not None:
            kept.append(got.batch.seq)
        assert kept == sorted(kept) and set(kept) <= set(seqs) and len(kept) < n, "its queue never filled"
        assert pub.publish(EVENTS)
        got = stalled.recv(timeout_s=10.0)
        assert got is not None and got.gap is not None and got.gap.received == first + n
        assert stalled.missed - stalled_missed == n - len(kept) == pub.undelivered  # the probes all fitted


@needs_proc
def test_a_peer_announcing_a_huge_frame_is_cut_off_before_memory_grows() -> None:
    with KVEventPublisher("tcp://127.0.0.1:0") as pub, KVEventSubscriber(pub.endpoint) as sub:
        _connected(pub, sub)
        peer = _zmtp_peer(pub.endpoint)
        with closing(peer):
            before = peak = _rss()
            chunk = bytes(MIB)
            try:
                peer.sendall(b"\x02" + (256 * MIB).to_bytes(8, "big") + b"\x01")  # a 256 MiB subscription
                for _ in range(64):  # and 64 MiB of it
                    peer.sendall(chunk)
                    peak = max(peak, _rss())
            except OSError:
                pass  # the publisher hung up
            peak = max(peak, _rss())
            assert peak - before < 32 * MIB, f"RSS grew {(peak - before) / MIB:.0f} MiB"
            assert _hung_up(peer)
        _still_serves(pub, sub)


@needs_proc
def test_unique_subscriptions_cannot_grow_the_publisher() -> None:
    flood = b"".join(_frame(b"\x01%08d" % i + b"t" * 190) for i in range(20_000))  # 20,000 topics, 4 MB
    with KVEventPublisher("tcp://127.0.0.1:0") as pub, KVEventSubscriber(pub.endpoint) as sub:
        _connected(pub, sub)
        peer = _zmtp_peer(pub.endpoint)
        with closing(peer):
            before = _rss()

            def send() -> None:
                with contextlib.suppress(OSError):  # the publisher hung up
                    peer.sendall(flood)

            thread = threading.Thread(target=send)
            thread.start()
            deadline = time.monotonic() + 20.0
            while thread.is_alive() and time.monotonic() < deadline:  # the engine goes on publishing meanwhile
                pub.publish(EVENTS)
                time.sleep(0.001)
            thread.join(10.0)
            assert not thread.is_alive()
            assert _rss() - before < 32 * MIB, f"RSS grew {(_rss() - before) / MIB:.0f} MiB"
            assert _hung_up(peer)
        _still_serves(pub, sub)  # the well-behaved subscriber kept its connection


@pytest.mark.timeout(60)  # the hang guard: publish() used to drain what peers send, for as long as they sent
def test_publish_never_waits_on_what_peers_send() -> None:
    junk = _frame(b"\x02junk") * 10_000
    stop, flooding = threading.Event(), threading.Event()
    with KVEventPublisher("tcp://127.0.0.1:0") as pub, KVEventSubscriber(pub.endpoint) as sub:
        _connected(pub, sub)

        def flood() -> None:
            while not stop.is_set():  # one raw peer after another, each sending junk until cut off
                try:
                    with closing(_zmtp_peer(pub.endpoint)) as peer:
                        while not stop.is_set():
                            peer.sendall(junk)
                            flooding.set()
                except OSError:
                    pass

        thread = threading.Thread(target=flood)
        thread.start()
        try:
            assert flooding.wait(10.0)
            for _ in range(2000):
                pub.publish(EVENTS)
        finally:
            stop.set()
            thread.join(30.0)
        assert not thread.is_alive()
        _still_serves(pub, sub)


def test_ports_outside_1_to_65535_are_config_errors_and_the_bound_endpoint_is_a_property() -> None:
    for bad in ("tcp://127.0.0.1:99999", "tcp://127.0.0.1:65536", "tcp://127.0.0.1:-1", "tcp://127.0.0.1"):
        with pytest.raises(ConfigError, match=re.escape(bad)):
            KVEventPublisher(bad)
    with pytest.raises(ConfigError, match=re.escape("tcp://127.0.0.1:0")):
        KVEventSubscriber("tcp://127.0.0.1:0")  # nobody listens on port 0
    with pytest.raises(ConfigError, match="inproc://x"):
        KVEventPublisher("inproc://x")  # a publisher binds tcp or ipc
    assert isinstance(inspect.getattr_static(KVEventPublisher, "endpoint"), property)
    with KVEventPublisher("tcp://127.0.0.1:0") as pub:
        host, port = pub.endpoint.rsplit(":", 1)
        assert host == "tcp://127.0.0.1" and 1 <= int(port) <= 65535
        with pytest.raises(ConfigError, match="cannot bind"):
            KVEventPublisher("tcp://127.0.0.1:" + port)  # a real port, taken


def _events_of(monitor: zmq.Socket[bytes]) -> Iterator[int]:
    while monitor.poll(0):
        yield int(recv_monitor_message(monitor)["event"])


def test_zmq_subscribers_with_heartbeats_and_xsub_sockets_are_served() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with KVEventPublisher("tcp://127.0.0.1:0") as pub:
        sub = ctx.socket(zmq.SUB)
        xsub = ctx.socket(zmq.XSUB)
        try:
            sub.setsockopt(zmq.HEARTBEAT_IVL, 50)  # ZMTP pings every 50 ms, and hangs up without an answer
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 200)
            sub.setsockopt(zmq.SUBSCRIBE, b"kvoffload")
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sub.connect(pub.endpoint)
            xsub.connect(pub.endpoint)
            xsub.send(b"\x01" + DEFAULT_TOPIC)
            assert pub.wait_for_subscriber(10.0)
            got = {"sub": 0, "xsub": 0}
            deadline = time.monotonic() + 1.5  # several heartbeat timeouts
            while time.monotonic() < deadline:
                pub.publish(EVENTS)
                for name, sock in (("sub", sub), ("xsub", xsub)):
                    while sock.poll(20):
                        frames = sock.recv_multipart()
                        got[name] += frames[0] == DEFAULT_TOPIC and len(frames) == 2
            seen = list(_events_of(monitor))
            assert got["sub"] > 5 and got["xsub"] > 5, got
            assert zmq.EVENT_DISCONNECTED not in seen and seen.count(zmq.EVENT_HANDSHAKE_SUCCEEDED) == 1
            sub.disable_monitor()
            monitor.close(0)
        finally:
            sub.close(0)
            xsub.close(0)


def test_peers_that_break_the_protocol_never_shake_hands_or_come_too_many_are_closed() -> None:
    with KVEventPublisher("tcp://127.0.0.1:0", max_peers=3, handshake_s=0.2) as pub:
        port = int(pub.endpoint.rsplit(":", 1)[1])
        with closing(socket.create_connection(("127.0.0.1", port), timeout=10)) as http:
            http.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert _hung_up(http)
        with closing(socket.create_connection(("127.0.0.1", port), timeout=10)) as silent:
            assert _hung_up(silent)  # no greeting within HANDSHAKE_S
        peers = [_zmtp_peer(pub.endpoint) for _ in range(3)]
        try:
            for p in peers:  # subscribers: a new connection cannot replace them
                p.sendall(_frame(b"\x01" + DEFAULT_TOPIC))
            assert _until(lambda: pub.subscribers == 3)
            with closing(socket.create_connection(("127.0.0.1", port), timeout=10)) as fourth:
                assert _hung_up(fourth)  # max_peers are connected already
            assert not any(_hung_up(p, 0.3) for p in peers)
        finally:
            for p in peers:
                p.close()
        assert pub.peers_dropped == 3


BIG = [BlockStored(block_hashes=tuple(i.to_bytes(32, "big") for i in range(500)))]  # about 17 KiB a batch


@needs_proc
@pytest.mark.parametrize(
    ("peer_bytes", "total_bytes"), [(256 << 10, 64 * MIB), (4 * MIB, 1536 << 10)], ids=["per-peer", "total"]
)
def test_subscribers_that_never_read_cost_the_publisher_bounded_bytes(
    tmp_path: Path, peer_bytes: int, total_bytes: int
) -> None:
    stalled_n, steps, step = 8, 250, 6  # 1,500 batches, 25 MiB for each subscriber
    with contextlib.ExitStack() as stack:
        pub = stack.enter_context(
            KVEventPublisher(f"ipc://{tmp_path}/ev", max_peer_bytes=peer_bytes, max_queued_bytes=total_bytes)
        )
        stalled = [stack.enter_context(KVEventSubscriber(pub.endpoint, hwm=1)) for _ in range(stalled_n)]
        reader = stack.enter_context(KVEventSubscriber(pub.endpoint))
        _connected(pub, reader, *stalled)  # from now on the stalled ones never read
        before, first, seqs, peak, grew = _rss(), pub.next_seq, list[int](), 0, 0
        for _ in range(steps):
            for _ in range(step):
                assert pub.publish(BIG)
                peak = max(peak, pub.queued_bytes)
            while len(seqs) < pub.next_seq - first and (got := reader.recv(timeout_s=10.0)) is not None:
                seqs.append(got.batch.seq)
            peak, grew = max(peak, pub.queued_bytes), max(grew, _rss() - before)
        assert seqs == list(range(first, pub.next_seq)), "the subscriber that reads lost batches"
        assert grew < 48 * MIB, f"RSS grew {grew / MIB:.0f} MiB"
        bound = min(total_bytes, (stalled_n + 1) * peer_bytes)
        assert bound // 2 < peak <= bound, (peak, bound)  # the stalled queues filled up to the bound, not beyond
        assert pub.undelivered > stalled_n * steps * step // 2 and pub.dropped == 0


@pytest.mark.timeout(60)
def test_silent_peers_that_never_subscribe_cannot_lock_subscribers_out() -> None:
    with KVEventPublisher("tcp://127.0.0.1:0", max_peers=8, handshake_s=0.5) as pub:
        silent = [_zmtp_peer(pub.endpoint) for _ in range(8)]  # they shake hands, then never subscribe nor read
        try:
            with KVEventSubscriber(pub.endpoint) as sub:
                deadline, got = time.monotonic() + 20.0, None
                while got is None and time.monotonic() < deadline:
                    pub.publish(EVENTS)
                    got = sub.recv(timeout_s=0.1)
                assert got is not None, "a new subscriber got no batch in 20 s"
                _still_serves(pub, sub)
            assert sum(_hung_up(p, 0.2) for p in silent) >= 1  # replaced by the subscriber
        finally:
            for p in silent:
                p.close()


def test_byte_bounds_and_peer_bounds_are_validated_and_publish_drops_what_exceeds_them() -> None:
    for name, bad in (
        ("max_peer_bytes", 0),
        ("max_queued_bytes", -1),
        ("max_queued_bytes", 1.5),
        ("max_peers", 0),
        ("handshake_s", 0),
        ("handshake_s", float("nan")),
        ("handshake_s", "10"),
    ):
        with pytest.raises(ConfigError, match=rf"{name}\b.*{re.escape(repr(bad))}"):
            KVEventPublisher("tcp://127.0.0.1:0", **{name: bad})  # type: ignore[arg-type]
    with KVEventPublisher("tcp://127.0.0.1:0", max_queued_bytes=4096) as pub:
        assert not pub.publish(BIG) and pub.dropped == 1  # over max_queued_bytes: never handed to the thread
        assert pub.publish(EVENTS) and pub.queued_bytes == 0
