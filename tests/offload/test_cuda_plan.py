"""The CUDA backend's planning (numpy) and its torch ops, on CPU: every way a job's runs can move (DMA runs,
the row gather, the zero-copy kernel's tiles in Triton's interpreter) must move exactly the runs' bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError
from kvoffload.offload.worker.copy import CopyRuns
from kvoffload.offload.worker.copy import _cuda_ops as ops
from kvoffload.offload.worker.copy import _cuda_plan as plan
from kvoffload.offload.worker.copy._cuda_kernel import TileKernel, load_kernel

MODES = ("auto", "dma", "gather", "kernel")


@pytest.fixture(scope="module")
def interpreted() -> TileKernel:
    """The zero-copy kernel in Triton's interpreter (CPU tensors); fails if Triton is missing."""
    kernel = load_kernel(interpret=True)
    assert kernel is not None, "Triton is a dependency of torch on Linux x86-64"
    return kernel


# -- random jobs ---------------------------------------------------------------------------------------


@st.composite
def jobs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs that overlap on neither side: lengths and gaps are multiples of a unit, placed in random orders
    on each side, gaps often zero (so neighbours on both sides merge)."""
    unit = draw(st.sampled_from([1, 2, 4, 8, 24, 64]))
    n = draw(st.integers(1, 10))
    lengths = np.array([unit * draw(st.integers(1, 24)) for _ in range(n)], dtype=np.int64)

    def place(side: str) -> np.ndarray:
        order = draw(st.permutations(range(n)))
        offsets = np.zeros(n, dtype=np.int64)
        at = unit * draw(st.integers(0, 3), label=f"{side} start")
        for i in order:
            offsets[i] = at
            at += int(lengths[i]) + unit * draw(st.sampled_from([0, 0, 1, 5]), label=f"{side} gap")
        return offsets

    return place("engine"), place("host"), lengths


def expand(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every byte of the runs, run after run (the element-wise reference)."""
    if not lengths.size:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lengths, strict=True)])


def reference_pairs(engine: np.ndarray, host: np.ndarray, length: np.ndarray) -> set[tuple[int, int]]:
    return set(zip(expand(engine, length).tolist(), expand(host, length).tolist(), strict=True))


def plan_pairs(job: plan.JobPlan, is_store: bool) -> list[tuple[int, int]]:
    """(engine byte, host byte) of every byte the plan moves, read back from its indices alone."""
    pairs = list(zip(expand(job.dma.engine, job.dma.length), expand(job.dma.host, job.dma.length), strict=True))
    if job.gather is not None:
        g = job.gather
        engine_of_staging = (g.rows[:, None] * g.row_bytes + np.arange(g.row_bytes)).reshape(-1)
        staging = expand(g.stretch_staging, g.stretch_length)
        pairs += zip(engine_of_staging[staging], expand(g.stretch_host, g.stretch_length), strict=True)
    if job.tiles is not None:
        t = job.tiles
        e = t.element_bytes
        src, dst = expand(t.src * e, t.length * e), expand(t.dst * e, t.length * e)
        pairs += zip(src, dst, strict=True) if is_store else zip(dst, src, strict=True)
    return [(int(a), int(b)) for a, b in pairs]


# -- planning ------------------------------------------------------------------------------------------


