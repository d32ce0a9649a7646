"""CopyEngine: layout placement, the sub-block run math, byte-exact store/load round trips, completion."""

from __future__ import annotations

import array
import ctypes
import dataclasses
import itertools
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError, InvalidStateError, TransferError
from kvoffload.offload.pool import HostPool, plan_host_pool
from kvoffload.offload.worker import copy as kvcopy
from kvoffload.offload.worker.copy import (
    CopyEngine,
    CopyRuns,
    IdsLike,
    TransferLayout,
    _engine,
    _native,
    build_copy_runs,
    build_transfer_layout,
)
from kvoffload.offload.worker.copy import _cpu as cpu
from kvoffload.offload.worker.copy import _cpu_loops as loops
from kvoffload.offload.worker.copy import _cpu_native as cpu_native
from kvoffload.offload.worker.copy import _cuda as cuda
from tests.helpers import Placement, offloading_config

pytestmark = pytest.mark.usefixtures("copy_path")  # every test runs on the native and the pure-Python path

COPY_FUNCTIONS = ((loops, "memmove_runs"), (loops, "copy_views"), (cpu, "_native_job"), (cpu_native, "_native_submit"))
"""Every function a CPU copy path moves bytes through or hands a job over with, and its module (tests patch them
all to break a copy)."""


def hold_copies(mover: CopyEngine, monkeypatch: pytest.MonkeyPatch, release: threading.Event) -> None:
    """Hold every copy ``mover`` starts until ``release`` is set: the native engine holds its queues, the
    Python-driven paths wait in their copy functions."""
    backend = mover._backend
    if isinstance(backend, cpu_native.NativeCpuBackend):
        backend.hold(True)
        threading.Thread(target=lambda: (release.wait(10), backend.hold(False)), daemon=True).start()
        return

    def held(real: Callable[..., None]) -> Callable[..., None]:
        def wrapper(*args: object, **kwargs: object) -> None:
            release.wait(10)
            real(*args, **kwargs)

        return wrapper

    for module, name in COPY_FUNCTIONS[:3]:
        monkeypatch.setattr(module, name, held(getattr(module, name)))


# -- engine memory descriptions and the plain reference model ------------------------------------------


@dataclass
class Engine:
    """A placement description plus where each layer's page of block b is, computed independently."""

    placements: list[Placement]
    groups: list[list[tuple[str, int]]]
    num_blocks: int
    size: int

    def page(self, name: str, block: int) -> tuple[int, int]:
        for p in self.placements:
            if name in p.layers:
                start = p.offset + p.layers.index(name) * p.layer_stride + block * p.block_stride
                return start, dict(layer for group in self.groups for layer in group)[name]
        raise KeyError(name)


def layer_major(groups: list[list[tuple[str, int]]], num_blocks: int) -> Engine:
    """One region per layer, ``(num_blocks, page)``; uniform groups share one placement via layer_stride."""
    placements: list[Placement] = []
    offset = 0
    for group in groups:
        pages = {page for _, page in group}
        if len(pages) == 1 and len(group) > 1:
            (page,) = pages
            names = tuple(name for name, _ in group)
            placements.append(Placement(0, names, num_blocks * page, page, offset))
            offset += len(group) * num_blocks * page
        else:
            for name, page in group:
                placements.append(Placement(0, (name,), 0, page, offset))
                offset += num_blocks * page
    return _sized(placements, groups, num_blocks, offset)


def block_major(groups: list[list[tuple[str, int]]], num_blocks: int) -> Engine:
    """Cross-layer layout: every block holds all layers back to back (block_stride = sum of pages)."""
    stride = sum(page for group in groups for _, page in group)
    placements: list[Placement] = []
    offset = 0
    for group in groups:
        for name, page in group:
            placements.append(Placement(0, (name,), 0, stride, offset))
            offset += page
    return _sized(placements, groups, num_blocks, stride * num_blocks)


def _sized(placements: list[Placement], groups: list[list[tuple[str, int]]], num_blocks: int, size: int) -> Engine:
    fixed = [Placement(size, p.layers, p.layer_stride, p.block_stride, p.offset) for p in placements]
    return Engine(fixed, groups, num_blocks, size)


def make_layout(engine: Engine, wkb: int | None = None) -> TransferLayout:
    wkb = engine.size // max(engine.num_blocks, 1) if wkb is None else wkb  # as vLLM: whole allocation per block
    return build_transfer_layout(
        engine.placements, engine.groups, num_blocks=engine.num_blocks, worker_kv_bytes_per_block=wkb
    )


