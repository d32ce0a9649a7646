"""The CPU backend on the native copy engine (``csrc/kvcopy_engine.c``): no Python between submit and done.

``submit_job`` hands a job's ids to one C call that checks them (the same checks as the Python planner), lays
out its blocks, invalidates a store's integrity entries and queues it; the direction's C thread copies it,
hashing every sub-block in the copy loop (:mod:`._native`), seals or verifies it in the pool's integrity table
and files the outcome. :meth:`NativeCpuBackend.wait` blocks in C, :meth:`NativeCpuBackend.poll` turns the
filed outcomes into :class:`~kvoffload.JobResult` s. Per job that is a few Python calls instead of a planner,
two thread hand-overs and the integrity update in numpy: on a machine whose caches are cold when a job starts
(a VM after an idle step) the Python around a job cost 0.5-0.7 ms, now about a third of that.

The copy engine uses it for CPU memory when the kernel is built and the layout keeps every block inside the
memories (otherwise :class:`~._cpu.CpuBackend`).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from kvoffload._generated import JobResult
from kvoffload._placement import TransferLayout
from kvoffload.errors import ConfigError
from kvoffload.offload.pool import BlockSlots
from kvoffload.offload.worker.copy._backend import Direction, Integrity, corrupt_result, done_result, failed_result
from kvoffload.offload.worker.copy._cpu import JobProfile
from kvoffload.offload.worker.copy._job import CopyJob
from kvoffload.offload.worker.copy._native import STATS, NativeKernel, NativeLayout, NativePool
from kvoffload.offload.worker.copy._runs import CopyRuns, IdsLike, _as_ids

__all__ = ["NativeCpuBackend", "RefusedJob"]

_PARALLEL_MIN_BYTES = 2 << 20
"""Jobs smaller than this run on the direction's thread alone (waking a helper costs more)."""
_GRANULE_BYTES = 512 << 10
"""Big jobs are shared in granules of at least this many bytes (cut at sub-block ends), taken by whichever
thread is free: on a shared machine a thread that gets less CPU takes fewer."""
_STREAM_MIN_BYTES = 8 << 20
"""Jobs of at least this many bytes copy with non-temporal stores (no read of the destination lines, no
eviction of the cache: measured 15-25% faster for jobs far larger than the cache); smaller ones leave their
bytes in cache for whoever reads them next."""

_CONFIG_NAMES = """
kv_base host_base table_slots table_slot bpc num_blocks num_chunks row_bytes slot_offset wkb checksums state
granule parallel_min stream_min
"""
_CONFIG = tuple(_CONFIG_NAMES.split())
"""``kvcopy_engine_new``'s config, in the C order (``KV_CFG_*``)."""
_RECORD = ("id", "is_store", "status", "num_bytes", "queued_ns", "start_ns", "end_ns", "bad", *STATS)
_STATUS, _BAD = _RECORD.index("status"), _RECORD.index("bad")
_FAILED_MEMORY, _FAILED_OUTSIDE = -2, -3
_POLL_RECORDS, _POLL_CHUNKS = 64, 1 << 12
_REFUSALS = {
    -1: "counts",
    -2: "block_ids",
    -3: "chunk_ids",
    -4: "chunk_tags",
    -5: "memory",
}
_VOIDP, _I64 = ctypes.c_void_p, ctypes.c_int64


