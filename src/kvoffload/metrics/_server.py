"""Serving a registry over HTTP at ``/metrics``: prometheus_client's WSGI app behind a bounded server.

prometheus_client's ``start_http_server`` runs a thread per connection with no timeout (every idle connection
holds a thread for good) and prints a traceback on stderr whenever a client resets a connection mid-request.
This server keeps prometheus_client's app (``make_wsgi_app``: formats, compression, ``name[]`` filters) and
wsgiref's request handling, and bounds the rest:

* one thread accepts connections and waits on all of them with a selector, reading each request head (a longer
  one than 64 KiB is answered 431); a connection that sends no complete head within ``timeout_s`` is closed;
* a complete request is answered by one of ``workers`` threads, which never wait for the client to send (the
  head is already read) and give up on a client that does not take the answer within ``timeout_s``;
* at most ``max_connections`` are open at once: past that, the one idle for longest is closed;
* a malformed request gets wsgiref's error answer, and any failure is one debug line on this module's logger,
  never a traceback on stderr.
"""

from __future__ import annotations

import contextlib
import io
import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from kvoffload._ints import check_int
from kvoffload.errors import ConfigError

__all__ = ["MetricsServer", "serve_metrics"]

_HEAD_BYTES = 64 << 10  # a longer request head is answered 431 and closed
_ACCEPT_BATCH = 64
_log = logging.getLogger(__name__)


class _DebugLog(io.StringIO):
    """Where wsgiref writes a failed request's traceback: its last line is logged at debug level."""

    def flush(self) -> None:
        lines = self.getvalue().strip().splitlines()
        if lines:
            _log.debug("metrics request failed: %s", lines[-1])
        self.seek(0)
        self.truncate()


class _Handler(WSGIRequestHandler):
    """wsgiref's handler, on a request head the server already read; quiet (no access log, no tracebacks)."""

    def __init__(self, request: socket.socket, address: tuple[str, int], server: WSGIServer, head: bytes) -> None:
        self._head = head
        super().__init__(request, address, server)

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = io.BytesIO(self._head)  # a GET has no body: the head is the whole request

    def get_stderr(self) -> _DebugLog:
        return _DebugLog()

    def log_message(self, format: str, *args: object) -> None:
        _log.debug("metrics request from %s: %s", self.client_address[0], format % args)


class _Listener(WSGIServer):
    """wsgiref's server, used for its listening socket and WSGI environ only (it never runs serve_forever)."""

    request_queue_size = socket.SOMAXCONN  # the listen backlog (socketserver's 5 refuses a burst of clients)

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        super().__init__(address, WSGIRequestHandler)  # requests are handled by MetricsServer


@dataclass(eq=False)
class _Waiting:
    """A connection whose request head is not complete yet."""

    address: tuple[str, int]
    deadline: float
    head: bytearray = field(default_factory=bytearray)