def reference_pages(
    layout: TransferLayout,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    block_ids: Sequence[int],
    chunk_ids: Sequence[int],
    bpc: int,
    row_bytes: int,
    slot_offset: int = 0,
) -> list[tuple[int, int, int]]:
    """(engine start, host start, length) of every page, written straight from the sub-block rule."""
    out = []
    wkb = layout.worker_kv_bytes_per_block
    block_pos = chunk_pos = 0
    for g, (n, b) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if n == 0:
            continue
        skip = b % bpc
        count = -(-(n + skip) // bpc)
        sub_blocks = [(c, j) for c in chunk_ids[chunk_pos : chunk_pos + count] for j in range(bpc)]
        sub_blocks = sub_blocks[skip : skip + n]
        for i in range(n):
            chunk, sub = sub_blocks[i]
            for layer in layout.groups[g].layers:
                engine_start = layer.engine_offset + block_ids[block_pos + i] * layer.block_stride
                host_start = chunk * row_bytes + slot_offset + sub * wkb + layer.host_offset
                out.append((engine_start, host_start, layer.page_bytes))
        block_pos += n
        chunk_pos += count
    return out


def byte_pairs(triples: Sequence[tuple[int, int, int]]) -> Counter[tuple[int, int]]:
    return Counter((e + k, h + k) for e, h, n in triples for k in range(n))


def runs_as_triples(runs: CopyRuns) -> list[tuple[int, int, int]]:
    return list(zip(runs.engine_offsets.tolist(), runs.host_offsets.tolist(), runs.lengths.tolist(), strict=True))


def make_pool(wkb: int, bpc: int, num_chunks: int) -> HostPool:
    plan = plan_host_pool(
        worker_kv_bytes_per_block=wkb,
        world_size=1,
        blocks_per_chunk=bpc,
        cpu_bytes_to_use=num_chunks * -(-wkb * bpc // 4096) * 4096,
        replicated=False,
        rank=0,
    )
    return HostPool(plan)


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# -- layout -------------------------------------------------------------------------------------------


def test_layer_major_layout_packs_pages_in_the_slot() -> None:
    engine = layer_major([[("a0", 64), ("a1", 64)], [("b0", 20), ("b1", 44)]], num_blocks=10)
    layout = make_layout(engine)
    a, b = layout.groups
    assert [(x.name, x.engine_offset, x.block_stride, x.host_offset) for x in a.layers] == [
        ("a0", 0, 64, 0),
        ("a1", 640, 64, 64),
    ]
    assert [(x.name, x.host_offset) for x in b.layers] == [("b0", 0), ("b1", 20)]
    assert len(a.segments) == 2 and a.bytes_per_block == 128
    assert layout.engine_bytes == engine.size == 1920
    assert layout.worker_kv_bytes_per_block == 192


def test_block_major_layout_is_one_segment_per_block() -> None:
    engine = block_major([[("l0", 48), ("l1", 16), ("l2", 48)]], num_blocks=6)
    (group,) = make_layout(engine).groups
    assert [(s.engine_offset, s.block_stride, s.length, s.host_offset) for s in group.segments] == [(0, 112, 112, 0)]
    assert [x.host_offset for x in group.layers] == [0, 48, 64]


def test_host_order_follows_engine_order() -> None:
    """Layers listed out of engine order are still packed so engine-adjacent pages stay adjacent."""
    engine = block_major([[("x", 32), ("y", 32)]], num_blocks=4)
    layout = build_transfer_layout(
        engine.placements, [[("y", 32), ("x", 32)]], num_blocks=4, worker_kv_bytes_per_block=64
    )
    (group,) = layout.groups
    assert [(x.name, x.host_offset) for x in group.layers] == [("y", 32), ("x", 0)]
    assert len(group.segments) == 1


@pytest.mark.parametrize(
    ("groups", "wkb", "match"),
    [
        ([[("nope", 8)]], 64, "group 0 layer 'nope' is in no kv_cache_tensors placement"),
        ([[("a", 8), ("a", 8)]], 64, "group 0 lists layer 'a' twice"),
        ([[("a", 0)]], 64, "layer 'a': page_bytes=0 must be > 0"),
        (
            [[("a", 16)]],
            64,
            r"layer 'a': block_stride=8 of kv_cache_tensors\[0\] is smaller than its page_bytes=16",
        ),
        (
            [[("a", 8), ("b", 8)]],
            15,
            "group 0: its pages take 16 bytes per block, more than the host slot of worker_kv_bytes_per_block=15",
        ),
    ],
)
def test_layout_errors_name_layer_and_numbers(groups: list[list[tuple[str, int]]], wkb: int, match: str) -> None:
    placements = [Placement(size=64, layers=("a", "b"), layer_stride=32, block_stride=8)]
    with pytest.raises(ConfigError, match=match):
        build_transfer_layout(placements, groups, num_blocks=4, worker_kv_bytes_per_block=wkb)


def test_layout_page_outside_allocation() -> None:
    placements = [Placement(size=60, layers=("a", "b"), layer_stride=32, block_stride=8)]
    with pytest.raises(ConfigError, match=r"layer 'b': the page of block 3 ends at byte 64, beyond .*size=60"):
        build_transfer_layout(placements, [[("b", 8)]], num_blocks=4, worker_kv_bytes_per_block=16)


def test_layout_rejects_layer_in_two_placements_and_negative_fields() -> None:
    twice = [Placement(64, ("a",), 0, 8), Placement(64, ("a",), 0, 8, 32)]
    with pytest.raises(ConfigError, match=r"layer 'a' is placed by kv_cache_tensors\[0\] and \[1\]"):
        build_transfer_layout(twice, [[("a", 8)]], num_blocks=4, worker_kv_bytes_per_block=8)
    with pytest.raises(ConfigError, match=r"kv_cache_tensors\[0\].offset=-8 must be >= 0"):
        build_transfer_layout([Placement(64, ("a",), 0, 8, -8)], [], num_blocks=4, worker_kv_bytes_per_block=8)


def test_layout_rejects_overlapping_pages() -> None:
    placements = [Placement(64, ("a",), 0, 16), Placement(64, ("b",), 0, 16, 4)]
    with pytest.raises(ConfigError, match="group 0 layer 'b': its page overlaps the previous layer's page"):
        build_transfer_layout(placements, [[("a", 8), ("b", 8)]], num_blocks=4, worker_kv_bytes_per_block=16)


def test_generated_kv_cache_tensor_is_a_placement() -> None:
    from kvoffload._generated import KVCacheTensor

    tensor = KVCacheTensor(size=256, layers=("a", "b"), layer_stride=128, block_stride=32)
    layout = build_transfer_layout([tensor], [[("a", 32), ("b", 32)]], num_blocks=4, worker_kv_bytes_per_block=64)
    assert [x.engine_offset for x in layout.groups[0].layers] == [0, 128]


def test_transfer_layout_from_config() -> None:
    from kvoffload._generated import (
        DType,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    page = 2 * 16 * 2 * 64 * 2  # K and V, 16 tokens, 2 heads, head size 64, float16
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.FLOAT16)
    names = ("layers.0", "layers.1")
    kv_cache_config = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=(KVCacheTensor(size=20 * page, layers=names, layer_stride=10 * page, block_stride=page),),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec),),
    )
    config = offloading_config([(0, 16, names, None)], worker_kv_bytes_per_block=2 * page)
    layout = kvcopy.transfer_layout_from_config(kv_cache_config, config)
    assert [(x.name, x.page_bytes, x.engine_offset, x.host_offset) for x in layout.groups[0].layers] == [
        ("layers.0", page, 0, 0),
        ("layers.1", page, 10 * page, page),
    ]
    assert (layout.num_blocks, layout.worker_kv_bytes_per_block, layout.engine_bytes) == (
        10,
        2 * page,
        20 * page,
    )