@settings(max_examples=300)
@given(
    job=jobs(),
    mode=st.sampled_from(MODES),
    kernel=st.booleans(),
    dma_min=st.sampled_from([1, 16, 64, 200, 1 << 20]),
    tile=st.sampled_from([8, 16, 64, 256]),
    kv_ptr=st.sampled_from([0, 1, 2, 4, 8, 4096]),
    host_ptr=st.sampled_from([0, 2, 8, 4096]),
    is_store=st.booleans(),
)
def test_every_way_moves_exactly_the_runs_bytes(
    job: tuple[np.ndarray, np.ndarray, np.ndarray],
    mode: plan.Mode,
    kernel: bool,
    dma_min: int,
    tile: int,
    kv_ptr: int,
    host_ptr: int,
    is_store: bool,
) -> None:
    engine, host, length = job
    policy = plan.Policy(mode=mode, dma_min_bytes=dma_min, tile_bytes=tile)
    if mode == "kernel" and not kernel:
        with pytest.raises(ConfigError, match="mode='kernel' needs the zero-copy kernel"):
            plan.plan_job(engine, host, length, is_store=is_store, policy=policy, kernel=kernel)
        return
    out = plan.plan_job(
        engine, host, length, is_store=is_store, policy=policy, kernel=kernel, kv_ptr=kv_ptr, host_ptr=host_ptr
    )
    pairs = plan_pairs(out, is_store)
    assert len(pairs) == len(set(pairs)) == out.num_bytes == int(length.sum())  # each byte once
    assert set(pairs) == reference_pairs(engine, host, length)
    # The rule: long runs are DMAs, the rest are gathered or tiled, as the mode says.
    if mode == "auto":
        assert bool((out.dma.length >= dma_min).all())
    gathered = 0 if out.gather is None else out.gather.num_bytes
    tiled = 0 if out.tiles is None else int(out.tiles.length.sum()) * out.tiles.element_bytes
    assert out.dma.num_bytes + gathered + tiled == out.num_bytes
    assert out.gather is None or out.tiles is None
    if mode == "dma":
        assert out.gather is None and out.tiles is None
    if mode == "gather":
        assert len(out.dma) == 0 and out.tiles is None
    if not kernel:
        assert out.tiles is None
    if mode == "kernel":
        assert len(out.dma) == 0 and out.gather is None
    if out.gather is not None:
        g = out.gather
        assert g.row_bytes % g.element_bytes == 0 and kv_ptr % g.element_bytes == 0
        assert g.rows.size * g.row_bytes == g.num_bytes
    if out.tiles is not None:
        t = out.tiles
        assert bool((t.length >= 1).all()) and bool((t.length <= t.tile_elements).all())
        assert t.tile_elements * t.element_bytes == tile
        assert kv_ptr % t.element_bytes == 0 and host_ptr % t.element_bytes == 0


