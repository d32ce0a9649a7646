"""The CUDA backend's job flow: lanes, completers, checksums off the submitting thread, failures, ordering.

Without a GPU the backend runs on CPU memory with its host timeline (copies on the lane thread, events as
times), which drives the same threads and the same ops; every result is compared with the CPU backend's
bytes. The tests marked ``cuda`` run the real thing (streams, events, pinned pool) and skip without a GPU.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import pytest
import torch

from kvoffload import JobResult
from kvoffload._packed import unpack_int64
from kvoffload.errors import TransferError
from kvoffload.offload.pool import BlockSlots, Digests, HostPool, plan_host_pool
from kvoffload.offload.worker.copy import CopyEngine, TransferLayout, build_transfer_layout
from kvoffload.offload.worker.copy._backend import Integrity
from kvoffload.offload.worker.copy._cuda import CudaBackend
from kvoffload.offload.worker.copy._cuda_kernel import TileKernel, load_kernel
from kvoffload.offload.worker.copy._cuda_plan import Mode, Policy
from tests.helpers import Placement

F = TypeVar("F", bound=Callable[..., object])


def needs_cuda(test: F) -> F:
    """Marked ``cuda`` (``pytest -m cuda`` on the GPU machine) and skipped without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


PAGE, SMALL, BLOCKS = 256, 64, 24
WKB = 2 * PAGE + SMALL
TOTAL = 2 * BLOCKS * PAGE + BLOCKS * SMALL
JOB = {"group_sizes": [5, 3], "block_indices": [0, 0]}


def _layout() -> TransferLayout:
    """Group 0: layers a, b (layer-major, 256 B pages); group 1: layer c (64 B pages)."""
    return build_transfer_layout(
        [
            Placement(size=TOTAL, layers=("a", "b"), layer_stride=BLOCKS * PAGE, block_stride=PAGE),
            Placement(size=TOTAL, layers=("c",), layer_stride=0, block_stride=SMALL, offset=2 * BLOCKS * PAGE),
        ],
        [[("a", PAGE), ("b", PAGE)], [("c", SMALL)]],
        num_blocks=BLOCKS,
        worker_kv_bytes_per_block=WKB,
    )


def _pool(*, engine_id: str | None = None, world_size: int = 1, rank: int = 0, replicated: bool = False) -> HostPool:
    plan = plan_host_pool(
        worker_kv_bytes_per_block=WKB,
        world_size=world_size,
        blocks_per_chunk=1,
        cpu_bytes_to_use=16 * 4096 * world_size,
        replicated=replicated,
        rank=rank,
    )
    return HostPool(plan, engine_id=engine_id)