# -- run math -----------------------------------------------------------------------------------------


def test_runs_follow_sub_block_math_with_skip() -> None:
    engine = layer_major([[("a", 16)]], num_blocks=10)
    layout = make_layout(engine, wkb=16)
    runs = build_copy_runs(
        layout,
        group_sizes=[4],
        block_indices=[5],
        block_ids=[9, 2, 3, 7],
        chunk_ids=[6, 1],
        blocks_per_chunk=3,
        num_chunks=8,
        host_row_bytes=48,
    )
    # skip = 5 % 3 = 2: blocks land in chunk 6 sub 2, chunk 1 subs 0, 1, 2; blocks 2 and 3 coalesce.
    assert runs_as_triples(runs) == [(144, 6 * 48 + 32, 16), (32, 48, 32), (112, 48 + 32, 16)]
    assert runs.num_bytes == 64


def test_consecutive_blocks_into_consecutive_chunks_coalesce_to_one_run() -> None:
    engine = block_major([[("l0", 32), ("l1", 32)]], num_blocks=16)
    layout = make_layout(engine)
    runs = build_copy_runs(
        layout,
        group_sizes=[8],
        block_indices=[0],
        block_ids=list(range(4, 12)),
        chunk_ids=[2, 3],
        blocks_per_chunk=4,
        num_chunks=4,
        host_row_bytes=4 * 64,
    )
    assert runs_as_triples(runs) == [(4 * 64, 2 * 256, 8 * 64)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group_sizes": [2]}, "group_sizes has 1 and block_indices has 2 entries; the layout has 2 groups"),
        (
            {"block_ids": [1, 2, 3]},
            r"group_sizes=\[2, 2\] with block_indices=\[0, 1\] and blocks_per_chunk=2 consume 4 block_ids "
            "and 3 chunk_ids, but the job has 3 block_ids and 3 chunk_ids",
        ),
        (
            {"chunk_ids": [0, 1]},
            "consume 4 block_ids and 3 chunk_ids, but the job has 4 block_ids and 2 chunk_ids",
        ),
        ({"block_ids": [1, 2, 3, 10]}, r"block_ids contains 10, outside \[0, num_blocks=10\)"),
        ({"chunk_ids": [0, -1, 2]}, r"chunk_ids contains -1, outside \[0, num_chunks=4\)"),
        ({"group_sizes": [-1, 2]}, "group 0: group_sizes=-1 and block_indices=0 must be >= 0"),
        ({"block_ids": [[1, 2], [3, 4]]}, r"block_ids must be one-dimensional, got shape \(2, 2\)"),
        ({"block_ids": torch.ones(4)}, "block_ids must hold integers, got dtype torch.float32"),
    ],
)
def test_run_validation_names_numbers(kwargs: dict[str, object], match: str) -> None:
    layout = make_layout(layer_major([[("a", 8)], [("b", 8)]], num_blocks=10))
    job: dict[str, object] = {
        "group_sizes": [2, 2],
        "block_indices": [0, 1],
        "block_ids": [1, 2, 3, 4],
        "chunk_ids": [0, 1, 2],
    }
    job.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        build_copy_runs(layout, blocks_per_chunk=2, num_chunks=4, host_row_bytes=32, **job)  # type: ignore[arg-type]


