"""The Python-driven CPU backend: one Python thread per direction runs each job; big jobs are shared.

The copy engine uses it when the native kernel is not there (no compiler, or ``native=False``) or the layout
could reach outside the memories for some block id (then each job's runs are checked; with the kernel, a job is
still one GIL-free call of :meth:`~._native.NativeKernel.job`: ordered, shared with the kernel's helper threads,
every sub-block hashed in the copy loop, sealed or verified). Otherwise CPU jobs go to the kernel's own engine
(:mod:`._cpu_native`). Without the kernel, small pages (up to 128 KB) are copied block by block through cached
tensor views (:mod:`._views`), a stretch of blocks per GIL-free torch call, and longer pages run by run with
memmove, on Python helper threads (:mod:`._cpu_loops`); with content checksums every sub-block is hashed right
after its bytes were copied, while they are in cache. Either way a store hashes what it wrote, a load the host
bytes it read; a load is verified once its copy is done and fails if any sub-block does not match (its bytes
are never reported good).
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from kvoffload._generated import JobResult
from kvoffload._placement import TransferLayout
from kvoffload.offload.pool import BlockSlots, Digests
from kvoffload.offload.worker.copy import _cpu_loops as loops
from kvoffload.offload.worker.copy._backend import Direction, Integrity, corrupt_result, done_result, failed_result
from kvoffload.offload.worker.copy._native import (
    FUSED,
    SEAL,
    STATS,
    STREAM,
    VERIFY,
    NativeKernel,
    NativePool,
    TableUpdate,
)
from kvoffload.offload.worker.copy._runs import CopyRuns
from kvoffload.offload.worker.copy._views import BlockViews, ViewJob

__all__ = ["CpuBackend"]

_PARALLEL_MIN_BYTES = 2 << 20
"""Jobs smaller than this run on the direction's thread alone (waking helpers costs more)."""

_GRANULE_BYTES = 512 << 10
"""The native kernel shares a job in granules of at least this many bytes (cut at sub-block boundaries), taken
by whichever thread is free: on a shared machine a thread that gets less CPU takes fewer."""

_STREAM_MIN_BYTES = 8 << 20
"""Native jobs of at least this many bytes copy with non-temporal stores (no read of the destination lines,
no eviction of the cache: measured 15-25% faster for jobs far larger than the cache); smaller ones leave
their bytes in cache for whoever reads them next."""

_VIEW_STRETCH_BYTES = 512 << 10
"""With checksums, block views are copied in stretches of about this many bytes, each hashed right after."""

_Share = TypeVar("_Share")
_Item = tuple[int, CopyRuns, "BlockSlots | None", int]
"""A queued job: id, its runs (or blocks), its sub-blocks, when it was submitted (``perf_counter_ns``)."""


def _native_job(
    kernel: NativeKernel,
    pool: NativePool | None,
    runs: CopyRuns,
    is_store: bool,
    bases: tuple[int, int, int],
    slots: BlockSlots | None,
    integrity: Integrity,
    stats: np.ndarray | None,
) -> list[int]:
    """Run a whole job in one call of the native kernel, without the GIL from start to end: copy, hash every
    sub-block of ``slots`` on the way (with checksums) and seal (a store) or verify (a load) them in the pool's
    integrity table; the chunk ids whose sub-blocks did not verify. ``bases``: the engine memory's, the host
    rows' and the integrity table's addresses."""
    flags = FUSED | (STREAM if runs.num_bytes >= _STREAM_MIN_BYTES else 0)
    kv_base, host_base, table_address = bases
    table = integrity.table
    sums = update = None
    if slots is not None and len(slots):
        flags |= SEAL if is_store else VERIFY
        sums = np.empty(len(slots), dtype=np.uint64) if integrity.checksums else None
        bad = None if is_store else np.empty(len(slots), dtype=np.uint8)
        update = TableUpdate(table_address, slots.entries, slots.tags, table.state_for(integrity.checksums), bad)
    failed = kernel.job(
        pool,
        (runs.engine_offsets.numpy(), runs.host_offsets.numpy(), runs.lengths.numpy()),
        slots.arrays() if update is not None and slots is not None else None,
        is_store=is_store,
        kv_base=kv_base,
        host_base=host_base,
        digests=sums,
        flags=flags,
        granule=_GRANULE_BYTES if pool is not None else 0,
        table=update,
        stats=stats,
    )
    if failed and slots is not None and update is not None and update.bad is not None:
        return table.bad_chunks(slots, update.bad)
    return []