def _kv(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (TOTAL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def interpreted() -> TileKernel:
    kernel = load_kernel(interpret=True)
    assert kernel is not None, "Triton is a dependency of torch on Linux x86-64"
    return kernel


class RecordingIntegrity(Integrity):
    """The pool's integrity, noting which thread seals and verifies, and what the host bytes were then."""

    calls: list[tuple[str, int, bytes]]

    def seal(self, slots: BlockSlots | None, sums: Digests | None = None) -> None:
        self.calls.append(("seal", threading.get_ident(), bytes(self.host)))
        super().seal(slots, sums)

    def verify(self, slots: BlockSlots | None, sums: Digests | None = None) -> list[int]:
        self.calls.append(("verify", threading.get_ident(), bytes(self.host)))
        return super().verify(slots, sums)


def cuda_flow(
    kv: torch.Tensor,
    pool: HostPool,
    *,
    checksums: bool = True,
    policy: Policy | None = None,
    kernel: object = None,
    record: bool = False,
) -> CopyEngine:
    """A CopyEngine on CPU memory whose backend is the CUDA backend (host timeline)."""
    mover = CopyEngine(kv, _layout(), pool, checksums=checksums)
    mover._backend.close()
    host = pool.rows.reshape(-1)
    kind = RecordingIntegrity if record else Integrity
    integrity = kind(pool.integrity, memoryview(host.numpy()), checksums)  # type: ignore[arg-type]
    if record:
        object.__setattr__(integrity, "calls", [])
    mover._backend = CudaBackend(kv.view(-1), host, integrity, policy=policy, kernel=kernel, hash_threads=2)  # type: ignore[arg-type]
    return mover


@dataclass
class Exchange:
    host: torch.Tensor
    table: torch.Tensor
    kv: torch.Tensor
    results: list[JobResult]


def _exchange(mover: CopyEngine, pool: HostPool, kv: torch.Tensor) -> Exchange:
    """Store blocks into chunks, load them back into other blocks (wiped first); everything that resulted."""
    with mover:
        mover.submit_store(1, **JOB, block_ids=[3, 9, 4, 0, 17, 6, 2, 21], chunk_ids=[7, 2, 3, 11, 5, 0, 9, 12])
        mover.wait([1], timeout=30)
        kv.fill_(0xAB)
        mover.submit_load(2, **JOB, block_ids=[1, 5, 8, 12, 13, 20, 22, 23], chunk_ids=[7, 2, 3, 11, 5, 0, 9, 12])
        mover.wait([2], timeout=30)
        results = mover.poll()
    return Exchange(pool.rows.clone(), pool.integrity.storage.clone(), kv.clone(), results)


def _reference(checksums: bool) -> Exchange:
    kv = _kv(7)
    with _pool() as pool:
        return _exchange(CopyEngine(kv, _layout(), pool, checksums=checksums), pool, kv)


def _same(got: Exchange, want: Exchange) -> None:
    assert torch.equal(got.host, want.host)
    assert torch.equal(got.table, want.table)  # the same tags, checksums and states
    assert torch.equal(got.kv, want.kv)
    assert [(r.job_id, r.success, r.is_store, r.num_bytes) for r in got.results] == [
        (r.job_id, r.success, r.is_store, r.num_bytes) for r in want.results
    ]
    assert all(r.success for r in got.results)


# -- the job flow on CPU ---------------------------------------------------------------------------------


@pytest.mark.parametrize("checksums", [True, False])
@pytest.mark.parametrize("mode", ["auto", "dma", "gather", "kernel"])
def test_every_mode_moves_what_the_cpu_backend_moves(interpreted: TileKernel, mode: Mode, checksums: bool) -> None:
    kv = _kv(7)
    with _pool() as pool:
        mover = cuda_flow(
            kv, pool, checksums=checksums, policy=Policy(mode=mode, dma_min_bytes=512), kernel=interpreted
        )
        _same(_exchange(mover, pool, kv), _reference(checksums))


def test_checksums_are_sealed_after_the_copy_and_never_on_the_submitting_thread(interpreted: TileKernel) -> None:
    kv = _kv(7)
    with _pool() as pool:
        mover = cuda_flow(kv, pool, kernel=interpreted, record=True)
        integrity = mover._backend._integrity  # type: ignore[attr-defined]
        got = _exchange(mover, pool, kv)
    _same(got, _reference(True))
    (seal, verify) = integrity.calls
    assert seal[0] == "seal" and verify[0] == "verify"
    assert threading.get_ident() not in (seal[1], verify[1])
    assert seal[2] == verify[2] == bytes(got.host.reshape(-1).numpy())  # sealed the final bytes


def _corrupt(result: JobResult) -> list[int]:
    return list(unpack_int64(result.corrupt_chunk_ids))


@pytest.mark.parametrize("checksums", [True, False])
def test_a_flipped_byte_fails_the_load_with_checksums_and_a_wrong_tag_always(checksums: bool) -> None:
    kv = _kv(3)
    with _pool() as pool, cuda_flow(kv, pool, checksums=checksums) as mover:
        tags = [11, 12, 13, 14, 15, 16, 17, 18]
        chunks = [7, 2, 3, 11, 5, 0, 9, 12]
        mover.submit_store(1, **JOB, block_ids=list(range(8)), chunk_ids=chunks, chunk_tags=tags)
        mover.wait([1], timeout=30)
        pool.rows[3, 10] ^= 0xFF  # chunk 3 (the third block of group 0)
        mover.submit_load(2, **JOB, block_ids=list(range(8, 16)), chunk_ids=chunks, chunk_tags=tags)
        mover.submit_load(3, **JOB, block_ids=list(range(8, 16)), chunk_ids=chunks, chunk_tags=[*tags[:7], 99])
        mover.wait([2, 3], timeout=30)
        stored, flipped, mislabelled = mover.poll()
    assert stored.success
    assert (flipped.success, _corrupt(flipped)) == ((False, [3]) if checksums else (True, []))
    assert (mislabelled.success, _corrupt(mislabelled)) == (False, [3, 12] if checksums else [12])


class Gate:
    """The interpreted kernel, held at its first store (a copy into the host pool) until released."""

    def __init__(self, kernel: TileKernel, host: torch.Tensor) -> None:
        self.kernel, self.host = kernel, host
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, dst: torch.Tensor, src: torch.Tensor, table: torch.Tensor, n: int, tile: int) -> None:
        self.calls += 1
        if dst.data_ptr() == self.host.data_ptr():
            assert self.release.wait(30)
        self.kernel(dst, src, table, n, tile)


def test_submit_never_waits_and_results_keep_each_directions_order(interpreted: TileKernel) -> None:
    kv = _kv(5)
    with _pool() as pool:
        gate = Gate(interpreted, pool.rows.reshape(-1))
        mover = cuda_flow(kv, pool, checksums=False, policy=Policy(mode="kernel"), kernel=gate)
        with mover:
            started = time.monotonic()
            for job in (1, 2, 3):
                mover.submit_store(job, **JOB, block_ids=list(range(8)), chunk_ids=list(range(job, job + 8)))
            mover.submit_load(4, **JOB, block_ids=list(range(8, 16)), chunk_ids=list(range(8)))
            assert time.monotonic() - started < 5  # the first store is held in the kernel meanwhile
            mover.wait([4], timeout=30)
            assert [r.job_id for r in mover.poll()] == [4]  # a load is not held behind the stores
            with pytest.raises(TransferError, match=r"jobs \[1, 3\] did not finish within 0.05s"):
                mover.wait([1, 3], timeout=0.05)
            assert mover.poll() == []
            gate.release.set()
            mover.wait([1, 2, 3], timeout=30)
            assert [(r.job_id, r.success) for r in mover.poll()] == [(1, True), (2, True), (3, True)]


def test_close_finishes_the_jobs_in_flight() -> None:
    kv = _kv(5)
    with _pool() as pool:
        mover = cuda_flow(kv, pool)
        for job in range(1, 6):
            mover.submit_store(job, **JOB, block_ids=list(range(8)), chunk_ids=list(range(job, job + 8)))
        mover.close()
        assert [(r.job_id, r.success) for r in mover.poll()] == [(j, True) for j in range(1, 6)]


def test_a_failing_job_fails_alone() -> None:
    kv = _kv(5)
    with _pool() as pool, cuda_flow(kv, pool, policy=Policy(mode="kernel"), kernel=None) as mover:
        mover.submit_store(1, **JOB, block_ids=list(range(8)), chunk_ids=list(range(8)))
        mover.wait([1], timeout=30)
        mover._backend.policy = Policy(mode="gather")  # type: ignore[attr-defined]
        mover.submit_store(2, **JOB, block_ids=list(range(8)), chunk_ids=list(range(8)))
        mover.wait([2], timeout=30)
        failed, done = mover.poll()
    assert not failed.success and failed.num_bytes == 0
    assert failed.error == "ConfigError: mode='kernel' needs the zero-copy kernel (Triton) and a registered host pool"
    assert done.success


def test_a_kernel_that_cannot_launch_is_turned_off_and_the_job_gathered() -> None:
    calls = []

    def broken(*args: object) -> None:
        calls.append(args)
        raise RuntimeError("no compiler")

    kv = _kv(7)
    with _pool() as pool:
        mover = cuda_flow(kv, pool, kernel=broken)
        got = _exchange(mover, pool, kv)
    _same(got, _reference(True))
    assert mover._backend.kernel_error == "RuntimeError: no compiler"  # type: ignore[attr-defined]
    assert len(calls) == 1  # the store's try; the load went straight to the gather


def test_a_rank_that_does_not_write_completes_its_store_empty() -> None:
    engine_id = f"test-{uuid.uuid4().hex[:12]}"
    with (
        _pool(engine_id=engine_id, world_size=2, rank=0, replicated=True) as writer,
        _pool(engine_id=engine_id, world_size=2, rank=1, replicated=True) as reader,
        cuda_flow(_kv(1), reader) as mover,
    ):
        assert writer.writes and not reader.writes
        mover.submit_store(1, **JOB, block_ids=list(range(8)), chunk_ids=list(range(8)))
        mover.wait([1], timeout=30)
        (result,) = mover.poll()
    assert (result.success, result.num_bytes) == (True, 0)


# -- on a GPU ----------------------------------------------------------------------------------------------


@pytest.fixture
def gpu_pool() -> Iterator[HostPool]:
    with _pool() as pool:
        assert pool.wait_pinned(timeout=60), pool.pin_error
        yield pool


@pytest.mark.parametrize("checksums", [True, False])
@pytest.mark.parametrize("mode", ["auto", "dma", "gather", "kernel"])
@needs_cuda
def test_cuda_every_mode_moves_what_the_cpu_backend_moves(gpu_pool: HostPool, mode: Mode, checksums: bool) -> None:
    kv = _kv(7).cuda()
    mover = CopyEngine(kv, _layout(), gpu_pool, checksums=checksums)
    backend = mover._backend
    assert isinstance(backend, CudaBackend)
    backend.policy = Policy(mode=mode, dma_min_bytes=512)
    got = _exchange(mover, gpu_pool, kv)
    assert backend.kernel_error is None
    _same(Exchange(got.host, got.table, got.kv.cpu(), got.results), _reference(checksums))


@pytest.mark.parametrize("mode", ["auto", "dma", "gather", "kernel"])
@needs_cuda
def test_cuda_a_store_follows_the_compute_stream(gpu_pool: HostPool, mode: Mode) -> None:
    """Blocks written by a kernel still queued on the engine's stream are stored as written, unsynchronized."""
    kv = torch.zeros(TOTAL, dtype=torch.uint8, device="cuda")
    with CopyEngine(kv, _layout(), gpu_pool) as mover:
        mover._backend.policy = Policy(mode=mode, dma_min_bytes=512)  # type: ignore[attr-defined]
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on the current stream
        kv.fill_(0x5A)
        mover.submit_store(1, **JOB, block_ids=list(range(8)), chunk_ids=list(range(8)))
        mover.wait([1], timeout=30)
        (result,) = mover.poll()
    assert result.success
    # group 0's blocks went to chunks 0-4 (pages a, b), group 1's to chunks 5-7 (page c, at its slot's start)
    assert bool((gpu_pool.rows[:5, : 2 * PAGE] == 0x5A).all()) and bool((gpu_pool.rows[5:8, :SMALL] == 0x5A).all())


@needs_cuda
def test_cuda_small_scattered_pages_take_the_kernel(gpu_pool: HostPool) -> None:
    kv = _kv(7).cuda()
    with CopyEngine(kv, _layout(), gpu_pool) as mover:
        backend = mover._backend
        assert isinstance(backend, CudaBackend)
        mover.submit_store(1, **JOB, block_ids=list(range(8)), chunk_ids=list(range(8)))
        mover.wait([1], timeout=60)
        assert mover.poll()[0].success
        assert backend._kernel_now() is not None, "Triton is on the GPU machine: the kernel must load"
        assert backend.kernel_error is None


def test_stores_and_loads_launch_the_kernel_at_once(interpreted: TileKernel) -> None:
    """Both lanes launch the kernel concurrently (Triton's interpreter is not thread-safe: the launch lock)."""
    kv = _kv(9)
    original = kv.clone()
    stored_blocks, loaded_blocks = list(range(8)), list(range(8, 16))
    a, b = list(range(8)), list(range(8, 16))
    with _pool() as pool, cuda_flow(kv, pool, policy=Policy(mode="kernel"), kernel=interpreted) as mover:
        mover.submit_store(1, **JOB, block_ids=stored_blocks, chunk_ids=a)
        mover.wait([1], timeout=30)
        for job in range(2, 14, 2):
            mover.submit_store(job, **JOB, block_ids=stored_blocks, chunk_ids=b)
            mover.submit_load(job + 1, **JOB, block_ids=loaded_blocks, chunk_ids=a)
        mover.wait(range(2, 14), timeout=60)
        results = mover.poll()
    assert [(r.job_id, r.success) for r in results] == [(j, True) for j in (1, *range(2, 14, 2), *range(3, 14, 2))]
    for i, (block_from, block_to) in enumerate(zip(stored_blocks, loaded_blocks, strict=True)):
        # group 0 (the first 5 blocks): pages a and b; group 1: page c
        pages = [(0, PAGE), (BLOCKS * PAGE, PAGE)] if i < 5 else [(2 * BLOCKS * PAGE, SMALL)]
        for base, size in pages:
            src, dst = base + block_from * size, base + block_to * size
            assert torch.equal(kv[dst : dst + size], original[src : src + size])