@st.composite
def jobs(draw: st.DrawFn, unit: int = 1) -> tuple[Engine, TransferLayout, dict[str, list[int]], int, int]:
    """A random layout and job; every page size and slot padding is a multiple of ``unit`` bytes."""
    num_layers = draw(st.integers(1, 4))
    pages = [unit * p for p in draw(st.lists(st.integers(1, 40), min_size=num_layers, max_size=num_layers))]
    split = draw(st.integers(1, num_layers))
    named = [(f"l{i}", p) for i, p in enumerate(pages)]
    groups = [g for g in (named[:split], named[split:]) if g]
    num_blocks = draw(st.integers(1, 12))
    engine = draw(st.sampled_from([layer_major, block_major]))(groups, num_blocks)
    layout = make_layout(engine, wkb=max(sum(p for _, p in g) for g in groups) + unit * draw(st.integers(0, 8)))
    bpc = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(0, num_blocks), min_size=len(groups), max_size=len(groups)))
    if sum(sizes) > num_blocks:
        sizes = [0] * (len(sizes) - 1) + [num_blocks]
    indices = draw(st.lists(st.integers(0, 9), min_size=len(groups), max_size=len(groups)))
    chunk_count = sum(-(-(n + b % bpc) // bpc) for n, b in zip(sizes, indices, strict=True) if n)
    num_chunks = chunk_count + draw(st.integers(0, 3))
    block_ids = draw(st.permutations(range(num_blocks)))[: sum(sizes)]
    chunk_ids = draw(st.permutations(range(num_chunks)))[:chunk_count]
    job = {"group_sizes": sizes, "block_indices": indices, "block_ids": block_ids, "chunk_ids": chunk_ids}
    return engine, layout, job, bpc, num_chunks


@settings(max_examples=150, deadline=None)
@given(jobs(), st.integers(0, 7))
def test_runs_match_the_per_byte_reference(
    job: tuple[Engine, TransferLayout, dict[str, list[int]], int, int], pad: int
) -> None:
    engine, layout, spec, bpc, num_chunks = job
    row = layout.worker_kv_bytes_per_block * bpc + pad
    runs = build_copy_runs(
        layout, blocks_per_chunk=bpc, num_chunks=num_chunks, host_row_bytes=row, host_slot_offset=pad, **spec
    )
    expected = reference_pages(layout, **spec, bpc=bpc, row_bytes=row, slot_offset=pad)
    assert byte_pairs(runs_as_triples(runs)) == byte_pairs(expected)
    assert runs.num_bytes == sum(n for _, _, n in expected) == int(runs.lengths.sum())
    assert len(runs) <= len(expected)
    # Host pages of one block sit inside its slot and never overlap.
    for group in layout.groups:
        spans = sorted((x.host_offset, x.host_offset + x.page_bytes) for x in group.layers)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert spans[-1][1] <= layout.worker_kv_bytes_per_block
    # Both execution paths move exactly these bytes, in both directions.
    kv = random_bytes(engine.size, seed=1)
    host = torch.full((num_chunks * row,), 0xCD, dtype=torch.uint8)
    want_host = host.clone()
    for e, h, n in expected:
        want_host[h : h + n] = kv[e : e + n]
    for executor in (_run_memmove, _run_native, _run_indexed):
        got = host.clone()
        executor(kv, got, runs, True)
        assert torch.equal(got, want_host)
        back = torch.full_like(kv, 0xAB)
        want_kv = back.clone()
        for e, h, n in expected:
            want_kv[e : e + n] = want_host[h : h + n]
        executor(back, got, runs, False)
        assert torch.equal(back, want_kv)


def _run_memmove(kv: torch.Tensor, host: torch.Tensor, runs: CopyRuns, is_store: bool) -> None:
    for work in loops.cpu_work(runs, is_store, kv.data_ptr(), host.data_ptr(), parts=2):
        loops.memmove_arrays(*work)


def _run_native(kv: torch.Tensor, host: torch.Tensor, runs: CopyRuns, is_store: bool) -> None:
    kernel = _native.KERNEL
    assert kernel is not None, "the native copy kernel is not built"
    pool = kernel.pool(1)
    try:
        for granule, helpers in ((0, None), (64, pool)):  # on this thread, and in granules shared with a helper
            kernel.job(
                helpers,
                (runs.engine_offsets.numpy(), runs.host_offsets.numpy(), runs.lengths.numpy()),
                None,
                is_store=is_store,
                kv_base=kv.data_ptr(),
                host_base=host.data_ptr(),
                digests=None,
                flags=_native.FUSED | _native.STREAM,
                granule=granule,
            )
    finally:
        if pool is not None:
            pool.close()


def _run_indexed(kv: torch.Tensor, host: torch.Tensor, runs: CopyRuns, is_store: bool) -> None:
    cuda._indexed_transfer(kv, host, runs, is_store)


def test_cpu_work_splits_long_runs_evenly() -> None:
    piece = loops.PIECE_BYTES
    runs = CopyRuns(
        torch.tensor([0, 3 * piece]),
        torch.tensor([0, 5 * piece]),
        torch.tensor([3 * piece, 10]),
        3 * piece + 10,
    )
    parts = loops.cpu_work(runs, True, kv_ptr=1000, host_ptr=0, parts=2)
    assert [int(p[2].sum()) for p in parts] == [2 * piece, piece + 10]
    assert parts[0][1].tolist() == [1000, 1000 + piece] and parts[1][0].tolist() == [2 * piece, 5 * piece]


# -- the engine ---------------------------------------------------------------------------------------


@pytest.fixture
def mixed() -> Iterator[tuple[Engine, TransferLayout, HostPool, torch.Tensor]]:
    engine = layer_major([[("a0", 64), ("a1", 64)], [("b0", 20), ("b1", 44)]], num_blocks=40)
    layout = make_layout(engine)
    kv = random_bytes(engine.size, seed=3)
    with make_pool(layout.worker_kv_bytes_per_block, bpc=3, num_chunks=16) as pool:
        yield engine, layout, pool, kv


def _round_trip(engine: Engine, layout: TransferLayout, pool: HostPool, kv: torch.Tensor, seed: int) -> None:
    """Store random blocks, wipe engine memory, load them into other random blocks; check every byte."""
    gen = torch.Generator().manual_seed(seed)
    bpc = pool.plan.blocks_per_chunk
    sizes = [5, 4][: len(layout.groups)]
    indices = [4, 2][: len(layout.groups)]
    chunk_count = sum(-(-(n + b % bpc) // bpc) for n, b in zip(sizes, indices, strict=True))
    stored = torch.randperm(engine.num_blocks, generator=gen)[: sum(sizes)].tolist()
    loaded = torch.randperm(engine.num_blocks, generator=gen)[: sum(sizes)].tolist()
    chunks = torch.randperm(pool.num_chunks, generator=gen)[:chunk_count].tolist()
    original = kv.clone()
    pool.rows.fill_(0xCD)
    with CopyEngine(kv, layout, pool) as mover:
        mover.submit_store(1, group_sizes=sizes, block_indices=indices, block_ids=stored, chunk_ids=chunks)
        mover.wait([1])
        assert [(r.job_id, r.success, r.is_store) for r in mover.poll()] == [(1, True, True)]
        host = pool.rows.reshape(-1)
        pages = reference_pages(layout, sizes, indices, stored, chunks, bpc, pool.row_bytes)
        untouched = torch.ones_like(host, dtype=torch.bool)
        for _, h, n in pages:
            untouched[h : h + n] = False
        assert bool((host[untouched] == 0xCD).all()), "store wrote outside the pages"
        kv.fill_(0xAB)
        mover.submit_load(2, group_sizes=sizes, block_indices=indices, block_ids=loaded, chunk_ids=chunks)
        mover.wait([2])
        (result,) = mover.poll()
        assert result.success and not result.is_store and result.num_bytes == sum(n for *_, n in pages)
    expected = torch.full_like(kv, 0xAB)
    position = 0
    for g, n in enumerate(sizes):
        for i in range(n):
            for name, _ in engine.groups[g]:
                src, length = engine.page(name, stored[position + i])
                dst, _ = engine.page(name, loaded[position + i])
                expected[dst : dst + length] = original[src : src + length]
        position += n
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_layer_major_groups_partial_chunks(
    mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor], seed: int
) -> None:
    _round_trip(*mixed, seed=seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_with_runs_checked_per_job(
    mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor], seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layout that might reach outside the memories for some ids goes to the Python-driven backend (each job's
    runs checked; with the kernel, still one native call per job): the same bytes move."""
    monkeypatch.setattr(_engine, "_fits_every_id", lambda *args: False)
    engine, layout, pool, kv = mixed
    with CopyEngine(kv, layout, pool) as mover:
        assert isinstance(mover._backend, cpu.CpuBackend)
    _round_trip(engine, layout, pool, kv, seed=seed)


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_round_trip_block_major(bpc: int) -> None:
    engine = block_major([[("l0", 48), ("l1", 16), ("l2", 48)], [("m0", 24)]], num_blocks=32)
    layout = make_layout(engine)
    with make_pool(layout.worker_kv_bytes_per_block, bpc=bpc, num_chunks=12) as pool:
        _round_trip(engine, layout, pool, random_bytes(engine.size, seed=bpc), seed=bpc)


def test_two_blocks_into_one_chunk_the_last_one_wins() -> None:
    """A store naming one chunk twice (two engine blocks into one sub-block) leaves the later block's bytes,
    sealed with their checksum; a load naming it twice fills both blocks."""
    engine = layer_major([[("a", 4096), ("b", 4096)]], num_blocks=16)
    layout = make_layout(engine, wkb=8192)
    kv = random_bytes(engine.size, seed=11)
    original = kv.clone()
    job = {"group_sizes": [3], "block_indices": [0], "chunk_tags": [7, 7, 9]}
    pool = make_pool(layout.worker_kv_bytes_per_block, bpc=1, num_chunks=8)
    with pool, CopyEngine(kv, layout, pool) as mover:
        mover.submit_store(1, block_ids=[1, 2, 3], chunk_ids=[5, 5, 2], **job)  # type: ignore[arg-type]
        mover.wait([1])
        kv.zero_()
        load = {"group_sizes": [2], "block_indices": [0], "chunk_tags": [7, 7]}
        mover.submit_load(2, block_ids=[10, 11], chunk_ids=[5, 5], **load)  # type: ignore[arg-type]
        mover.wait([2])
        assert [(r.job_id, r.success) for r in mover.poll()] == [(1, True), (2, True)]
    for name in ("a", "b"):
        want, length = engine.page(name, 2)
        for block in (10, 11):
            got, _ = engine.page(name, block)
            assert torch.equal(kv[got : got + length], original[want : want + length])


def test_round_trip_big_job_uses_helper_threads() -> None:
    page = 1 << 20
    engine = block_major([[("l0", page), ("l1", page)]], num_blocks=8)
    layout = make_layout(engine)
    kv = random_bytes(engine.size, seed=5)
    original = kv.clone()
    with (
        make_pool(layout.worker_kv_bytes_per_block, bpc=2, num_chunks=4) as pool,
        CopyEngine(kv, layout, pool, cpu_threads=2) as mover,
    ):
        assert len(mover.plan_runs(group_sizes=[4], block_indices=[0], block_ids=[2, 3, 4, 5], chunk_ids=[1, 2])) == 1
        mover.submit_store(1, group_sizes=[4], block_indices=[0], block_ids=[2, 3, 4, 5], chunk_ids=[1, 2])
        kv_view = kv.view(8, -1)
        mover.wait([1])
        kv.zero_()
        mover.submit_load(2, group_sizes=[4], block_indices=[0], block_ids=[4, 5, 6, 7], chunk_ids=[1, 2])
        mover.wait([2])
        assert [r.num_bytes for r in mover.poll()] == [8 * page, 8 * page]
    assert torch.equal(kv_view[4:], original.view(8, -1)[2:6])
    assert int(kv_view[:4].count_nonzero()) == 0


@pytest.mark.parametrize("copy_path", ["native"], indirect=True)
def test_native_engine_calls_made_every_step_keep_the_gil(
    mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor],
) -> None:
    """The engine polls (and holds) at every step: those calls keep the GIL. Dropping it for microseconds at that
    rate starved the process's other threads (a tier's lookup thread in a vLLM engine waited seconds); the calls
    that can block (wait) or run a job inline (submit, in a forked child) still drop it."""
    _, layout, pool, kv = mixed
    with CopyEngine(kv, layout, pool) as mover:
        backend = mover._backend
        assert isinstance(backend, cpu_native.NativeCpuBackend), "the native copy kernel is not built"
        engine = backend._engine
        keeps = {
            name: bool(getattr(engine, name)._flags_ & ctypes._FUNCFLAG_PYTHONAPI)
            for name in ("_poll", "_hold", "_wait", "_submit")
        }
        assert keeps == {"_poll": True, "_hold": True, "_wait": False, "_submit": False}
        mover.submit_store(0, group_sizes=[2, 0], block_indices=[0, 0], block_ids=[1, 2], chunk_ids=[4])
        mover.wait([0])
        assert [(r.job_id, r.success) for r in mover.poll()] == [(0, True)]


def test_ids_accept_tensors_lists_and_arrays(
    mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor],
) -> None:
    _, layout, pool, kv = mixed
    with CopyEngine(kv, layout, pool) as mover:
        forms: list[IdsLike] = [
            [1, 2, 3],
            torch.tensor([1, 2, 3], dtype=torch.int32),
            array.array("q", [1, 2, 3]),
            (1, 2, 3),
            np.array([1, 2, 3], dtype=np.int32),
            np.array([1, 2, 3], dtype=np.uint16),
        ]
        for job_id, ids in enumerate(forms):
            mover.submit_store(job_id, group_sizes=[3, 0], block_indices=[0, 0], block_ids=ids, chunk_ids=[4])
            assert runs_as_triples(
                mover.plan_runs(group_sizes=[3, 0], block_indices=[0, 0], block_ids=ids, chunk_ids=[4])
            ) == runs_as_triples(
                mover.plan_runs(group_sizes=[3, 0], block_indices=[0, 0], block_ids=[1, 2, 3], chunk_ids=[4])
            )
        mover.wait(range(len(forms)))
        assert [(r.job_id, r.success, r.num_bytes) for r in mover.poll()] == [
            (i, True, 3 * 128) for i in range(len(forms))
        ]


def test_ids_beyond_int64_are_rejected(mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor]) -> None:
    _, layout, pool, kv = mixed
    with CopyEngine(kv, layout, pool) as mover, pytest.raises(ConfigError, match="chunk_ids"):
        mover.submit_store(
            1,
            group_sizes=[1, 0],
            block_indices=[0, 0],
            block_ids=[1],
            chunk_ids=np.array([1 << 63], dtype=np.uint64),
        )


def test_job_ids_are_taken_at_submit(mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor]) -> None:
    """Overwriting the caller's id tensors right after submit changes nothing about the job."""
    _, layout, pool, kv = mixed
    original = kv.clone()
    pool.rows.fill_(0)
    blocks = torch.tensor([5, 6, 7, 8, 9], dtype=torch.int64)
    chunks = torch.tensor([2, 3], dtype=torch.int64)
    with CopyEngine(kv, layout, pool, checksums=False) as mover:
        mover.submit_store(1, group_sizes=[5, 0], block_indices=[0, 0], block_ids=blocks, chunk_ids=chunks)
        blocks.fill_(0)
        chunks.fill_(0)
        mover.wait([1])
        assert [r.success for r in mover.poll()] == [True]
    host = pool.rows.reshape(-1)
    pages = reference_pages(layout, [5, 0], [0, 0], [5, 6, 7, 8, 9], [2, 3], 3, pool.row_bytes)
    for e, h, n in pages:
        assert torch.equal(host[h : h + n], original[e : e + n])


def test_completion_is_fifo_per_direction_with_bytes(
    mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor],
) -> None:
    _, layout, pool, kv = mixed
    with CopyEngine(kv, layout, pool) as mover:
        # The loads read chunk 2: it must hold a completed store (integrity refuses unsealed chunks).
        mover.submit_store(1, group_sizes=[0, 3], block_indices=[0, 0], block_ids=[5, 6, 7], chunk_ids=[2])
        mover.wait([1])
        assert [(r.job_id, r.success) for r in mover.poll()] == [(1, True)]
        for job_id in (7, 3, 9):
            mover.submit_store(job_id, group_sizes=[2, 1], block_indices=[0, 0], block_ids=[1, 2, 3], chunk_ids=[0, 1])
        for job_id in (4, 8):
            mover.submit_load(job_id, group_sizes=[0, 3], block_indices=[0, 0], block_ids=[5, 6, 7], chunk_ids=[2])
        mover.wait([7, 3, 9, 4, 8])
        results = mover.poll()
        assert mover.poll() == []
    assert [(r.job_id, r.is_store) for r in results] == [
        (7, True),
        (3, True),
        (9, True),
        (4, False),
        (8, False),
    ]
    assert [r.num_bytes for r in results] == [2 * 128 + 64] * 3 + [3 * 64] * 2
    assert all(r.success and r.error == "" and r.seconds >= 0 for r in results)


def test_failing_copy_reports_failure_and_engine_keeps_working(
    mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, layout, pool, kv = mixed

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("simulated copy failure")

    job = {"group_sizes": [1, 0], "block_indices": [0, 0], "block_ids": [1], "chunk_ids": [0]}
    with CopyEngine(kv, layout, pool) as mover:
        for module, name in COPY_FUNCTIONS:  # whichever copy path the engine takes fails
            monkeypatch.setattr(module, name, broken)
        mover.submit_store(1, **job)
        mover.wait([1], timeout=10)
        (failed,) = mover.poll()
        assert (failed.job_id, failed.success, failed.num_bytes) == (1, False, 0)
        assert failed.error == "OSError: simulated copy failure"
        monkeypatch.undo()
        mover.submit_store(1, **job)
        mover.wait([1], timeout=10)
        assert [r.success for r in mover.poll()] == [True]


def test_many_results_come_back_in_order_with_every_bad_chunk() -> None:
    """More finished jobs than one poll of the native engine hands over, and a load naming more bad chunks than
    its first buffer holds: every result comes back, stores first, each direction in submission order."""
    engine = layer_major([[("a", 64)]], num_blocks=6000)
    layout = make_layout(engine, wkb=64)
    kv = random_bytes(engine.size, seed=4)
    with make_pool(64, bpc=1, num_chunks=6000) as pool, CopyEngine(kv, layout, pool) as mover:
        for i in range(100):
            mover.submit_store(i, group_sizes=[1], block_indices=[0], block_ids=[i], chunk_ids=[i])
        never_stored = list(range(1000, 6000))
        mover.submit_load(1000, group_sizes=[5000], block_indices=[0], block_ids=never_stored, chunk_ids=never_stored)
        mover.wait(range(100))
        mover.wait([1000])
        results = mover.poll()
    assert [r.job_id for r in results] == [*range(100), 1000]
    assert all(r.success for r in results[:100])
    assert not results[-1].success and array.array("q", results[-1].corrupt_chunk_ids).tolist() == never_stored


def test_wait_timeout_raises_transfer_error(
    mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, layout, pool, kv = mixed
    release = threading.Event()
    with CopyEngine(kv, layout, pool) as mover:
        hold_copies(mover, monkeypatch, release)
        mover.submit_load(5, group_sizes=[1, 0], block_indices=[0, 0], block_ids=[1], chunk_ids=[0])
        with pytest.raises(TransferError, match=r"jobs \[5\] did not finish within 0.05s"):
            mover.wait([5], timeout=0.05)
        assert mover.poll() == []
        release.set()
        mover.wait([5, 123])  # unknown ids count as finished
        assert [r.job_id for r in mover.poll()] == [5]


def test_protocol_misuse(mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor]) -> None:
    _, layout, pool, kv = mixed
    job = {"group_sizes": [1, 0], "block_indices": [0, 0], "block_ids": [1], "chunk_ids": [0]}
    mover = CopyEngine(kv, layout, pool)
    mover.submit_store(1, **job)
    with pytest.raises(InvalidStateError, match="job_id=1 is still in flight"):
        mover.submit_load(1, **job)
    with pytest.raises(ConfigError, match="chunk_ids contains 99"):
        mover.submit_load(2, group_sizes=[1, 0], block_indices=[0, 0], block_ids=[1], chunk_ids=[99])
    mover.close()
    mover.close()
    assert [r.job_id for r in mover.poll()] == [1]  # close finishes submitted jobs
    with pytest.raises(InvalidStateError, match="job 3: the copy engine is closed"):
        mover.submit_store(3, **job)


def test_engine_checks_memory_and_pool(mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor]) -> None:
    engine, layout, pool, kv = mixed
    with pytest.raises(ConfigError, match=f"kv_memory has {engine.size - 1} bytes but .* size={engine.size}"):
        CopyEngine(kv[:-1], layout, pool)
    with pytest.raises(ConfigError, match="kv_memory must be contiguous"):
        CopyEngine(kv.view(-1, 2)[:, 0], layout, pool)
    other = make_layout(engine, wkb=layout.worker_kv_bytes_per_block + 8)
    with pytest.raises(
        ConfigError,
        match=r"host pool worker_kv_bytes_per_block=192 differs from the layout's .*=200",
    ):
        CopyEngine(kv, other, pool)
    with pytest.raises(ConfigError, match="cpu_threads=0 must be >= 1"):
        CopyEngine(kv, layout, pool, cpu_threads=0)
    # Engine memory of another dtype is viewed as bytes.
    with CopyEngine(kv.view(torch.float16), layout, pool) as mover:
        mover.submit_store(1, group_sizes=[1, 0], block_indices=[0, 0], block_ids=[0], chunk_ids=[0])
        mover.wait([1])
        assert mover.poll()[0].success


def test_hand_built_layout_outside_memory_is_rejected(
    mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor],
) -> None:
    engine, layout, pool, kv = mixed
    layer = layout.groups[0].layers[0]
    far = dataclasses.replace(layer, engine_offset=engine.size)
    group = kvcopy.GroupLayout((far,), (kvcopy.CopySegment(engine.size, 64, 64, 0),), 64)
    bad = dataclasses.replace(layout, groups=(group, layout.groups[1]))
    with (
        CopyEngine(kv, bad, pool) as mover,
        pytest.raises(ConfigError, match=r"job 1: runs reach engine bytes \[7744, 7808\) outside \[0, 7680\)"),
    ):
        mover.submit_store(1, group_sizes=[1, 0], block_indices=[0, 0], block_ids=[1], chunk_ids=[0])


def test_non_integer_ids_are_rejected(mixed: tuple[Engine, TransferLayout, HostPool, torch.Tensor]) -> None:
    _, layout, pool, kv = mixed
    with CopyEngine(kv, layout, pool) as mover:
        with pytest.raises(ConfigError, match=r"block_ids must hold integers, got dtype torch.float32"):
            mover.submit_store(1, group_sizes=[1, 0], block_indices=[0, 0], block_ids=[1.5], chunk_ids=[0])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="chunk_ids must be a sequence of ints or an integer tensor"):
            mover.submit_store(1, group_sizes=[1, 0], block_indices=[0, 0], block_ids=[1], chunk_ids=["x"])  # type: ignore[list-item]
        mover.submit_store(1, group_sizes=[0, 0], block_indices=[0, 0], block_ids=[], chunk_ids=[])
        mover.wait([1])
        assert [(r.success, r.num_bytes) for r in mover.poll()] == [(True, 0)]