@dataclass
class JobProfile:
    """Where one job's time went (``perf_counter_ns`` stamps), recorded when :attr:`CpuBackend.profile` is a
    list: queued (``submit``), taken by the direction's thread, the copy call entered and returned, integrity
    done, result published; ``kernel``: the native kernel's :data:`~._native.STATS` (None on the Python path)."""

    job_id: int
    is_store: bool
    num_bytes: int
    submitted: int
    started: int = 0
    copy_entered: int = 0
    copy_returned: int = 0
    checked: int = 0
    published: int = 0
    kernel: dict[str, int] | None = None


class CpuBackend:
    """One thread per direction runs jobs in order; big jobs are shared with ``threads - 1`` helpers (the native
    kernel's own threads, or Python threads on the pure-Python path).

    Integrity runs on the direction's thread right after a job's copy: a store seals its sub-blocks, a load
    verifies them and fails if any does not match. ``profile``: set it to a list to have a :class:`JobProfile`
    appended for every job (benchmarks).
    """

    def __init__(
        self,
        kv_flat: torch.Tensor,
        host_flat: torch.Tensor,
        threads: int,
        integrity: Integrity,
        layout: TransferLayout | None = None,
        kernel: NativeKernel | None = None,
    ) -> None:
        self._kv = kv_flat
        self._kernel = kernel
        self._bases = (kv_flat.data_ptr(), host_flat.data_ptr(), integrity.table.address)
        # the native kernel copies small pages as fast as long ones: block views are its pure-Python stand-in
        self._views = BlockViews(kv_flat, host_flat, layout) if layout is not None and kernel is None else None
        self._integrity = integrity
        self._host = host_flat  # the references keep the memory behind the raw pointers alive
        self._parts = threads
        self._pool = kernel.pool(threads - 1) if kernel is not None else None
        self._helpers = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="kvoffload-copy")
            if threads > 1 and kernel is None
            else None
        )
        self.profile: list[JobProfile] | None = None
        self._cond = threading.Condition()
        self._done: dict[Direction, deque[JobResult]] = {d: deque() for d in Direction}
        self._pending: set[int] = set()
        self._queues: dict[Direction, queue.SimpleQueue[_Item | None]] = {d: queue.SimpleQueue() for d in Direction}
        self._threads = [
            threading.Thread(target=self._loop, args=(d,), name=f"kvoffload-{d.value}", daemon=True) for d in Direction
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job_id: int, direction: Direction, runs: CopyRuns, slots: BlockSlots | None) -> None:
        with self._cond:
            self._pending.add(job_id)
        self._queues[direction].put((job_id, runs, slots, time.perf_counter_ns()))

    def _loop(self, direction: Direction) -> None:
        jobs = self._queues[direction]
        is_store = direction.is_store
        integrity = self._integrity
        while (item := jobs.get()) is not None:
            job_id, runs, slots, submitted = item
            start = time.perf_counter()
            record = None if self.profile is None else JobProfile(job_id, is_store, runs.num_bytes, submitted)
            try:
                if record is not None:
                    record.started = time.perf_counter_ns()
                if (kernel := self._kernel) is not None and len(runs):
                    bad = self._native(kernel, runs, is_store, slots, record)  # copied, hashed, sealed/verified
                else:
                    hashed = integrity.checksums and slots is not None and len(slots) > 0 and len(runs) > 0
                    sums = self._copy(runs, is_store, slots if hashed else None, slots, record)
                    if is_store:
                        integrity.seal(slots, sums)
                        bad = []
                    else:
                        bad = integrity.verify(slots, sums)
                seconds = time.perf_counter() - start
                if bad:
                    result = corrupt_result(job_id, seconds, bad)
                else:
                    result = done_result(job_id, direction, runs.num_bytes, seconds)
            except Exception as exc:
                result = failed_result(job_id, direction, time.perf_counter() - start, exc)
            if record is not None:
                record.checked = time.perf_counter_ns()
            with self._cond:
                self._done[direction].append(result)
                self._pending.discard(job_id)
                self._cond.notify_all()
            if record is not None and self.profile is not None:
                record.published = time.perf_counter_ns()
                self.profile.append(record)

    def _native(
        self,
        kernel: NativeKernel,
        runs: CopyRuns,
        is_store: bool,
        slots: BlockSlots | None,
        record: JobProfile | None,
    ) -> list[int]:
        """A job in one call of the native kernel; the chunk ids that did not verify."""
        if record is not None:
            record.copy_entered = time.perf_counter_ns()
        pool = self._pool if runs.num_bytes >= _PARALLEL_MIN_BYTES else None
        stats = np.zeros(len(STATS), dtype=np.int64) if record is not None else None
        bad = _native_job(kernel, pool, runs, is_store, self._bases, slots, self._integrity, stats)
        if record is not None and stats is not None:
            record.kernel = dict(zip(STATS, stats.tolist(), strict=True))
            record.copy_returned = time.perf_counter_ns()
        return bad

    def _copy(
        self,
        runs: CopyRuns,
        is_store: bool,
        hashed: BlockSlots | None,
        slots: BlockSlots | None,
        record: JobProfile | None,
    ) -> Digests | None:
        """Copy a job on the pure-Python path, hashing ``hashed`` on the way; the digests of ``hashed``."""
        if record is not None:
            record.copy_entered = time.perf_counter_ns()
        sums: Digests | None = None
        if (view_job := self._view_job(runs, is_store, slots)) is not None:
            sums = self._execute_views(view_job, runs.num_bytes, hashed)
        elif hashed is not None:
            sums = self._execute_hashed(runs, is_store, hashed)
        else:
            self._execute(runs, is_store)
        if record is not None:
            record.copy_returned = time.perf_counter_ns()
        return sums

    def _view_job(self, runs: CopyRuns, is_store: bool, slots: BlockSlots | None) -> ViewJob | None:
        """The job as block views, or None when it takes the run path (long pages, unaligned or overlapping)."""
        blocks = runs.blocks
        if self._views is None or blocks is None or not len(runs):
            return None
        if slots is not None and len(slots) != blocks.groups.size:
            return None
        if not self._views.supports(np.unique(blocks.groups).tolist()) or not BlockViews.host_words(blocks):
            return None
        if is_store and np.unique(blocks.host_blocks).size != blocks.host_blocks.size:
            return None  # two blocks into one sub-block: keep the ordered run path
        return self._views.job(blocks, is_store)

    def _execute_views(self, job: ViewJob, num_bytes: int, slots: BlockSlots | None) -> list[int] | None:
        """Copy a view job (shared with helpers when big), hashing its slots when ``slots`` is given."""
        n = len(job.ends)
        parts = self._parts_for(num_bytes)
        step = max(1, _VIEW_STRETCH_BYTES * n // max(num_bytes, 1)) if slots is not None else n
        digests = [0] * n
        host = self._integrity.host
        bounds = [n * k // parts for k in range(parts + 1)]
        shares = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
        self._run_shares(lambda share: loops.copy_views(job, *share, step, host, slots, digests), shares)
        return digests if slots is not None else None

    def _execute(self, runs: CopyRuns, is_store: bool) -> None:
        """Copy a job on the pure-Python path (shared with helpers when big)."""
        if len(runs) == 0:
            return
        work = loops.cpu_work(
            runs, is_store, self._kv.data_ptr(), self._host.data_ptr(), self._parts_for(runs.num_bytes)
        )
        self._run_shares(lambda share: loops.memmove_arrays(*share), work)

    def _execute_hashed(self, runs: CopyRuns, is_store: bool, slots: BlockSlots) -> Digests:
        """Copy and hash on the pure-Python path, in shares (helpers copy while another share hashes); the
        slots' digests."""
        host_ptr = self._host.data_ptr()
        work = loops.hashed_parts(runs, is_store, self._kv.data_ptr(), host_ptr, slots, self._parts_for(runs.num_bytes))
        digests = [0] * len(slots)
        host = self._integrity.host
        self._run_shares(
            functools.partial(loops.copy_and_hash, host=host, digests=digests, stretch=loops.HASH_BYTES), work
        )
        return digests

    def _parts_for(self, num_bytes: int) -> int:
        """How many threads share a job of ``num_bytes`` (small jobs stay on the direction's thread)."""
        return self._parts if self._helpers is not None and num_bytes >= _PARALLEL_MIN_BYTES else 1

    def _run_shares(self, run: Callable[[_Share], None], shares: Sequence[_Share]) -> None:
        """Run every share of a job, the first on this thread and the others on the helpers; wait for all of
        them before raising the first error (no copy of the job may still run once it is reported)."""
        helpers = self._helpers
        futures = [helpers.submit(run, share) for share in shares[1:]] if helpers is not None else []
        try:
            for share in shares[:1] if helpers is not None else shares:
                run(share)
        finally:
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def poll(self) -> list[JobResult]:
        with self._cond:
            out = [*self._done[Direction.STORE], *self._done[Direction.LOAD]]
            for done in self._done.values():
                done.clear()
        return out

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not (job_ids & self._pending), timeout)

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
        if self._helpers is not None:
            self._helpers.shutdown()
        if self._pool is not None:
            self._pool.close()