@given(job=jobs())
def test_row_index_is_the_element_index_in_rows(job: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    engine, _, length = job
    width = plan.row_bytes(engine, length)
    assert all(int(e) % width == 0 and int(n) % width == 0 for e, n in zip(engine, length, strict=True))
    rows = plan.row_index(engine, length, width)
    assert rows.size == int(length.sum()) // width
    as_bytes = (rows[:, None] * width + np.arange(width)).reshape(-1)
    assert as_bytes.tolist() == expand(engine, length).tolist()


def test_page_aligned_runs_index_one_row_per_page() -> None:
    page = 32 << 10
    engine = np.array([7, 3, 12], dtype=np.int64) * page
    length = np.full(3, page, dtype=np.int64)
    assert plan.row_bytes(engine, length) == page
    assert plan.row_index(engine, length, page).tolist() == [7, 3, 12]
    assert plan.row_index(engine, length * 2, page).tolist() == [7, 8, 3, 4, 12, 13]
    assert plan.element_bytes(page, 4096) == 8 and plan.element_bytes(page, 4100) == 4


@given(job=jobs())
def test_sorting_merges_runs_that_continue_on_both_sides(job: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    engine, host, length = job
    runs = plan.sort_runs(engine, host, length)
    assert bool((np.diff(runs.host) > 0).all())
    ends_e, ends_h = runs.engine[:-1] + runs.length[:-1], runs.host[:-1] + runs.length[:-1]
    assert not bool(((ends_e == runs.engine[1:]) & (ends_h == runs.host[1:])).any()), "a mergeable pair is left"
    assert reference_pairs(runs.engine, runs.host, runs.length) == reference_pairs(engine, host, length)


def test_sorting_merges_an_example() -> None:
    runs = plan.sort_runs(np.array([150, 0, 100]), np.array([60, 0, 10]), np.array([10, 10, 50]))
    assert (runs.engine.tolist(), runs.host.tolist(), runs.length.tolist()) == ([0, 100], [0, 10], [10, 60])


def test_host_stretches_join_host_contiguous_runs() -> None:
    host, staging, length = plan.host_stretches(np.array([0, 10, 40, 50]), np.array([10, 20, 10, 5]))
    assert (host.tolist(), staging.tolist(), length.tolist()) == ([0, 40], [0, 30], [30, 15])


MIB, KIB = 1 << 20, 1 << 10


def _split(engine: list[int], host: list[int], length: list[int], kernel: bool) -> tuple[int, int, int]:
    out = plan.plan_job(
        np.array(engine), np.array(host), np.array(length), is_store=True, policy=plan.Policy(), kernel=kernel
    )
    gathered = 0 if out.gather is None else out.gather.num_bytes
    tiled = 0 if out.tiles is None else int(out.tiles.length.sum()) * out.tiles.element_bytes
    return out.dma.num_bytes, gathered, tiled


def test_the_dma_gather_kernel_rule() -> None:
    big, page = 2 * MIB, 32 * KIB
    assert plan.DMA_MIN_BYTES == MIB
    # 2 MB runs are DMAs; scattered 32 KB pages take the kernel when it can run, else the gather.
    engine, host, length = [0, 4 * MIB, 8 * MIB], [0, 3 * MIB, 9 * MIB], [big, page, page]
    assert _split(engine, host, length, kernel=True) == (big, 0, 2 * page)
    assert _split(engine, host, length, kernel=False) == (big, 2 * page, 0)
    # 64 pages of 32 KB scattered in engine memory but side by side on the host: one 2 MB stretch, gathered.
    engine = [(7 * i % 64) * 2 * page for i in range(64)]
    host = [i * page for i in range(64)]
    assert _split(engine, host, [page] * 64, kernel=True) == (0, 64 * page, 0)
    # Exactly at the threshold a run is a DMA.
    assert _split([0], [0], [MIB], kernel=True) == (MIB, 0, 0)
    assert _split([0], [0], [MIB - 8], kernel=True) == (0, 0, MIB - 8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "fast"}, "mode='fast' must be one of"),
        ({"dma_min_bytes": 0}, "dma_min_bytes=0 must be >= 1"),
        ({"tile_bytes": 48}, "tile_bytes=48 must be a power of two >= 8"),
        ({"tile_bytes": 4}, "tile_bytes=4 must be a power of two >= 8"),
    ],
)
def test_policy_is_validated(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan.Policy(**kwargs)  # type: ignore[arg-type]


# -- the torch ops on CPU --------------------------------------------------------------------------------


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _shifted(size: int, shift: int, fill: int | None) -> torch.Tensor:
    """A flat tensor starting ``shift`` bytes into its storage (so the ops meet unaligned addresses)."""
    whole = _bytes(size + shift, seed=1) if fill is None else torch.full((size + shift,), fill, dtype=torch.uint8)
    return whole[shift:]


@settings(max_examples=60)
@given(
    job=jobs(),
    mode=st.sampled_from(MODES),
    dma_min=st.sampled_from([1, 64, 1 << 20]),
    shifts=st.tuples(st.sampled_from([0, 1, 4, 8]), st.sampled_from([0, 2, 8])),
)
def test_ops_move_the_bytes_a_plain_copy_moves(
    interpreted: TileKernel,
    job: tuple[np.ndarray, np.ndarray, np.ndarray],
    mode: plan.Mode,
    dma_min: int,
    shifts: tuple[int, int],
) -> None:
    engine, host, length = job
    size = int(max((engine + length).max(), (host + length).max())) + 16
    kv, pool = _shifted(size, shifts[0], None), _shifted(size, shifts[1], 0xCD)
    runs = CopyRuns(torch.from_numpy(engine), torch.from_numpy(host), torch.from_numpy(length), int(length.sum()))
    want_host, want_kv = pool.clone(), torch.full_like(kv, 0xAB)
    for e, h, n in zip(engine.tolist(), host.tolist(), length.tolist(), strict=True):
        want_host[h : h + n] = kv[e : e + n]
        want_kv[e : e + n] = kv[e : e + n]
    policy = plan.Policy(mode=mode, dma_min_bytes=dma_min, tile_bytes=64)
    keep = ops.transfer_runs(kv, pool, runs, True, policy, interpreted)
    assert torch.equal(pool, want_host)
    assert all(isinstance(t, torch.Tensor) for t in keep)
    back = torch.full_like(kv, 0xAB)
    ops.transfer_runs(back, pool, runs, False, policy, interpreted)
    assert torch.equal(back, want_kv)


def test_ops_refuse_a_kernel_plan_without_a_kernel() -> None:
    job = plan.plan_job(np.array([0]), np.array([0]), np.array([64]), is_store=True, policy=plan.Policy(), kernel=True)
    assert job.tiles is not None
    kv, host = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="planned for the zero-copy kernel"):
        ops.enqueue_plan(kv, host, job, True, None)


def test_empty_runs_issue_nothing() -> None:
    kv, host = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    assert ops.transfer_runs(kv, host, CopyRuns.empty(), True) == []
