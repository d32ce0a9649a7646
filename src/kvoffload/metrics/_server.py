"""Serving a registry over HTTP at ``/metrics`` on a background thread."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server

from kvoffload._ints import check_int
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

__all__ = ["MetricsServer", "serve_metrics"]


class MetricsServer:
    """An HTTP server exposing ``registry`` at ``/metrics`` on a background thread (see :func:`serve_metrics`)."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        """The bound port (useful after asking for port 0)."""
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = self._server.server_address[0]
        name = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{name}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(registry: CollectorRegistry, port: int, *, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` at ``http://addr:port/metrics`` until :meth:`MetricsServer.close` (port 0: any free)."""
    check_int("metrics port", port, 0, 65535)
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None
    return MetricsServer(server, thread)
