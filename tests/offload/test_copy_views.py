"""Block views: the small-page CPU copy path moves exactly the reference bytes, and the backend picks it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.offload.pool import HostPool
from kvoffload.offload.pool._integrity import SEALED
from kvoffload.offload.worker.copy import CopyEngine, CopySegment, GroupLayout, TransferLayout, build_copy_runs
from kvoffload.offload.worker.copy import _cpu_loops as loops
from kvoffload.offload.worker.copy import _views as views
from kvoffload.offload.worker.copy._views import BlockViews, _group_pieces
from tests.offload.test_copy_engine import (
    Engine,
    jobs,
    layer_major,
    make_layout,
    make_pool,
    random_bytes,
    reference_pages,
)


def _group(*segments: tuple[int, int, int, int]) -> GroupLayout:
    """A group of (engine_offset, block_stride, length, host_offset) segments."""
    return GroupLayout((), tuple(CopySegment(*s) for s in segments), 0)


def test_pages_stepping_evenly_in_engine_and_packed_in_host_are_one_piece() -> None:
    # four layers' pages, each in its own region of 10 blocks: one (4, page) view per block
    page, blocks = 4096, 10
    pieces = _group_pieces(_group(*((i * blocks * page, page, page, i * page) for i in range(4))))
    assert pieces is not None and len(pieces) == 1
    (p,) = pieces
    assert (p.pages, p.width, p.page_stride, p.host_stride) == (4, page, blocks * page, page)


def test_irregular_steps_split_and_views_stay_small() -> None:
    irregular = _group((0, 64, 64, 0), (1024, 64, 64, 64), (4096, 64, 64, 128))  # steps 1024 then 3072
    assert [p.pages for p in _group_pieces(irregular) or ()] == [2, 1]
    page = 48 << 10  # two pages fit one view, a third would not
    three = _group(*((i * page * 4, page * 4, page, i * page) for i in range(3)))
    assert [p.pages for p in _group_pieces(three) or ()] == [2, 1]


def test_unaligned_or_too_long_pages_take_the_run_path() -> None:
    assert _group_pieces(_group((4, 64, 64, 0))) is None
    assert _group_pieces(_group((0, 64, 60, 0))) is None
    too_long = views.MAX_PAGE_BYTES + 8
    assert _group_pieces(_group((0, too_long, too_long, 0))) is None


@settings(max_examples=150, deadline=None)
@given(jobs(unit=8), st.integers(0, 2), st.integers(1, 3))
def test_views_move_exactly_the_reference_bytes(
    case: tuple[Engine, TransferLayout, dict[str, list[int]], int, int], pad_words: int, step: int
) -> None:
    engine, layout, spec, bpc, num_chunks = case
    pad = 8 * pad_words
    row = layout.worker_kv_bytes_per_block * bpc + pad
    runs = build_copy_runs(
        layout, blocks_per_chunk=bpc, num_chunks=num_chunks, host_row_bytes=row, host_slot_offset=pad, **spec
    )
    expected = reference_pages(layout, **spec, bpc=bpc, row_bytes=row, slot_offset=pad)
    kv = random_bytes(engine.size, seed=2)
    host = torch.full((num_chunks * row,), 0xCD, dtype=torch.uint8)
    block_views = BlockViews(kv, host, layout)
    blocks = runs.blocks
    if blocks is None:  # a job without pages
        assert not expected
        return
    assert block_views.supports(sorted(set(blocks.groups.tolist()))) and BlockViews.host_words(blocks)
    want_host = host.clone()
    for e, h, n in expected:
        want_host[h : h + n] = kv[e : e + n]
    job = block_views.job(blocks, True)
    loops.copy_views(job, 0, len(job.ends), step, memoryview(host.numpy()), None, [])
    assert torch.equal(host, want_host)
    back = torch.full_like(kv, 0xAB)
    want_kv = back.clone()
    for e, h, n in expected:
        want_kv[e : e + n] = want_host[h : h + n]
    load_views = BlockViews(back, host, layout)
    job = load_views.job(blocks, False)
    loops.copy_views(job, 0, len(job.ends), step, memoryview(host.numpy()), None, [])
    assert torch.equal(back, want_kv)


def _jobs_for(page: int) -> tuple[CopyEngine, HostPool, dict[str, list[int]], torch.Tensor]:
    engine = layer_major([[(f"l{i}", page) for i in range(4)]], num_blocks=12)
    layout = make_layout(engine)
    kv = random_bytes(engine.size, seed=5)
    pool = make_pool(layout.worker_kv_bytes_per_block, bpc=2, num_chunks=8)
    job = {"group_sizes": [6], "block_indices": [1], "block_ids": [7, 2, 9, 0, 4, 11], "chunk_ids": [5, 1, 6, 3]}
    return CopyEngine(kv, layout, pool, cpu_threads=2, native=False), pool, job, kv  # views: the Python path


@pytest.mark.parametrize("page", [4096, views.MAX_PAGE_BYTES + 4096])
def test_backend_uses_views_for_small_pages_and_runs_for_long_ones(page: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small pages never reach memmove, long ones never reach the views; both round-trip and verify."""
    small = page <= views.MAX_PAGE_BYTES

    def unused(*args: object) -> None:
        raise AssertionError("wrong copy path")

    monkeypatch.setattr(loops, "memmove_runs" if small else "copy_views", unused)
    mover, pool, job, kv = _jobs_for(page)
    with pool, mover:
        original = kv.clone()
        mover.submit_store(1, **job)  # type: ignore[arg-type]
        mover.wait([1], timeout=30)
        kv.zero_()
        mover.submit_load(2, **job)  # type: ignore[arg-type]
        mover.wait([2], timeout=30)
        assert [(r.job_id, r.success, r.error) for r in mover.poll()] == [(1, True, ""), (2, True, "")]
    blocks = job["block_ids"]
    assert torch.equal(kv.view(4, 12, page)[:, blocks], original.view(4, 12, page)[:, blocks])


def test_view_path_checksums_are_the_xxh3_of_each_sub_block() -> None:
    page = 4096
    mover, pool, job, _ = _jobs_for(page)
    with pool, mover:
        mover.submit_store(1, **job)  # type: ignore[arg-type]
        mover.wait([1], timeout=30)
        assert mover.poll()[0].success
        meta = pool.integrity.storage.view(-1, 3)
        host = memoryview(pool.rows.reshape(-1).numpy())
        wkb = 4 * page
        # block_indices=[1] with 2 blocks per chunk: the six blocks enter chunk 5 at sub-block 1
        for chunk, sub in [(5, 1), (1, 0), (1, 1), (6, 0), (6, 1), (3, 0)]:
            entry = int(pool.integrity.entry_index(np.array([chunk]), np.array([sub]))[0])
            start = chunk * pool.row_bytes + sub * wkb
            digest = xxhash.xxh3_64_intdigest(host[start : start + wkb])
            assert int(meta[entry, 1]) == digest - (1 << 64) * (digest >= 1 << 63)
            assert int(meta[entry, 2]) == SEALED
