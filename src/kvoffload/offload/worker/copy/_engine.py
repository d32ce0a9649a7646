"""The :class:`CopyEngine` facade: validates and plans jobs, hands them to the CPU or CUDA backend."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvoffload._generated import JobResult
from kvoffload._placement import TransferLayout
from kvoffload.errors import ConfigError, InvalidStateError, TransferError
from kvoffload.offload.pool import BlockSlots, HostPool
from kvoffload.offload.worker.copy._backend import CopyBackend, Direction, Integrity
from kvoffload.offload.worker.copy._cpu import CpuBackend
from kvoffload.offload.worker.copy._cpu_native import NativeCpuBackend, RefusedJob
from kvoffload.offload.worker.copy._cuda import CudaBackend
from kvoffload.offload.worker.copy._job import CopyJob
from kvoffload.offload.worker.copy._native import KERNEL, NativeKernel
from kvoffload.offload.worker.copy._runs import (
    CopyRuns,
    IdsLike,
    build_block_slots,
    build_copy_runs,
)

__all__ = ["CopyEngine"]


class CopyEngine:
    """Asynchronous page mover between one worker's KV memory and its host pool.

    ``kv_memory`` is the engine's flat backing allocation (any contiguous tensor; viewed as bytes) that
    ``layout`` describes. ``submit_store``/``submit_load`` validate, plan the runs and return at once;
    :meth:`poll` returns finished jobs, in submission order per direction. CPU memory: one thread per
    direction (``cpu_threads`` threads share a big job). CUDA memory: one stream per direction, timed with
    CUDA events. Copy failures become ``JobResult(success=False)``. Call from one thread.

    Integrity (on by default): every store records, per sub-block of this rank's slot, the key tag from
    ``chunk_tags`` and an xxh3_64 checksum of the stored bytes in the pool's table; every load verifies both
    and fails with ``corrupt_chunk_ids`` on a mismatch or a missing entry. ``checksums=False`` skips the
    content checksums (key tags are still written and verified); every rank of a pool must agree on it.

    CPU copies run in the native kernel built at install time (one GIL-free call copies and hashes a share of
    a job) unless ``native=False`` or it was not built; the pure-Python path gives the same bytes and digests.
    """

    def __init__(
        self,
        kv_memory: torch.Tensor,
        layout: TransferLayout,
        host_pool: HostPool,
        *,
        cpu_threads: int | None = None,
        checksums: bool = True,
        native: bool = True,
    ) -> None:
        if not isinstance(checksums, bool):
            raise ConfigError(f"checksums={checksums!r} must be a bool")
        if not isinstance(native, bool):
            raise ConfigError(f"native={native!r} must be a bool")
        if not kv_memory.is_contiguous():
            raise ConfigError(f"kv_memory must be contiguous (shape {tuple(kv_memory.shape)})")
        kv_flat = kv_memory.reshape(-1).view(torch.uint8)
        if kv_flat.numel() < layout.engine_bytes:
            raise ConfigError(
                f"kv_memory has {kv_flat.numel()} bytes but the placements describe an allocation of "
                f"size={layout.engine_bytes}"
            )
        plan = host_pool.plan
        if plan.worker_kv_bytes_per_block != layout.worker_kv_bytes_per_block:
            raise ConfigError(
                f"host pool worker_kv_bytes_per_block={plan.worker_kv_bytes_per_block} differs from the "
                f"layout's worker_kv_bytes_per_block={layout.worker_kv_bytes_per_block}"
            )
        rows = host_pool.rows
        if not rows.is_contiguous() or rows.device.type != "cpu":
            raise ConfigError("host pool rows must be one contiguous CPU tensor")
        threads = min(4, max(1, torch.get_num_threads())) if cpu_threads is None else cpu_threads
        if threads < 1:
            raise ConfigError(f"cpu_threads={cpu_threads} must be >= 1")
        self._layout = layout
        self._bpc = plan.blocks_per_chunk
        self._num_chunks = host_pool.num_chunks
        self._row_bytes = host_pool.row_bytes
        self._slot_offset = host_pool.slot_offset
        self._writes = host_pool.writes
        self._table = host_pool.integrity
        self._checksums = checksums
        self._unpolled: set[int] = set()
        self._closed = False
        host_flat = rows.reshape(-1)
        self._kv_bytes = kv_flat.numel()
        self._host_bytes = host_flat.numel()
        host_bytes: memoryview = memoryview(host_flat.numpy())  # type: ignore[arg-type]  # numpy is a buffer
        integrity = Integrity(self._table, host_bytes, checksums)
        self._backend: CopyBackend
        self._kernel: NativeKernel | None = None
        self._native_backend: NativeCpuBackend | None = None
        if kv_flat.is_cuda:
            self._backend = CudaBackend(kv_flat, host_flat, integrity)
        elif kv_flat.device.type == "cpu":
            self._kernel = KERNEL if native else None
            if self._kernel is not None and _fits_every_id(layout, host_pool, self._kv_bytes, self._host_bytes):
                table = self._table
                wkb = plan.worker_kv_bytes_per_block
                geometry = (
                    table.slots,
                    table.slot,
                    self._bpc,
                    self._num_chunks,
                    self._row_bytes,
                    self._slot_offset,
                    wkb,
                )
                try:  # jobs go to the kernel's own engine as ids (no check of runs per job)
                    self._native_backend = NativeCpuBackend(
                        self._kernel, kv_flat, host_flat, threads, integrity, layout, geometry
                    )
                except OSError:
                    self._native_backend = None  # no threads to be had: the Python-driven backend
            self._backend = self._native_backend or CpuBackend(
                kv_flat, host_flat, threads, integrity, layout, self._kernel
            )
        else:
            raise ConfigError(f"kv_memory on device {kv_flat.device} is not supported (cpu or cuda)")

    def plan_runs(
        self,
        *,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        block_ids: IdsLike,
        chunk_ids: IdsLike,
    ) -> CopyRuns:
        """The coalesced runs a job would copy (validates like the submit calls)."""
        return build_copy_runs(
            self._layout,
            group_sizes=group_sizes,
            block_indices=block_indices,
            block_ids=block_ids,
            chunk_ids=chunk_ids,
            blocks_per_chunk=self._bpc,
            num_chunks=self._num_chunks,
            host_row_bytes=self._row_bytes,
            host_slot_offset=self._slot_offset,
        )

    def submit_store(
        self,
        job_id: int,
        *,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        block_ids: IdsLike,
        chunk_ids: IdsLike,
        chunk_tags: IdsLike | None = None,
    ) -> None:
        """Start copying engine blocks into host chunks (engine → host). Returns immediately.

        ``chunk_tags[i]`` is the key tag of ``chunk_ids[i]`` (:func:`~kvoffload.offload.pool.key_tag`;
        omitted: untagged). A rank that does not write to a shared replicated pool completes the job with 0
        bytes and leaves the pool's integrity table to the writer.
        """
        self.submit(CopyJob(job_id, Direction.STORE, group_sizes, block_indices, block_ids, chunk_ids, chunk_tags))

    def submit_load(
        self,
        job_id: int,
        *,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        block_ids: IdsLike,
        chunk_ids: IdsLike,
        chunk_tags: IdsLike | None = None,
    ) -> None:
        """Start copying host chunks back into engine blocks (host → engine). Returns immediately.

        The job fails (``corrupt_chunk_ids`` set) when a sub-block it reads was not sealed by a completed
        store, holds another key than ``chunk_tags`` says, or (with checksums) has other bytes than stored.
        """
        self.submit(CopyJob(job_id, Direction.LOAD, group_sizes, block_indices, block_ids, chunk_ids, chunk_tags))

    def submit(self, job: CopyJob) -> None:
        """Start a store or a load (:class:`CopyJob`); returns immediately, its result comes from :meth:`poll`."""
        job_id, direction = job.job_id, job.direction
        if self._closed:
            raise InvalidStateError(f"job {job_id}: the copy engine is closed")
        if job_id in self._unpolled:
            raise InvalidStateError(f"job_id={job_id} is still in flight (or its result was not polled)")
        native = self._native_backend
        if native is not None and native is self._backend:
            try:  # checked, laid out (and a store's entries invalidated) in one call of the kernel's engine
                native.submit_job(job, self._writes)
            except RefusedJob as refused:
                self._refused(job, refused)
            self._unpolled.add(job_id)
            return
        runs = self.plan_runs(
            group_sizes=job.group_sizes,
            block_indices=job.block_indices,
            block_ids=job.block_ids,
            chunk_ids=job.chunk_ids,
        )
        if len(runs):
            # Guards the raw-pointer copies against a hand-built layout that does not fit the memory.
            lengths = runs.lengths.numpy()
            for side, offsets, limit in (
                ("engine", runs.engine_offsets.numpy(), self._kv_bytes),
                ("host", runs.host_offsets.numpy(), self._host_bytes),
            ):
                low, high = int(offsets.min()), int((offsets + lengths).max())
                if low < 0 or high > limit:
                    raise ConfigError(f"job {job_id}: runs reach {side} bytes [{low}, {high}) outside [0, {limit})")
        slots: BlockSlots | None = None
        if direction is Direction.STORE and not self._writes:
            runs = CopyRuns.empty()
        else:
            slots = self._block_slots(job)
            if direction is Direction.STORE:
                self._table.invalidate(slots)  # unusable until this store's copy has completed
        self._unpolled.add(job_id)
        self._backend.submit(job_id, direction, runs, slots)

    def _refused(self, job: CopyJob, refused: RefusedJob) -> None:
        """Raise the Python planner's error for a job the native engine refused (the same checks, in words)."""
        self.plan_runs(
            group_sizes=job.group_sizes,
            block_indices=job.block_indices,
            block_ids=job.block_ids,
            chunk_ids=job.chunk_ids,
        )
        self._block_slots(job)
        raise ConfigError(f"job {job.job_id}: {refused}") from refused

    def _block_slots(self, job: CopyJob) -> BlockSlots:
        """The integrity-table slots of the sub-blocks ``job`` touches (its runs were checked first)."""
        return build_block_slots(
            self._layout,
            self._table,
            group_sizes=job.group_sizes,
            block_indices=job.block_indices,
            chunk_ids=job.chunk_ids,
            chunk_tags=job.chunk_tags,
            blocks_per_chunk=self._bpc,
            host_row_bytes=self._row_bytes,
            host_slot_offset=self._slot_offset,
        )

    @property
    def native(self) -> bool:
        """Whether CPU copies run in the native kernel (``native=True`` and the kernel was built at install)."""
        return self._kernel is not None

    @property
    def checksums(self) -> bool:
        """Whether stores record and loads verify content checksums (key tags always are)."""
        return self._checksums

    def poll(self) -> list[JobResult]:
        """Finished jobs since the last call: stores then loads, each in submission order."""
        results = self._backend.poll()
        for result in results:
            self._unpolled.discard(result.job_id)
        return results

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until the given jobs have finished (their results stay for :meth:`poll`).

        Ids not in flight return at once. Raises :class:`TransferError` after ``timeout`` seconds.
        """
        ids = set(job_ids) & self._unpolled
        if ids and not self._backend.wait(ids, timeout):
            raise TransferError(f"jobs {sorted(ids)} did not finish within {timeout}s")

    def close(self) -> None:
        """Finish the submitted jobs and stop the threads/streams; results stay pollable."""
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fits_every_id(layout: TransferLayout, pool: HostPool, kv_bytes: int, host_bytes: int) -> bool:
    """Whether every page of every block id and chunk id lands inside the engine memory and the host rows
    (then no job needs its runs checked)."""
    plan = pool.plan
    last_block, last_chunk = layout.num_blocks - 1, pool.num_chunks - 1
    if last_block < 0 or last_chunk < 0:
        return True
    last_host = (
        last_chunk * pool.row_bytes + pool.slot_offset + (plan.blocks_per_chunk - 1) * plan.worker_kv_bytes_per_block
    )
    for group in layout.groups:
        for seg in group.segment_table.tolist():
            engine_offset, stride, length, host_offset = seg
            low, high = (
                engine_offset + min(0, stride * last_block),
                engine_offset + length + max(0, stride * last_block),
            )
            if low < 0 or high > kv_bytes or host_offset < 0 or pool.slot_offset < 0:
                return False
            if last_host + host_offset + length > host_bytes:
                return False
    return True