class RefusedJob(ConfigError):
    """The engine refused a job (``reason``: what its check found); the Python planner says why in full."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the native copy engine refused the job ({reason})")
        self.reason = reason


class _Engine:
    """ctypes face of one ``kvcopy_engine``."""

    def __init__(
        self, kernel: NativeKernel, pool: NativePool | None, config: Sequence[int], layout: NativeLayout, table: int
    ) -> None:
        lib = kernel.lib
        submit_args: list[type[ctypes.c_void_p] | type[ctypes.c_int64]] = [
            _VOIDP,
            _I64,
            _I64,
            _I64,
            _VOIDP,
            _VOIDP,
            _VOIDP,
            _I64,
            _VOIDP,
            _I64,
            _VOIDP,
            _I64,
        ]
        self._submit = _bind(lib.kvcopy_engine_submit, _I64, submit_args)
        self._fail = _bind(lib.kvcopy_engine_fail, _I64, [_VOIDP, _I64, _I64])
        self._wait = _bind(lib.kvcopy_engine_wait, _I64, [_VOIDP, _I64, _I64, _I64])
        # Called every engine step and done in microseconds: they keep the GIL (see _bind_with_gil).
        self._poll = _bind_with_gil(lib.kvcopy_engine_poll, _I64, [_VOIDP, _VOIDP, _I64, _VOIDP, _I64])
        self._hold = _bind_with_gil(lib.kvcopy_engine_hold, None, [_VOIDP, _I64])
        self._close = _bind(lib.kvcopy_engine_close, None, [_VOIDP])
        new = _bind(lib.kvcopy_engine_new, _VOIDP, [_VOIDP, _VOIDP, _I64, _VOIDP, _VOIDP, _VOIDP, _VOIDP])
        free = _bind(lib.kvcopy_engine_free, None, [_VOIDP])
        sizes = (ctypes.c_int64 * 3)()
        lib.kvcopy_engine_layout(sizes)
        if list(sizes) != [len(_CONFIG), len(_RECORD), 8]:
            raise OSError(f"{kernel.path.name}: engine layout {list(sizes)} is not this module's")
        cfg = (ctypes.c_int64 * len(config))(*config)
        seg_start, segs, group_bytes = layout.addresses
        pool_handle = pool.handle if pool is not None else None
        handle = new(pool_handle, cfg, layout.group_bytes.size, seg_start, segs, group_bytes, table)
        if not handle:
            raise OSError("could not start the native copy engine's threads")
        self.handle: int = handle
        self._records = np.empty((_POLL_RECORDS, len(_RECORD)), dtype=np.int64)
        self._chunks = np.empty(_POLL_CHUNKS, dtype=np.int64)
        self._addresses = (self._records.ctypes.data, self._chunks.ctypes.data)
        # the pool stays alive (the finalizer holds it) until the engine, whose jobs may use its threads, is freed
        self._finalizer = weakref.finalize(self, _free, free, handle, pool)
        self._finalizer.atexit = False  # at exit a job may still run: leave the threads be

    def submit(self, is_store: bool, job_id: int, writes: bool, ids: tuple[int, ...]) -> int:
        """``ids``: addresses and counts as ``kvcopy_engine_submit`` takes them after ``writes``."""
        return int(self._submit(self.handle, is_store, job_id, writes, *ids))

    def fail(self, is_store: bool, job_id: int) -> int:
        return int(self._fail(self.handle, is_store, job_id))

    def wait(self, store_seq: int, load_seq: int, timeout_ns: int) -> bool:
        return bool(self._wait(self.handle, store_seq, load_seq, timeout_ns))

    def poll(self) -> tuple[np.ndarray, np.ndarray]:
        """Finished jobs' records and their bad chunk ids (views, valid until the next call)."""
        while True:
            records, chunks = self._addresses
            n = int(self._poll(self.handle, records, _POLL_RECORDS, chunks, self._chunks.size))
            if n >= 0:
                return self._records[:n], self._chunks
            self._chunks = np.empty(-n, dtype=np.int64)  # a job with more bad chunks than there was room for
            self._addresses = (self._records.ctypes.data, self._chunks.ctypes.data)

    def hold(self, held: bool) -> None:
        self._hold(self.handle, held)

    def close(self) -> None:
        self._close(self.handle)


def _free(free: ctypes._NamedFuncPointer, handle: int, pool: NativePool | None) -> None:
    free(handle)
    del pool


def _bind(
    function: ctypes._NamedFuncPointer,
    restype: type | None,
    argtypes: Sequence[type[ctypes.c_void_p] | type[ctypes.c_int64]],
) -> ctypes._NamedFuncPointer:
    function.restype = restype
    function.argtypes = list(argtypes)
    return function


