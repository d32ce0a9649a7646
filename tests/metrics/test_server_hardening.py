"""The /metrics server against bad clients (issue 22, item 4), over real sockets on 127.0.0.1: malformed and
aborted requests print nothing on stderr, idle connections hold no thread and are closed, a scrape still works.
Every client here is closed by the test; waits are hang guards, never measured."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from kvoffload import ConfigError
from kvoffload.metrics import MetricsServer, serve_metrics

LOGGER = "kvoffload.metrics._server"


def _registry(counters: int = 1) -> CollectorRegistry:
    registry = CollectorRegistry()
    for i in range(counters):
        Counter(f"probe_{i}", "a counter the scrape must find", registry=registry).inc(i + 1)
    return registry


def _scrape(server: MetricsServer) -> dict[str, float]:
    body = urllib.request.urlopen(server.url, timeout=10).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}


def _connect(server: MetricsServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a client that aborts does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _hung_up(sock: socket.socket, timeout_s: float = 10.0) -> bool:
    """Whether the server closes ``sock`` within ``timeout_s`` (what it sends meanwhile is discarded)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


def _answer(sock: socket.socket) -> bytes:
    """All the server sends until it closes (the hang guard: the socket's 10 s timeout)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _settled_thread_count() -> int:
    """The number of threads once it stopped changing (bounded: 3 s)."""
    counts = [threading.active_count()]
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and (len(counts) < 4 or len(set(counts[-4:])) > 1):
        time.sleep(0.1)
        counts.append(threading.active_count())
    return counts[-1]


@contextmanager
def _idle_connections(server: MetricsServer, n: int) -> Iterator[list[socket.socket]]:
    with ExitStack() as stack:
        yield [stack.enter_context(closing(_connect(server))) for _ in range(n)]


def test_malformed_and_aborted_requests_print_nothing_on_stderr(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with serve_metrics(_registry(), 0) as server:
        for request in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", b"GET / metrics HTTP/1.0\r\n\r\n"):
            for _ in range(5):  # answered with an error, but the client has already reset the connection
                sock = _connect(server)
                sock.sendall(request)
                _reset(sock)
            with closing(_connect(server)) as sock:  # the same, read: a 400 answer
                sock.sendall(request)
                assert b"400" in _answer(sock)
        with closing(_connect(server)) as sock:  # a valid request, aborted before the answer is read
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            _reset(sock)
        with closing(_connect(server)) as sock:  # a head too long
            sock.sendall(b"GET /metrics HTTP/1.0\r\nX: " + b"a" * 70_000 + b"\r\n\r\n")
            assert _answer(sock).startswith(b"HTTP/1.0 431")
        assert _scrape(server)["probe_0_total"] == 1.0  # and it still serves
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err and "code 400" not in err, err
    failures = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert failures and all("\n" not in m for m in failures)  # one line each, on the logger, at debug
    assert {r.levelno for r in caplog.records if r.name == LOGGER} == {logging.DEBUG}


def test_200_idle_connections_hold_no_thread_and_a_scrape_still_succeeds() -> None:
    with serve_metrics(_registry(), 0) as server:
        before = _settled_thread_count()
        with _idle_connections(server, 200):
            during = _settled_thread_count()
            assert during - before <= 5, f"{during - before} threads for 200 idle connections"
            scraped = _scrape(server)  # within urlopen's 10 s: the hang guard
            assert scraped["probe_0_total"] == 1.0
            assert _settled_thread_count() - before <= 5


def test_idle_connections_are_closed_after_timeout_s_and_beyond_max_connections() -> None:
    with serve_metrics(_registry(), 0, timeout_s=0.3) as server, closing(_connect(server)) as idle:
        assert _hung_up(idle)  # sent no request within timeout_s
    with serve_metrics(_registry(), 0, max_connections=4) as server, _idle_connections(server, 4) as idle:
        time.sleep(0.2)  # let the server take them in, oldest first
        with closing(_connect(server)) as fifth:
            assert _hung_up(idle[0])  # the idlest made room for the newcomer
            fifth.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert fifth.recv(64).startswith(b"HTTP/1.0 200")
    with pytest.raises(ConfigError, match="timeout_s"):
        serve_metrics(_registry(), 0, timeout_s=0)
    with pytest.raises(ConfigError, match="max_connections"):
        serve_metrics(_registry(), 0, max_connections=0)


class _Big:
    """A collector whose one counter has an 8 MiB help text: an answer no socket buffer takes in whole."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("big", "x" * (8 << 20), value=1)


def test_a_client_that_never_takes_its_answer_holds_a_worker_for_timeout_s_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    registry = _registry()
    registry.register(_Big())
    with serve_metrics(registry, 0, workers=1, timeout_s=0.5) as server, closing(socket.socket()) as stuck:
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(("127.0.0.1", server.port))
        stuck.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # and never reads the answer
        time.sleep(0.2)
        assert _scrape(server)["big_total"] == 1.0  # the one worker gave up on ``stuck``
    assert any("timed out" in r.getMessage() for r in caplog.records if r.name == LOGGER)
