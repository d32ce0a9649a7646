"""Layer-wise copies (``LayerwiseCopies`` inside ``OffloadWorker``): per-layer stores and loads, byte exact, with the
same integrity as whole-job copies (a chunk sealed layer by layer verifies in a whole-job load and the other way
round; a corrupted byte or a wrong key tag fails the load and names the chunk)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvoffload import Direction, JobResult, StepPlan, TransferJob
from kvoffload._packed import Int64Array, pack_int32, pack_int64
from kvoffload.offload.keys import key_tag, make_offload_key
from kvoffload.offload.pool import HostPool, plan_host_pool
from kvoffload.offload.worker import LayerwiseCopies, OffloadWorker
from kvoffload.offload.worker.copy import CopyEngine, CopyJob, build_transfer_layout
from tests.helpers import Placement

PAGE = 256
BLOCKS = 8
LAYERS = ("l0", "l1", "l2", "l3")
BPC = 2


class _Rank:
    """One rank: engine KV memory of 4 layers, a host pool, a worker with layer-wise copies."""

    def __init__(self, *, checksums: bool = True, every_load: bool = False, hooked: list[int] | None = None) -> None:
        self.layout = build_transfer_layout(
            [Placement(size=len(LAYERS) * BLOCKS * PAGE, layers=LAYERS, layer_stride=BLOCKS * PAGE, block_stride=PAGE)],
            [[(name, PAGE) for name in LAYERS]],
            num_blocks=BLOCKS,
            worker_kv_bytes_per_block=len(LAYERS) * PAGE,
        )
        plan = plan_host_pool(
            worker_kv_bytes_per_block=len(LAYERS) * PAGE,
            world_size=1,
            blocks_per_chunk=BPC,
            cpu_bytes_to_use=8 * 4096 * BPC,
            replicated=False,
            rank=0,
        )
        self.memory = torch.randint(0, 256, (len(LAYERS) * BLOCKS * PAGE,), dtype=torch.uint8)
        self.pool = HostPool(plan, check_memory=False)
        engine = CopyEngine(self.memory, self.layout, self.pool, checksums=checksums)
        layered = LayerwiseCopies(
            self.layout, self.memory, self.pool, checksums=checksums, every_load=every_load, hooked_groups=hooked
        )
        self.worker = OffloadWorker(engine, rank=0, layerwise=layered)
        self.step = 0

    def page(self, layer: int, block: int) -> torch.Tensor:
        return self.memory[layer * BLOCKS * PAGE + block * PAGE :][:PAGE].clone()

    def run(
        self, *, loads: tuple[TransferJob, ...] = (), stores: tuple[TransferJob, ...] = (), layers_saved: int = 0
    ) -> tuple[JobResult, ...]:
        """One step as vLLM runs it: start, the forward pass saving ``layers_saved`` layers, end, then the report."""
        self.step += 1
        plan = StepPlan(step=self.step, load_jobs=loads, store_jobs=stores)
        self.worker.start_step(plan)
        for name in LAYERS[:layers_saved]:
            self.worker.wait_for_layer(name, 10)
            self.worker.store_layer(name)
        self.worker.end_step(plan)
        self.worker.wait_in_flight(10)
        return self.worker.report(self.step).results

    def close(self) -> None:
        self.worker.close()
        self.pool.close()


@pytest.fixture
def rank() -> Iterator[_Rank]:
    r = _Rank()
    yield r
    r.close()


def _job(job_id: int, blocks: list[int], chunks: list[int], *, sync: bool = True, tag_of: int = 0) -> TransferJob:
    tags = [key_tag(make_offload_key(bytes([(c + tag_of) % 256]) * 32, 0)) for c in chunks]
    return TransferJob(
        job_id=job_id,
        req_id="r",
        group_sizes=pack_int32([len(blocks)]),
        block_indices=pack_int32([0]),
        block_ids=pack_int64(blocks),
        chunk_ids=pack_int64(chunks),
        sync=sync,
        chunk_tags=pack_int64(tags),
    )


def test_stores_issued_layer_by_layer_load_back_byte_exact_layer_by_layer(rank: _Rank) -> None:
    before = [[rank.page(layer, b) for b in range(4)] for layer in range(len(LAYERS))]
    results = rank.run(stores=(_job(1, [0, 1, 2, 3], [0, 1]),), layers_saved=2)  # l2, l3 left to end_step
    assert [(r.job_id, r.success, r.is_store, r.num_bytes) for r in results] == [(1, True, True, 4 * 4 * PAGE)]
    rank.memory.zero_()
    rank.step += 1
    plan = StepPlan(step=rank.step, load_jobs=(_job(2, [4, 5, 6, 7], [0, 1]),), store_jobs=())
    rank.worker.start_step(plan)
    rank.worker.wait_for_layer("l0", 10)
    assert all(torch.equal(rank.page(0, 4 + b), before[0][b]) for b in range(4)), "layer 0 is there once waited for"
    rank.worker.end_step(plan)
    rank.worker.wait_in_flight(10)
    (result,) = rank.worker.report(rank.step).results
    assert (result.job_id, result.success, result.is_store, result.num_bytes) == (2, True, False, 4 * 4 * PAGE)
    for layer in range(len(LAYERS)):
        assert all(torch.equal(rank.page(layer, 4 + b), before[layer][b]) for b in range(4))


def test_layer_wise_and_whole_job_copies_seal_and_verify_the_same_checksums(rank: _Rank) -> None:
    """A chunk stored layer by layer loads as one job (checksum verified in the copy kernel), and a chunk stored as
    one job loads layer by layer (verified over the host bytes)."""
    expected = [rank.page(layer, 0) for layer in range(len(LAYERS))]
    assert rank.run(stores=(_job(1, [0, 1], [0]),), layers_saved=4)[0].success
    assert rank.run(loads=(_job(2, [6, 7], [0], sync=False),))[0].success, "a whole-job load (not sync)"
    assert all(torch.equal(rank.page(layer, 6), expected[layer]) for layer in range(len(LAYERS)))
    rank.worker.engine.submit_store(
        3,
        group_sizes=[2],
        block_indices=[0],
        block_ids=[2, 3],
        chunk_ids=[1],
        chunk_tags=Int64Array.from_buffer(_job(0, [0, 0], [1]).chunk_tags).to_tensor(),
    )
    rank.worker.engine.wait([3], 10)
    assert rank.worker.report(rank.step).results[0].success
    assert rank.run(loads=(_job(4, [4, 5], [1]),))[0].success, "a layer-wise load of a whole-job store"


def test_a_corrupted_byte_in_any_layer_fails_the_load_and_names_the_chunk(rank: _Rank) -> None:
    assert rank.run(stores=(_job(1, [0, 1, 2, 3], [0, 1]),), layers_saved=4)[0].success
    row = rank.pool.rows[1].view(-1)
    row[rank.pool.slot_offset + 3 * PAGE + 17] ^= 0xFF  # chunk 1, sub-block 0, layer 3
    (result,) = rank.run(loads=(_job(2, [4, 5, 6, 7], [0, 1]),))
    assert not result.success and "checksum" in result.error
    assert Int64Array.from_buffer(result.corrupt_chunk_ids).tolist() == [1]
    assert rank.worker.corrupt_loads == 1


def test_a_wrong_key_tag_fails_the_load(rank: _Rank) -> None:
    assert rank.run(stores=(_job(1, [0, 1], [0]),), layers_saved=4)[0].success
    (result,) = rank.run(loads=(_job(2, [4, 5], [0], tag_of=9),))
    assert not result.success and Int64Array.from_buffer(result.corrupt_chunk_ids).tolist() == [0]


def test_a_store_with_a_bad_id_is_refused_before_any_layer_is_copied(rank: _Rank) -> None:
    before = [rank.page(layer, 0) for layer in range(len(LAYERS))]
    assert rank.run(stores=(_job(1, [0, 1], [0]),), layers_saved=4)[0].success
    bad = _job(2, [2, 99], [0])  # block 99 is outside the engine's 8 blocks
    (result,) = rank.run(stores=(bad,), layers_saved=1)
    assert not result.success and "block_ids" in result.error and "99" in result.error
    rank.memory.zero_()
    (load,) = rank.run(loads=(_job(3, [4, 5], [0]),))
    assert load.success, "nothing of the refused store reached the chunk: it still holds what job 1 sealed"
    assert all(torch.equal(rank.page(layer, 4), before[layer]) for layer in range(len(LAYERS)))


def test_loads_not_read_in_the_step_are_whole_jobs_and_unknown_layers_are_ignored(rank: _Rank) -> None:
    assert rank.run(stores=(_job(1, [0, 1], [0]),), layers_saved=4)[0].success
    rank.step += 1
    plan = StepPlan(step=rank.step, load_jobs=(_job(2, [4, 5], [0], sync=False),), store_jobs=())
    rank.worker.start_step(plan)
    assert rank.worker.layerwise is not None and not rank.worker.layerwise.in_flight
    rank.worker.wait_for_layer("not-offloaded", 10)
    rank.worker.store_layer("not-offloaded")
    rank.worker.end_step(plan)
    rank.worker.wait_in_flight(10)
    assert rank.worker.report(rank.step).results[0].success


def test_every_load_mode_and_checksums_off() -> None:
    r = _Rank(checksums=False, every_load=True)
    try:
        assert r.run(stores=(_job(1, [0, 1], [0]),), layers_saved=4)[0].success
        assert r.worker.layerwise is not None and r.worker.layerwise.takes(_job(2, [4, 5], [0], sync=False))
        assert r.run(loads=(_job(2, [4, 5], [0], sync=False),))[0].success
        (wrong,) = r.run(loads=(_job(3, [4, 5], [0], tag_of=9),))
        assert not wrong.success, "key tags are still checked with checksums off"
    finally:
        r.close()


def test_layers_without_per_layer_hooks_are_waited_for_before_the_forward_pass() -> None:
    """A group whose layers the engine calls no hook for (vLLM's Mamba mixers): wait_for_step_loads covers it."""
    r = _Rank(hooked=[])
    try:
        expected = [r.page(layer, 0) for layer in range(len(LAYERS))]
        assert r.run(stores=(_job(1, [0, 1], [0]),), layers_saved=0)[0].success, "end_step stores every layer"
        r.memory.zero_()
        r.step += 1
        plan = StepPlan(step=r.step, load_jobs=(_job(2, [4, 5], [0]),), store_jobs=())
        r.worker.start_step(plan)
        r.worker.wait_for_step_loads(plan, every_load=False)  # no wait_for_layer call at all
        assert all(torch.equal(r.page(layer, 4), expected[layer]) for layer in range(len(LAYERS)))
        r.worker.end_step(plan)
        r.worker.wait_in_flight(10)
        assert r.worker.report(r.step).results[0].success
    finally:
        r.close()


def test_a_job_with_ids_out_of_range_is_reported_failed_not_raised(rank: _Rank) -> None:
    (result,) = rank.run(loads=(_job(1, [4, 5], [99]),))  # the pool has 8 chunks
    assert not result.success and "chunk_ids" in result.error and "99" in result.error
    (store,) = rank.run(stores=(_job(2, [0, 1], [-1]),), layers_saved=4)
    assert not store.success, "refused once, reported once"
    assert rank.run(stores=(_job(3, [0, 1], [0]),), layers_saved=4)[0].success, "the worker goes on"


def test_a_store_left_open_is_finished_and_reported_by_drain(rank: _Rank) -> None:
    rank.step += 1
    plan = StepPlan(step=rank.step, load_jobs=(), store_jobs=(_job(1, [0, 1], [0]),))
    rank.worker.start_step(plan)
    rank.worker.store_layer("l0")  # the forward pass stopped after layer 0: no end_step
    report = rank.worker.drain(rank.step, 10)
    assert [(r.job_id, r.success) for r in report.results] == [(1, True)]
    assert rank.run(loads=(_job(2, [4, 5], [0]),))[0].success, "every layer landed and was sealed"


def test_layers_are_copied_in_forward_order_across_groups() -> None:
    layout = build_transfer_layout(
        [
            Placement(
                size=4 * BLOCKS * PAGE,
                layers=("m.1.a", "m.0.b", "m.3.a", "m.2.b"),
                layer_stride=BLOCKS * PAGE,
                block_stride=PAGE,
            )
        ],
        [[("m.1.a", PAGE), ("m.3.a", PAGE)], [("m.0.b", PAGE), ("m.2.b", PAGE)]],
        num_blocks=BLOCKS,
        worker_kv_bytes_per_block=2 * PAGE,
    )
    plan = plan_host_pool(
        worker_kv_bytes_per_block=2 * PAGE,
        world_size=1,
        blocks_per_chunk=1,
        cpu_bytes_to_use=8 * 4096,
        replicated=False,
        rank=0,
    )
    memory = torch.zeros(4 * BLOCKS * PAGE, dtype=torch.uint8)
    with HostPool(plan, check_memory=False) as pool:
        layered = LayerwiseCopies(layout, memory, pool)
        try:
            assert layered.layer_names == ["m.0.b", "m.1.a", "m.2.b", "m.3.a"]
        finally:
            layered.close()


def test_two_groups_with_a_partial_first_chunk_match_whole_job_copies() -> None:
    """Two groups, two blocks per chunk, group A entering its first chunk at sub-block 1: a layer-wise store loads
    back through a whole-job load and a whole-job store through a layer-wise load, byte for byte."""
    names = ("a0", "b0", "a1", "b1")
    layout = build_transfer_layout(
        [Placement(size=4 * BLOCKS * PAGE, layers=names, layer_stride=BLOCKS * PAGE, block_stride=PAGE)],
        [[("a0", PAGE), ("a1", PAGE)], [("b0", PAGE), ("b1", PAGE)]],
        num_blocks=BLOCKS,
        worker_kv_bytes_per_block=2 * PAGE,
    )
    plan = plan_host_pool(
        worker_kv_bytes_per_block=2 * PAGE,
        world_size=1,
        blocks_per_chunk=2,
        cpu_bytes_to_use=8 * 2 * 4096,
        replicated=False,
        rank=0,
    )
    memory = torch.randint(0, 256, (4 * BLOCKS * PAGE,), dtype=torch.uint8)

    def page(layer: int, block: int) -> torch.Tensor:
        return memory[layer * BLOCKS * PAGE + block * PAGE :][:PAGE].clone()

    def job(job_id: int, a: list[int], b: list[int], chunks: list[int]) -> TransferJob:
        tags = [key_tag(make_offload_key(bytes([c]) * 32, 0)) for c in chunks]
        return TransferJob(
            job_id=job_id,
            req_id="r",
            group_sizes=pack_int32([len(a), len(b)]),
            block_indices=pack_int32([1, 0]),
            block_ids=pack_int64(a + b),
            chunk_ids=pack_int64(chunks),
            sync=True,
            chunk_tags=pack_int64(tags),
        )

    with HostPool(plan, check_memory=False) as pool:
        layered = LayerwiseCopies(layout, memory, pool)
        worker = OffloadWorker(CopyEngine(memory, layout, pool), rank=0, layerwise=layered)
        try:
            for n, (store_layerwise, chunks) in enumerate(((True, [0, 1, 2]), (False, [3, 4, 5]))):
                src_a, src_b, dst_a, dst_b = [0, 1, 2], [3, 4], [5, 6, 7], [0, 1]
                want = {(layer, i): page(layer, blk) for layer in (0, 2) for i, blk in enumerate(src_a)}
                want |= {(layer, i): page(layer, blk) for layer in (1, 3) for i, blk in enumerate(src_b)}
                store = job(10 * n + 1, src_a, src_b, chunks)
                if store_layerwise:
                    step = StepPlan(step=3 * n, load_jobs=(), store_jobs=(store,))
                    worker.start_step(step)
                    for name in layered.layer_names:
                        worker.store_layer(name)
                    worker.end_step(step)
                else:
                    worker.engine.submit(CopyJob.from_transfer(store, Direction.STORE))
                    worker.engine.wait([store.job_id], 10)  # submitted past the worker: waited for here
                worker.wait_in_flight(10)
                assert [r.success for r in worker.report(3 * n).results] == [True]
                load = job(10 * n + 2, dst_a, dst_b, chunks)
                if store_layerwise:  # a whole-job load (checksums verified in the copy kernel)
                    worker.engine.submit(CopyJob.from_transfer(load, Direction.LOAD))
                    worker.engine.wait([load.job_id], 10)
                else:
                    step = StepPlan(step=3 * n + 1, load_jobs=(load,), store_jobs=())
                    worker.start_step(step)
                    for name in layered.layer_names:
                        worker.wait_for_layer(name, 10)
                    worker.end_step(step)
                worker.wait_in_flight(10)
                assert [r.success for r in worker.report(3 * n + 1).results] == [True]
                for (layer, i), expected in want.items():
                    dst = dst_a if layer in (0, 2) else dst_b
                    assert torch.equal(page(layer, dst[i]), expected), (store_layerwise, layer, i)
                memory.copy_(torch.randint(0, 256, memory.shape, dtype=torch.uint8))
        finally:
            worker.close()
