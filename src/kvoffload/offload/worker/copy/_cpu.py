"""The CPU backend: one thread per direction copies each job, big jobs shared with helper threads.

With the native kernel (:mod:`._native`, built at install time) a share of a job is one GIL-free call that
copies its runs and hashes its sub-blocks. Without it (no compiler, or turned off), small pages (up to 128 KB)
are copied block by block through cached tensor views (:mod:`._views`), a stretch of blocks per GIL-free torch
call, and longer pages run by run with memmove. Either way, with content checksums on, every sub-block is
hashed right after its bytes were copied, while they are in cache: a store hashes what it just wrote, a load
the host bytes it just read.
"""

from __future__ import annotations

import ctypes
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
import xxhash

from kvoffload._generated import JobResult
from kvoffload._placement import TransferLayout
from kvoffload.errors import ConfigError
from kvoffload.offload.pool import BlockSlots, Digests
from kvoffload.offload.worker.copy._backend import Direction, Integrity, corrupt_result, done_result, failed_result
from kvoffload.offload.worker.copy._native import NativeKernel
from kvoffload.offload.worker.copy._runs import CopyRuns
from kvoffload.offload.worker.copy._views import BlockViews, ViewJob

__all__ = ["CpuBackend"]

_PIECE_BYTES = 4 << 20
"""Longer runs are cut into pieces of this size so that the copy threads share the work evenly."""

_PARALLEL_MIN_BYTES = 2 << 20
"""Jobs smaller than this run on the direction's thread alone (waking helpers costs more)."""

_HASH_BYTES = 512 << 10
"""With checksums on the pure-Python path, slots are hashed in stretches of at most this size, each right after
its bytes were copied. Larger than the cache would like: every stretch costs that path two GIL hand-overs."""

_NATIVE_HASH_BYTES = 128 << 10
"""The native kernel's stretch: it pays nothing per stretch (its hash state keeps no buffer), so a size that
stays in L2 (measured here: 128 KB beat 256 KB and 512 KB by 5-10% at 256 KB and 2 MB pages). Much smaller
stretches cost more than they save: libc's memmove moves 4-16 KB pieces of scattered pages 10-35% slower than
32 KB ones."""

_VIEW_STRETCH_BYTES = 512 << 10
"""With checksums, block views are copied in stretches of about this many bytes, each hashed right after."""

_Share = TypeVar("_Share")

_xxh3_64 = xxhash.xxh3_64_intdigest
_foreach_copy = getattr(torch, "_foreach_copy_", None)


def _copy_views(
    job: ViewJob, lo: int, hi: int, step: int, host: memoryview, slots: BlockSlots | None, digests: list[int]
) -> None:
    """Copy the views of slots ``[lo, hi)``, ``step`` slots per torch call; hash each stretch's slots after it
    (when ``slots`` is given) into ``digests``."""
    dst, src, ends = job.dst, job.src, job.ends
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        first, last = ends[a - 1] if a else 0, ends[b - 1]
        if _foreach_copy is not None:
            _foreach_copy(dst[first:last], src[first:last])
        else:  # torch without foreach ops: one copy per view
            deque(map(torch.Tensor.copy_, dst[first:last], src[first:last]), maxlen=0)
        if slots is not None:
            offsets, lengths = slots.host_offsets, slots.lengths
            for j in range(a, b):
                digests[j] = _xxh3_64(host[offsets[j] : offsets[j] + lengths[j]])


def _memmove_runs(dsts: list[int], srcs: list[int], lengths: list[int]) -> None:
    """Copy each run with the C library's memmove.

    ``ctypes`` releases the GIL for the copy and, unlike a loop of torch ``copy_`` calls, wakes no OpenMP
    team per call (which collapses to ~1-4 GB/s for 64 KB-1 MB pages when run off the main thread).
    """
    if not len(dsts) == len(srcs) == len(lengths):
        raise ConfigError(f"{len(dsts)} destinations, {len(srcs)} sources and {len(lengths)} lengths")
    deque(map(ctypes.memmove, dsts, srcs, lengths), maxlen=0)  # no Python bytecode between the calls


def _memmove_arrays(dsts: np.ndarray, srcs: np.ndarray, lengths: np.ndarray) -> None:
    """:func:`_memmove_runs` over int64 arrays."""
    _memmove_runs(dsts.tolist(), srcs.tolist(), lengths.tolist())


def _cut(engine: np.ndarray, host: np.ndarray, length: np.ndarray, piece: int) -> tuple[np.ndarray, ...]:
    """The runs cut into consecutive pieces of at most ``piece`` bytes (numpy: a few µs per call)."""
    pieces = (length + (piece - 1)) // piece
    if length.size == 0 or int(pieces.max()) <= 1:
        return engine, host, length
    owner = np.repeat(np.arange(length.size), pieces)
    skip = (np.arange(owner.size) - (np.cumsum(pieces) - pieces)[owner]) * piece
    return engine[owner] + skip, host[owner] + skip, np.minimum(length[owner] - skip, piece)


