"""End to end, wired as examples/integration.py (scheduler + worker + the wire) with the demo's KV verification:
a byte flipped in a stored host chunk fails the load, the chunk is dropped, the request recomputes right.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

import kvoffload
from kvoffload import BlockRemoved, wire
from kvoffload.demo import default_snapshot
from kvoffload.demo.sim_engine import block_seed, fill_blocks, verify_blocks
from kvoffload.offload.keys import chunk_keys, offload_key_hash
from kvoffload.offload.manager import LookupResult
from kvoffload.offload.pool import HostPool, plan_host_pool_from_config
from kvoffload.offload.worker import OffloadWorker
from kvoffload.offload.worker.copy import CopyEngine, TransferLayout, transfer_layout_from_config

TOKENS = list(range(1, 129))  # 8 blocks of 16 tokens


@dataclass
class Rig:
    scheduler: kvoffload.OffloadScheduler
    worker: OffloadWorker
    pool: HostPool
    kv: torch.Tensor
    layout: TransferLayout
    hashes: list[bytes]

    def step(self) -> kvoffload.ReportOutcome:
        plan = self.scheduler.build_step_plan()
        plan = wire.decode(wire.encode(plan)).expect(kvoffload.StepPlan)
        self.worker.start_step(plan)
        self.worker.wait_for_loads(plan, timeout=30)
        self.worker.end_step(plan)
        report = wire.decode(wire.encode(self.worker.drain(plan.step, timeout=30))).expect(kvoffload.WorkerReport)
        return self.scheduler.on_worker_reports([report])

    def compute(self, blocks: list[int], first: int = 0) -> None:
        """The engine computes logical blocks ``first..`` into engine ``blocks`` (deterministic KV)."""
        fill_blocks(self.kv, self.layout, 0, [(0, b, block_seed(self.hashes[first + i])) for i, b in enumerate(blocks)])

    def wrong(self, blocks: list[int], first: int = 0) -> list[int]:
        """Engine blocks whose KV differs from what computing logical blocks ``first..`` gives."""
        entries = [(0, b, block_seed(self.hashes[first + i])) for i, b in enumerate(blocks)]
        return verify_blocks(self.kv, self.layout, 0, entries)


@pytest.fixture(params=[True, False], ids=["checksums", "no-checksums"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    snapshot = default_snapshot(workers=1, num_blocks=64, cpu_bytes=32 << 20)
    config = kvoffload.translate_snapshot(snapshot)
    pool_plan = plan_host_pool_from_config(config)
    manager = kvoffload.HostBlockManager(pool_plan.num_chunks, "lru", enable_events=True)
    scheduler = kvoffload.OffloadScheduler(config, manager)
    kv = torch.zeros(snapshot.kv_cache_config.kv_cache_tensors[0].size, dtype=torch.uint8)
    layout = transfer_layout_from_config(snapshot.kv_cache_config, config)
    hashes = kvoffload.hash_token_blocks(TOKENS, config.cache.tokens_per_hash)
    with HostPool(pool_plan) as pool:
        worker = OffloadWorker(CopyEngine(kv, layout, pool, checksums=request.param), rank=0)
        yield Rig(scheduler, worker, pool, kv, layout, hashes)
        worker.close()


def _store_prompt(rig: Rig) -> None:
    sched = rig.scheduler
    sched.add_request("A", rig.hashes, len(TOKENS))
    assert sched.lookup("A", num_computed_tokens=0) == 0
    sched.on_blocks_allocated("A", [list(range(8))])
    rig.compute(list(range(8)))
    sched.on_tokens_computed("A", len(TOKENS))
    rig.step()
    sched.finish_request("A")
    sched.take_events()


def test_flipped_byte_fails_the_load_drops_the_chunk_and_the_recompute_is_right(rig: Rig) -> None:
    sched = rig.scheduler
    _store_prompt(rig)
    keys = chunk_keys(rig.hashes, 0, 1)  # one hash-block per chunk here
    key3 = keys[3]
    chunk3 = sched.manager.chunk_id(key3)
    assert chunk3 is not None
    rig.pool.rows[chunk3, 1000] ^= 0x01  # one bit of logical block 3's host copy

    # B has the same prompt: it hits 7 blocks and loads them into engine blocks 20..26
    sched.add_request("B", rig.hashes, len(TOKENS))
    hit = sched.lookup("B", num_computed_tokens=0)
    assert hit == 112
    sched.on_blocks_allocated("B", [list(range(20, 28))], num_external_tokens=hit)
    outcome = rig.step()
    checksums = rig.worker.engine.checksums
    if not checksums:  # documented: without content checksums a flipped byte goes unnoticed
        assert outcome.failed_loads == () and rig.wrong(list(range(20, 27))) == [23]
        return
    assert (outcome.finished_loads, outcome.failed_loads) == ((), ("B",))
    stats = sched.stats()
    assert (stats.corrupt_loads, stats.corrupted_chunks, stats.failed_jobs) == (1, 1, 1)
    assert (rig.worker.corrupt_loads, rig.worker.corrupted_chunks) == (1, 1)
    assert sched.manager.lookup(key3) is LookupResult.MISS
    assert [sched.manager.lookup(k) for k in keys].count(LookupResult.HIT) == 7
    events = sched.take_events()
    assert events == [BlockRemoved(block_hashes=(offload_key_hash(key3),), group_idx=0, medium=kvoffload.Medium.CPU)]

    # the engine recomputes B; its KV is right
    rig.compute(list(range(20, 28)))
    sched.on_tokens_computed("B", len(TOKENS))
    rig.step()
    assert rig.wrong(list(range(20, 28))) == []
    sched.finish_request("B")

    # C loads only the prefix before the dropped chunk, and what it loads is right
    sched.add_request("C", rig.hashes, len(TOKENS))
    hit = sched.lookup("C", num_computed_tokens=0)
    assert hit == 48
    sched.on_blocks_allocated("C", [list(range(40, 48))], num_external_tokens=hit)
    outcome = rig.step()
    assert outcome.finished_loads == ("C",)
    assert rig.wrong(list(range(40, 43))) == []
    assert sched.stats().corrupt_loads == 1


def test_wrong_chunk_for_a_key_fails_even_without_checksums(rig: Rig) -> None:
    sched = rig.scheduler
    _store_prompt(rig)
    keys = chunk_keys(rig.hashes, 0, 1)
    c1, c2 = sched.manager.chunk_id(keys[1]), sched.manager.chunk_id(keys[2])
    assert c1 is not None and c2 is not None
    rig.pool.rows[[c1, c2]] = rig.pool.rows[[c2, c1]].clone()  # the bytes of two keys are swapped
    rig.pool.integrity.storage.view(rig.pool.num_chunks, -1)[[c1, c2]] = rig.pool.integrity.storage.view(
        rig.pool.num_chunks, -1
    )[[c2, c1]].clone()  # metadata travels with them: checksums match, key tags do not
    sched.add_request("B", rig.hashes, len(TOKENS))
    hit = sched.lookup("B", num_computed_tokens=0)
    sched.on_blocks_allocated("B", [list(range(20, 28))], num_external_tokens=hit or 0)
    outcome = rig.step()
    assert outcome.failed_loads == ("B",)
    assert sched.stats().corrupted_chunks == 2
    assert sched.manager.lookup(keys[1]) is LookupResult.MISS
    assert sched.manager.lookup(keys[2]) is LookupResult.MISS