def _bind_with_gil(
    function: ctypes._NamedFuncPointer,
    restype: type | None,
    argtypes: Sequence[type[ctypes.c_void_p] | type[ctypes.c_int64]],
) -> ctypes._CFunctionType:
    """``function`` called without releasing the GIL, for short calls made at every engine step.

    A thread that drops the GIL for microseconds many times a second starves every other Python thread of the
    process: each drop wakes a waiter, which loses the race to take it back and restarts its 5 ms switch
    interval, so it never asks for the GIL. In an engine loop that polls while a request waits for a tier lookup,
    the lookup thread then waited seconds (measured in a real vLLM engine: a 5-key object-store lookup 1-10 s).
    """
    prototype = ctypes.PYFUNCTYPE(restype, *argtypes)
    address = ctypes.cast(function, ctypes.c_void_p).value
    if address is None:
        raise OSError(f"native function {function.__name__} has no address")
    return prototype(address)


def _native_submit(engine: _Engine, is_store: bool, job_id: int, writes: bool, ids: tuple[int, ...]) -> int:
    """Hand a job to the engine (one C call): its number in its direction, or a refusal code (< 0)."""
    return engine.submit(is_store, job_id, writes, ids)


def _id_array(ids: IdsLike | None, field: str) -> tuple[int, int, object]:
    """``(address, count, keep-alive)`` of ``ids`` as contiguous int64 (a CPU int64 tensor as it is)."""
    if ids is None:
        return 0, 0, None
    if isinstance(ids, torch.Tensor):
        try:
            shared = ids.numpy()
        except (TypeError, RuntimeError):
            shared = None
        if shared is not None and shared.dtype == np.int64 and shared.ndim == 1 and shared.flags.c_contiguous:
            return ids.data_ptr(), shared.size, ids
    array = np.ascontiguousarray(_as_ids(ids, field))
    return array.ctypes.data, array.size, array