class MetricsServer:
    """Serves ``registry`` at ``/metrics`` from background threads (see :func:`serve_metrics` and the module)."""

    def __init__(self, listener: _Listener, *, max_connections: int, workers: int, timeout_s: float) -> None:
        self._listener = listener
        self._max_connections = max_connections
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvoffload-metrics")
        self._answering = 0  # connections handed to the pool, not closed yet
        self._lock = threading.Lock()
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="kvoffload-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port (useful after asking for port 0)."""
        return int(self._listener.server_port)

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = str(self._listener.server_address[0])
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, close every connection and release the port."""
        if self._stop:
            return
        self._stop = True
        self._wake_w.send(b"x")
        self._thread.join(5.0)
        self._pool.shutdown(wait=True)  # requests already read are answered (each within timeout_s)
        self._listener.server_close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        """The accepting thread: every connection waits here, in one selector, until its request head is read."""
        listener = self._listener.socket
        listener.setblocking(False)
        waiting: dict[socket.socket, _Waiting] = {}  # oldest first
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._stop:
                now = time.monotonic()
                timeout = min((w.deadline for w in waiting.values()), default=now + 1.0) - now
                for key, _ in selector.select(min(max(timeout, 0.0), 1.0)):
                    sock = key.fileobj
                    if sock is listener:
                        self._accept(listener, selector, waiting)
                    elif sock is not self._wake_r and isinstance(sock, socket.socket):
                        self._read(sock, selector, waiting)
                now = time.monotonic()
                for sock in [s for s, w in waiting.items() if w.deadline <= now]:
                    self._close(sock, selector, waiting, "no complete request in time")
            for sock in list(waiting):
                self._close(sock, selector, waiting, "")

    def _accept(
        self, listener: socket.socket, selector: selectors.BaseSelector, waiting: dict[socket.socket, _Waiting]
    ) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: keep serving the others
                _log.debug("metrics server: accept failed: %s", exc)
                return
            with self._lock:
                full = len(waiting) + self._answering >= self._max_connections
            if full and waiting:
                self._close(next(iter(waiting)), selector, waiting, "the idlest of too many connections")
            elif full:
                sock.close()
                continue
            sock.setblocking(False)
            waiting[sock] = _Waiting(address[:2], time.monotonic() + self._timeout_s)
            selector.register(sock, selectors.EVENT_READ)

    def _read(
        self, sock: socket.socket, selector: selectors.BaseSelector, waiting: dict[socket.socket, _Waiting]
    ) -> None:
        entry = waiting[sock]
        try:
            data = sock.recv(_HEAD_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(sock, selector, waiting, f"{exc}")
            return
        if not data:
            self._close(sock, selector, waiting, "closed before a complete request" if entry.head else "")
            return
        entry.head += data
        if len(entry.head) > _HEAD_BYTES:
            with contextlib.suppress(OSError):
                sock.send(b"HTTP/1.0 431 Request Header Fields Too Large\r\nConnection: close\r\n\r\n")
            self._close(sock, selector, waiting, f"a request head over {_HEAD_BYTES} bytes")
        elif b"\r\n\r\n" in entry.head or b"\n\n" in entry.head:
            selector.unregister(sock)
            del waiting[sock]
            sock.setblocking(True)
            with self._lock:
                self._answering += 1
            self._pool.submit(self._answer, sock, entry.address, bytes(entry.head))

    def _answer(self, sock: socket.socket, address: tuple[str, int], head: bytes) -> None:
        """A worker: answer one request (wsgiref's handler on prometheus_client's app), then close."""
        try:
            sock.settimeout(self._timeout_s)
            _Handler(sock, address, self._listener, head)
        except Exception as exc:  # a client's failure is a debug line, never a traceback
            _log.debug("metrics request from %s failed: %r", address[0], exc)
        finally:
            self._listener.shutdown_request(sock)
            with self._lock:
                self._answering -= 1

    @staticmethod
    def _close(
        sock: socket.socket, selector: selectors.BaseSelector, waiting: dict[socket.socket, _Waiting], why: str
    ) -> None:
        if why:
            _log.debug("metrics server: closing a connection from %s: %s", waiting[sock].address[0], why)
        selector.unregister(sock)
        del waiting[sock]
        sock.close()


def serve_metrics(
    registry: CollectorRegistry,
    port: int,
    *,
    addr: str = "127.0.0.1",
    max_connections: int = 256,
    workers: int = 4,
    timeout_s: float = 10.0,
) -> MetricsServer:
    """Serve ``registry`` at ``http://addr:port/metrics`` until :meth:`MetricsServer.close` (port 0: any free).

    At most ``max_connections`` are open at once (past that the idlest is closed), ``workers`` threads answer,
    and a client gets ``timeout_s`` seconds to send its request and to take the answer (see the module).
    """
    check_int("metrics port", port, 0, 65535)
    check_int("max_connections", max_connections, 1)
    check_int("workers", workers, 1)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < float("inf"):
        raise ConfigError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        listener = _Listener((addr, port), family)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None
    listener.set_app(make_wsgi_app(registry))
    return MetricsServer(listener, max_connections=max_connections, workers=workers, timeout_s=float(timeout_s))