def _cpu_work(
    runs: CopyRuns, is_store: bool, kv_ptr: int, host_ptr: int, parts: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Absolute (dst, src, length) int64 arrays for ``parts`` threads, split so each moves about the same
    bytes (runs longer than :data:`_PIECE_BYTES` are cut so that the shares can even out)."""
    engine, host, length = runs.engine_offsets.numpy(), runs.host_offsets.numpy(), runs.lengths.numpy()
    if length.size == 0:
        return []
    if parts > 1:
        engine, host, length = _cut(engine, host, length, _PIECE_BYTES)
    engine, host = engine + kv_ptr, host + host_ptr
    dst, src = (host, engine) if is_store else (engine, host)
    if parts <= 1:
        return [(dst, src, np.ascontiguousarray(length))]
    ends = np.cumsum(length)
    owner = (2 * ends - length) * parts // (2 * int(ends[-1]))  # the part holding each run's middle byte
    bounds = np.searchsorted(owner, np.arange(parts + 1)).tolist()
    return [(dst[a:b], src[a:b], length[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


@dataclass(frozen=True)
class _HashedPart:
    """A share of a checksummed job: its runs as absolute addresses sorted by host offset, and the slots it
    hashes sorted by host offset (``slot_ids``: each slot's index in the job's :class:`BlockSlots`)."""

    dsts: np.ndarray
    srcs: np.ndarray
    lengths: np.ndarray
    hosts: np.ndarray  # host offset of each run, relative to the rows
    slot_firsts: np.ndarray
    slot_sizes: np.ndarray
    slot_ids: np.ndarray


def _hashed_parts(
    runs: CopyRuns, is_store: bool, kv_ptr: int, host_ptr: int, slots: BlockSlots, parts: int
) -> list[_HashedPart]:
    """Split a checksummed job into up to ``parts`` shares of about equal bytes, cut only between slots that
    no run spans (so a share never hashes bytes another share is still writing)."""
    host = runs.host_offsets.numpy()
    order = np.argsort(host, kind="stable")
    host, engine, lengths = host[order], runs.engine_offsets.numpy()[order], runs.lengths.numpy()[order]
    dst, src = (host + host_ptr, engine + kv_ptr) if is_store else (engine + kv_ptr, host + host_ptr)
    offsets = np.asarray(slots.host_offsets, dtype=np.int64)
    visit = np.argsort(offsets, kind="stable")
    slot_first = offsets[visit]
    slot_size = np.asarray(slots.lengths, dtype=np.int64)[visit]
    cuts, run_cuts = [0], [0]  # slot and run positions where a share starts
    if parts > 1 and visit.size > 1 and lengths.size:
        next_first = slot_first[1:]
        before_next = np.searchsorted(host, next_first)  # runs starting before each next slot
        reach = (host + lengths)[np.maximum(before_next - 1, 0)]
        slot_reach = np.maximum.accumulate(slot_first + slot_size)[:-1]  # end of the slots before each cut
        allowed = np.flatnonzero(((before_next == 0) | (reach <= next_first)) & (slot_reach <= next_first))
        done = np.cumsum(slot_size)
        targets = int(done[-1]) * np.arange(1, parts, dtype=np.int64) // parts
        picks = np.searchsorted(done[allowed], targets)  # first allowed cut with at least the target
        for pick in sorted(set(picks.tolist())):
            if pick < allowed.size:
                position = int(allowed[pick])
                cuts.append(position + 1)
                run_cuts.append(int(before_next[position]))
    cuts.append(int(visit.size))
    run_cuts.append(int(lengths.size))
    return [
        _HashedPart(dst[ra:rb], src[ra:rb], lengths[ra:rb], host[ra:rb], slot_first[a:b], slot_size[a:b], visit[a:b])
        for (a, b), (ra, rb) in zip(itertools.pairwise(cuts), itertools.pairwise(run_cuts), strict=True)
        if b > a or rb > ra
    ]


def _copy_and_hash(part: _HashedPart, host: memoryview, digests: list[int], stretch: int) -> None:
    """Copy a share's runs and hash each of its slots while the bytes are in cache (digests by slot index).

    Both directions hash the host bytes right after copying them: a store what it wrote, a load what it read
    (in cache then, ~20% cheaper than hashing from memory before the copy). Slots are hashed in stretches of
    at most ``stretch`` bytes, each right after every run byte below its end was copied (the native kernel
    runs the same walk).
    """
    dsts, srcs, lengths, hosts = part.dsts.tolist(), part.srcs.tolist(), part.lengths.tolist(), part.hosts.tolist()
    r = done = 0
    for first, size, index in zip(
        part.slot_firsts.tolist(), part.slot_sizes.tolist(), part.slot_ids.tolist(), strict=True
    ):
        end = first + size
        state = xxhash.xxh3_64() if size > stretch else None
        a = first
        while True:
            b = min(a + stretch, end)
            pieces: tuple[list[int], list[int], list[int]] = ([], [], [])
            while r < len(lengths) and hosts[r] + done < b:
                n = min(lengths[r] - done, b - hosts[r] - done)
                pieces[0].append(dsts[r] + done)
                pieces[1].append(srcs[r] + done)
                pieces[2].append(n)
                done += n
                if done >= lengths[r]:
                    r, done = r + 1, 0
            _memmove_runs(*pieces)
            if state is None:
                digests[index] = _xxh3_64(host[a:b])
            else:
                state.update(host[a:b])
            a = b
            if a >= end:
                break
        if state is not None:
            digests[index] = state.intdigest()
    if r < len(lengths):  # runs past the last slot
        rest = slice(r + 1, None)
        _memmove_runs([dsts[r] + done, *dsts[rest]], [srcs[r] + done, *srcs[rest]], [lengths[r] - done, *lengths[rest]])


def _native_copy(kernel: NativeKernel, dsts: np.ndarray, srcs: np.ndarray, lengths: np.ndarray) -> None:
    """Copy runs in one call of the native kernel."""
    kernel.copy(dsts, srcs, lengths)


def _native_copy_and_hash(
    kernel: NativeKernel, part: _HashedPart, host_ptr: int, digests: np.ndarray, stretch: int
) -> None:
    """:func:`_copy_and_hash` in one call of the native kernel (no GIL, no Python between pages)."""
    kernel.copy_hash(
        (part.dsts, part.srcs, part.lengths, part.hosts),
        (part.slot_firsts, part.slot_sizes, part.slot_ids),
        stretch,
        host_ptr,
        digests,
    )


class CpuBackend:
    """One thread per direction runs jobs in order; big jobs are shared with ``threads - 1`` helpers.

    Integrity runs on the direction's thread right after a job's copy, while its bytes are still in cache:
    a store seals its sub-blocks, a load verifies them and fails if any does not match.
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
        # the native kernel copies small pages as fast as long ones: block views are its pure-Python stand-in
        self._views = BlockViews(kv_flat, host_flat, layout) if layout is not None and kernel is None else None
        self._integrity = integrity
        self._host = host_flat  # the references keep the memory behind the raw pointers alive
        self._parts = threads
        self._helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvoffload-copy") if threads > 1 else None
        self._cond = threading.Condition()
        self._done: dict[Direction, deque[JobResult]] = {d: deque() for d in Direction}
        self._pending: set[int] = set()
        self._queues: dict[Direction, queue.SimpleQueue[tuple[int, CopyRuns, BlockSlots | None] | None]] = {
            d: queue.SimpleQueue() for d in Direction
        }
        self._threads = [
            threading.Thread(target=self._loop, args=(d,), name=f"kvoffload-{d.value}", daemon=True) for d in Direction
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job_id: int, direction: Direction, runs: CopyRuns, slots: BlockSlots | None) -> None:
        with self._cond:
            self._pending.add(job_id)
        self._queues[direction].put((job_id, runs, slots))

    def _loop(self, direction: Direction) -> None:
        jobs = self._queues[direction]
        is_store = direction.is_store
        integrity = self._integrity
        while (item := jobs.get()) is not None:
            job_id, runs, slots = item
            start = time.perf_counter()
            try:
                sums: Digests | None = None
                hashed = integrity.checksums and slots is not None and len(slots) > 0 and len(runs) > 0
                view_job = self._view_job(runs, is_store, slots)
                if view_job is not None:
                    sums = self._execute_views(view_job, runs.num_bytes, slots if hashed else None)
                elif hashed and slots is not None:
                    sums = self._execute_hashed(runs, is_store, slots)
                else:
                    self._execute(runs, is_store)
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
            with self._cond:
                self._done[direction].append(result)
                self._pending.discard(job_id)
                self._cond.notify_all()

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
        self._run_shares(lambda share: _copy_views(job, *share, step, host, slots, digests), shares)
        return digests if slots is not None else None

    def _execute(self, runs: CopyRuns, is_store: bool) -> None:
        if len(runs) == 0:
            return
        work = _cpu_work(runs, is_store, self._kv.data_ptr(), self._host.data_ptr(), self._parts_for(runs.num_bytes))
        kernel = self._kernel
        copy = functools.partial(_native_copy, kernel) if kernel is not None else _memmove_arrays
        self._run_shares(lambda share: copy(*share), work)

    def _execute_hashed(self, runs: CopyRuns, is_store: bool, slots: BlockSlots) -> Digests:
        """Copy and hash in shares (helpers copy while another share hashes); the slots' digests."""
        kernel = self._kernel
        host_ptr = self._host.data_ptr()
        work = _hashed_parts(runs, is_store, self._kv.data_ptr(), host_ptr, slots, self._parts_for(runs.num_bytes))
        if kernel is None:
            digests = [0] * len(slots)
            host = self._integrity.host
            self._run_shares(functools.partial(_copy_and_hash, host=host, digests=digests, stretch=_HASH_BYTES), work)
            return digests
        sums = np.zeros(len(slots), dtype=np.uint64)
        hash_share = functools.partial(
            _native_copy_and_hash, kernel, host_ptr=host_ptr, digests=sums, stretch=_NATIVE_HASH_BYTES
        )
        self._run_shares(hash_share, work)
        return sums

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