class NativeCpuBackend:
    """CPU copies on the native copy engine: one C thread per direction runs jobs in order, big jobs shared
    with ``threads - 1`` helper threads of the kernel's pool. ``profile``: set it to a list to have a
    :class:`~._cpu.JobProfile` appended for every job as it is polled (benchmarks)."""

    def __init__(
        self,
        kernel: NativeKernel,
        kv_flat: torch.Tensor,
        host_flat: torch.Tensor,
        threads: int,
        integrity: Integrity,
        layout: TransferLayout,
        geometry: tuple[int, int, int, int, int, int, int],
    ) -> None:
        """``geometry``: table slots, table slot, blocks per chunk, chunks, row bytes, slot offset, sub-block
        bytes (the host pool's)."""
        self._memory = (kv_flat, host_flat, integrity)  # the references keep the raw pointers' memory alive
        self._layout = NativeLayout.of(layout)
        self._pool = kernel.pool(threads - 1)
        table = integrity.table
        slots, slot, bpc, num_chunks, row_bytes, slot_offset, wkb = geometry
        values = {
            "kv_base": kv_flat.data_ptr(),
            "host_base": host_flat.data_ptr(),
            "table_slots": slots,
            "table_slot": slot,
            "bpc": bpc,
            "num_blocks": layout.num_blocks,
            "num_chunks": num_chunks,
            "row_bytes": row_bytes,
            "slot_offset": slot_offset,
            "wkb": wkb,
            "checksums": int(integrity.checksums),
            "state": table.state_for(integrity.checksums),
            "granule": _GRANULE_BYTES,
            "parallel_min": _PARALLEL_MIN_BYTES,
            "stream_min": _STREAM_MIN_BYTES,
        }
        self._engine = _Engine(kernel, self._pool, [values[k] for k in _CONFIG], self._layout, table.address)
        self._ngroups = len(layout.groups)
        self._groups = np.zeros(max(1, 2 * self._ngroups), dtype=np.int64)  # group sizes, then block indices
        self._groups_address = self._groups.ctypes.data
        self._seq: dict[int, tuple[bool, int]] = {}  # job id -> (is store, number in its direction), until polled
        self._failures: dict[int, BaseException] = {}
        self.profile: list[JobProfile] | None = None

    def submit_job(self, job: CopyJob, writes: bool) -> None:
        """Check and queue ``job`` (a store of a rank that does not write completes with 0 bytes). Raises
        :class:`RefusedJob` when its counts or ids do not fit (nothing changed)."""
        is_store = job.direction.is_store
        groups = self._ngroups
        if len(job.group_sizes) != groups or len(job.block_indices) != groups:
            raise RefusedJob("counts")
        try:
            self._groups[:groups] = job.group_sizes
            self._groups[groups : 2 * groups] = job.block_indices
        except (TypeError, ValueError, OverflowError) as exc:
            raise RefusedJob("counts") from exc
        blocks, nblocks, keep_blocks = _id_array(job.block_ids, "block_ids")
        chunks, nchunks, keep_chunks = _id_array(job.chunk_ids, "chunk_ids")
        tags, ntags, keep_tags = _id_array(job.chunk_tags, "chunk_tags")
        address = self._groups_address
        ids = (address, address + 8 * groups, blocks, nblocks, chunks, nchunks, tags, ntags)
        try:
            seq = _native_submit(self._engine, is_store, job.job_id, writes, ids)
        except Exception as exc:  # the copy path failed (or a test broke it): the job reports it, in its place
            seq = self._engine.fail(is_store, job.job_id)
            self._failures[job.job_id] = exc
        del keep_blocks, keep_chunks, keep_tags  # the engine copied what it needs
        if seq < 0:
            raise RefusedJob(_REFUSALS.get(seq, str(seq)))
        self._seq[job.job_id] = (is_store, seq)

    def submit(self, job_id: int, direction: Direction, runs: CopyRuns, slots: BlockSlots | None) -> None:
        raise ConfigError("the native CPU backend takes jobs as ids (submit_job), not as runs")

    def hold(self, held: bool) -> None:
        """Hold back (True) or let go the start of queued jobs (tests and tools)."""
        self._engine.hold(held)

    def poll(self) -> list[JobResult]:
        out: list[JobResult] = []
        while True:
            records, chunks = self._engine.poll()
            if not records.shape[0]:
                return out
            used = 0
            for row in records.tolist():
                job_id, is_store, status, num_bytes, queued, start, end, bad = row[:8]
                self._seq.pop(job_id, None)
                direction = Direction.STORE if is_store else Direction.LOAD
                seconds = (end - start) / 1e9
                if status == 0:
                    out.append(done_result(job_id, direction, num_bytes, seconds))
                elif status > 0:
                    out.append(corrupt_result(job_id, seconds, chunks[used : used + bad].tolist()))
                    used += bad
                else:
                    exc = self._failures.pop(job_id, None) if status == _FAILED_OUTSIDE else None
                    if exc is None:
                        exc = MemoryError("the native copy engine ran out of memory")
                    out.append(failed_result(job_id, direction, seconds, exc))
                if self.profile is not None:
                    stats = dict(zip(STATS, row[len(_RECORD) - len(STATS) :], strict=True))
                    exit_ns = stats["exit_ns"] or end
                    self.profile.append(
                        JobProfile(job_id, bool(is_store), num_bytes, queued, start, start, exit_ns, end, end, stats)
                    )

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        last = [0, 0]  # the last store and load to wait for
        for job_id in job_ids:
            if (entry := self._seq.get(job_id)) is not None:
                is_store, seq = entry
                last[0 if is_store else 1] = max(last[0 if is_store else 1], seq)
        timeout_ns = -1 if timeout is None else max(0, int(timeout * 1e9))
        return self._engine.wait(last[0], last[1], timeout_ns)

    def close(self) -> None:
        self._engine.close()
        if self._pool is not None:
            self._pool.close()