# -- shared pools: replicated (one writer) and one slot per rank ---------------------------------------


def _shared_pools(replicated: bool, wkb: int) -> tuple[HostPool, HostPool]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    plans = [
        plan_host_pool(
            worker_kv_bytes_per_block=wkb,
            world_size=2,
            blocks_per_chunk=2,
            cpu_bytes_to_use=1 << 16,
            replicated=replicated,
            rank=rank,
        )
        for rank in (0, 1)
    ]
    return HostPool(plans[0], engine_id=name), HostPool(plans[1], engine_id=name)


def test_replicated_layout_rank0_writes_every_rank_reads() -> None:
    engine = block_major([[("l0", 32), ("l1", 32)]], num_blocks=8)
    layout = make_layout(engine)
    kv0, kv1 = random_bytes(engine.size, seed=7), torch.zeros(engine.size, dtype=torch.uint8)
    pool0, pool1 = _shared_pools(True, layout.worker_kv_bytes_per_block)
    job = {"group_sizes": [2], "block_indices": [0], "block_ids": [3, 4], "chunk_ids": [5]}
    with pool0, pool1, CopyEngine(kv0, layout, pool0) as rank0, CopyEngine(kv1, layout, pool1) as rank1:
        assert pool0.writes and not pool1.writes and pool1.slot_offset == 0
        rank1.submit_store(1, **job)
        rank1.wait([1])
        assert [r.num_bytes for r in rank1.poll()] == [0]
        assert int(pool0.rows.count_nonzero()) == 0
        rank0.submit_store(1, **job)
        rank0.wait([1])
        assert [r.num_bytes for r in rank0.poll()] == [128]
        rank1.submit_load(2, **job)
        rank1.wait([2])
        assert rank1.poll()[0].success
    assert torch.equal(kv1.view(8, 64)[3:5], kv0.view(8, 64)[3:5])


def test_shared_region_keeps_each_ranks_slot() -> None:
    engine = layer_major([[("a", 16)]], num_blocks=4)
    layout = make_layout(engine)
    pool0, pool1 = _shared_pools(False, layout.worker_kv_bytes_per_block)
    kvs = [torch.full((engine.size,), 10 + rank, dtype=torch.uint8) for rank in (0, 1)]
    job = {"group_sizes": [2], "block_indices": [0], "block_ids": [0, 1], "chunk_ids": [3]}
    with pool0, pool1:
        for kv, pool in zip(kvs, (pool0, pool1), strict=True):
            with CopyEngine(kv, layout, pool) as mover:
                mover.submit_store(1, **job)
                mover.wait([1])
        row = pool0.rows[3]
        assert pool1.slot_offset == 32 == pool0.plan.slot_bytes
        assert row[:32].tolist() == [10] * 32 and row[32:64].tolist() == [11] * 32
        assert int(row[64:].count_nonzero()) == 0


# -- CUDA (extra; skipped without a GPU) ---------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["layer_major", "block_major"])
def test_cuda_round_trip(kind: str) -> None:
    groups = [[("a0", 64), ("a1", 64)], [("b0", 20), ("b1", 44)]]
    engine = layer_major(groups, 40) if kind == "layer_major" else block_major(groups, 40)
    layout = make_layout(engine)
    with make_pool(layout.worker_kv_bytes_per_block, bpc=3, num_chunks=16) as pool:
        assert pool.wait_pinned(timeout=60)
        kv = random_bytes(engine.size, seed=11).cuda()
        _round_trip(engine, layout, pool, kv, seed=11)
