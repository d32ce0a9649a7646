"""The CUDA backend: one copy stream per direction, each job DMAs, a row gather or the zero-copy kernel
(:mod:`._cuda_plan` decides per run), timed and completed with CUDA events; checksums on host threads.

A job's life:

1. :meth:`CudaBackend.submit` (the engine's thread) records a ``ready`` event on the current stream, the one
   the engine computes on, and hands the job to its direction's *lane* thread. It never blocks on the device.
2. The lane plans the job, makes the direction's copy stream wait for ``ready``, records ``start``, issues
   the copies (:mod:`._cuda_ops`) and records ``end``. A load then verifies its host sub-blocks (key tags
   and xxh3 checksums) on host threads while its copies run.
3. The direction's *completer* thread waits for ``end`` (a blocking event sync of that thread alone); a
   store then seals its sub-blocks, hashing the host bytes it wrote on host threads. Then the result is
   ready for :meth:`~CudaBackend.poll`: a load whose sub-blocks did not verify fails with their chunk ids
   (the scheduler recomputes such blocks: they never reach the model).

What orders the copies, by construction:

* ``ready`` is recorded on the engine's stream at submit, so the copies start after every kernel the engine
  enqueued before (the forward pass that wrote the blocks a store reads, or still reads the blocks a load
  overwrites); the engine's stream is never synchronized.
* One stream per direction: jobs of a direction run in submission order; stores and loads overlap.
* A store is sealed (its checksums computed) only after its ``end`` event has completed, so the host bytes
  it hashes are final. A result is reported only after ``end``: the engine uses loaded blocks only after the
  load is reported, hence after its copies.
* Everything the copies read stays referenced by the job until ``end`` has passed: index and tile tables,
  their pinned host buffers (torch's host allocator also waits for the copy) and the staging buffer, which
  is allocated on the copy stream (torch's caching allocator reuses it only in that stream's order).
* Host memory: DMAs are asynchronous only from pinned memory. While the pool's background registration
  is still running its copies are pageable, which CUDA performs synchronously with the issuing thread: the
  lane's, never the engine's (correct, slower). The zero-copy kernel needs the registered mapping, so jobs
  use it only once the pool reads as pinned.

On a CPU tensor the same backend runs its copies on the lane (a host timeline: events are points in time);
the tests drive the job flow that way.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import xxhash

from kvoffload._generated import JobResult
from kvoffload.offload.pool import BlockSlots
from kvoffload.offload.worker.copy._backend import Direction, Integrity, corrupt_result, done_result, failed_result
from kvoffload.offload.worker.copy._cuda_ops import TileLauncher, enqueue_plan, plan_runs, transfer_runs
from kvoffload.offload.worker.copy._cuda_plan import JobPlan, Policy
from kvoffload.offload.worker.copy._runs import CopyRuns

__all__ = ["CudaBackend", "transfer_runs"]

_indexed_transfer = transfer_runs  # the name the copy-engine tests drive every executor through

_PARALLEL_HASH_BYTES = 4 << 20
"""Slots of a job are hashed on several threads when they hold at least this many bytes per thread."""

_xxh3_64 = xxhash.xxh3_64_intdigest


class _Timeline(Protocol):
    """Where a backend's copies run: CUDA streams and events, or the lane thread itself (CPU memory)."""

    def bind(self) -> None: ...
    def mark(self) -> Any: ...
    def run(self, direction: Direction, ready: Any, issue: Callable[[], list[torch.Tensor]]) -> tuple[Any, Any]: ...
    def wait(self, end: Any) -> None: ...
    def seconds(self, start: Any, end: Any) -> float: ...
    def close(self) -> None: ...


class _CudaTimeline:
    """One stream per direction on ``device``; events mark where a job starts and ends."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._streams = {d: torch.cuda.Stream(device) for d in Direction}  # type: ignore[no-untyped-call]

    def bind(self) -> None:
        torch.cuda.set_device(self._device)

    def mark(self) -> torch.cuda.Event:
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self._device))
        return ready

    def run(
        self, direction: Direction, ready: torch.cuda.Event, issue: Callable[[], list[torch.Tensor]]
    ) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        stream = self._streams[direction]
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True, blocking=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            start.record(stream)
            issue()
            end.record(stream)
        return start, end

    def wait(self, end: torch.cuda.Event) -> None:
        end.synchronize()  # a blocking-sync event: this thread sleeps, GIL released

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end)) * 1e-3

    def close(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()


class _HostTimeline:
    """CPU memory: a job's copies run on the lane when issued; its events are the times around them."""

    def bind(self) -> None:
        pass

    def mark(self) -> None:
        return None

    def run(self, direction: Direction, ready: None, issue: Callable[[], list[torch.Tensor]]) -> tuple[float, float]:
        start = time.perf_counter()
        issue()
        return start, time.perf_counter()

    def wait(self, end: float) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def close(self) -> None:
        pass


def _hash_range(host: memoryview, offsets: list[int], lengths: list[int], lo: int, hi: int) -> list[int]:
    return [_xxh3_64(host[o : o + n]) for o, n in zip(offsets[lo:hi], lengths[lo:hi], strict=True)]


class _Hasher:
    """xxh3_64 digests of a job's slots, split over ``threads`` host threads (xxhash releases the GIL)."""

    def __init__(self, host: memoryview, threads: int) -> None:
        self._host = host
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvoffload-hash") if threads > 1 else None

    def digests(self, slots: BlockSlots) -> list[int]:
        offsets, lengths = slots.ranges()
        parts = min(self._threads, len(lengths), sum(lengths) // _PARALLEL_HASH_BYTES)
        if self._pool is None or parts <= 1:
            return _hash_range(self._host, offsets, lengths, 0, len(lengths))
        bounds = [len(lengths) * i // parts for i in range(parts + 1)]
        futures = [
            self._pool.submit(_hash_range, self._host, offsets, lengths, a, b) for a, b in itertools.pairwise(bounds)
        ]
        return [digest for future in futures for digest in future.result()]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


@dataclass(eq=False)
class _Job:
    job_id: int
    direction: Direction
    runs: CopyRuns
    slots: BlockSlots | None
    ready: Any
    start: Any = None
    end: Any = None
    keep: list[torch.Tensor] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    result: JobResult | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    def finish(self, result: JobResult) -> None:
        self.keep = []  # the copies have run (or never will): their tensors may go
        self.result = result
        self.finished.set()


_UNLOADED: Any = object()


class CudaBackend:
    """One copy stream, lane thread and completer thread per direction (module docstring).

    ``policy`` picks the way runs move (:class:`~._cuda_plan.Policy`; replaceable between jobs). ``kernel``:
    the zero-copy kernel, ``"auto"`` to load it (Triton) when a job first could use it, or None for none.
    ``hash_threads``: host threads hashing checksums (default: up to 4).
    """

    def __init__(
        self,
        kv_flat: torch.Tensor,
        host_flat: torch.Tensor,
        integrity: Integrity,
        *,
        policy: Policy | None = None,
        kernel: TileLauncher | Literal["auto"] | None = "auto",
        hash_threads: int | None = None,
    ) -> None:
        self._kv = kv_flat
        self._host = host_flat
        self._integrity = integrity
        self.policy = policy or Policy()
        self._kernel: TileLauncher | None = _UNLOADED if kernel == "auto" else kernel
        self._kernel_lock = threading.Lock()  # both lanes may want to load it first
        self.kernel_error: str | None = None
        """Why the zero-copy kernel was turned off after it failed to launch (None: it did not fail)."""
        self._pinned = not kv_flat.is_cuda  # on CPU the host memory is as reachable as it gets
        self._timeline: _Timeline = _CudaTimeline(kv_flat.device) if kv_flat.is_cuda else _HostTimeline()
        threads = min(4, os.cpu_count() or 1) if hash_threads is None else hash_threads
        self._hasher = _Hasher(integrity.host, max(1, threads))
        self._jobs: dict[Direction, deque[_Job]] = {d: deque() for d in Direction}
        self._lanes: dict[Direction, queue.SimpleQueue[_Job | None]] = {d: queue.SimpleQueue() for d in Direction}
        self._issued: dict[Direction, queue.SimpleQueue[_Job | None]] = {d: queue.SimpleQueue() for d in Direction}
        self._threads = [
            threading.Thread(target=target, args=(d,), name=f"kvoffload-cuda-{name}-{d.name.lower()}", daemon=True)
            for d in Direction
            for name, target in (("lane", self._lane), ("done", self._completer))
        ]
        self._closed = False
        for thread in self._threads:
            thread.start()

    # -- the engine's thread --------------------------------------------------------------------------

    def submit(self, job_id: int, direction: Direction, runs: CopyRuns, slots: BlockSlots | None) -> None:
        job = _Job(job_id, direction, runs, slots, self._timeline.mark())
        self._jobs[direction].append(job)
        self._lanes[direction].put(job)

    def poll(self) -> list[JobResult]:
        out: list[JobResult] = []
        for direction in (Direction.STORE, Direction.LOAD):
            jobs = self._jobs[direction]
            while jobs and (result := jobs[0].result) is not None:
                jobs.popleft()
                out.append(result)
        return out

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for jobs in self._jobs.values():
            for job in list(jobs):
                if job.job_id in job_ids:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if not job.finished.wait(left):
                        return False
        return True

    def close(self) -> None:
        """Finish every submitted job (results stay pollable), then stop the threads and streams."""
        if self._closed:
            return
        self._closed = True
        for lane in self._lanes.values():
            lane.put(None)
        for thread in self._threads:
            thread.join()
        self._timeline.close()
        self._hasher.close()

    # -- lane and completer threads -------------------------------------------------------------------

    def _kernel_now(self) -> TileLauncher | None:
        """The zero-copy kernel if a job may use it now: loaded, and the host pool registered."""
        if self.policy.mode not in ("auto", "kernel"):
            return None
        if self._kernel is _UNLOADED:
            with self._kernel_lock:
                if self._kernel is _UNLOADED:
                    from kvoffload.offload.worker.copy._cuda_kernel import load_kernel

                    self._kernel = load_kernel()
        if self._kernel is None:
            return None
        if not self._pinned:
            self._pinned = bool(self._host.is_pinned())
        return self._kernel if self._pinned else None

    def _issue(self, job: _Job) -> None:
        is_store = job.direction.is_store
        kernel = self._kernel_now()
        plan = plan_runs(self._kv, self._host, job.runs, is_store, self.policy, kernel is not None)
        try:
            self._run(job, plan, kernel)
        except Exception as exc:
            if plan.tiles is None or self.policy.mode == "kernel":
                raise
            # The kernel failed to compile or launch (it is issued first, so nothing else was enqueued): turn
            # it off for good and move this job through the gather.
            self.kernel_error = f"{type(exc).__name__}: {exc}"
            self._kernel = None
            self._run(job, plan_runs(self._kv, self._host, job.runs, is_store, self.policy, False), None)

    def _run(self, job: _Job, plan: JobPlan, kernel: TileLauncher | None) -> None:
        def issue() -> list[torch.Tensor]:
            job.keep = enqueue_plan(self._kv, self._host, plan, job.direction.is_store, kernel)
            return job.keep

        job.start, job.end = self._timeline.run(job.direction, job.ready, issue)

    def _lane(self, direction: Direction) -> None:
        self._timeline.bind()
        lane, issued = self._lanes[direction], self._issued[direction]
        while (job := lane.get()) is not None:
            try:
                if len(job.runs):
                    self._issue(job)
                if direction is Direction.LOAD and job.slots is not None and len(job.slots):
                    sums = self._hasher.digests(job.slots) if self._integrity.checksums else None
                    job.corrupt = self._integrity.verify(job.slots, sums)
            except Exception as exc:
                job.finish(failed_result(job.job_id, direction, 0.0, exc))
            issued.put(job)
        issued.put(None)

    def _completer(self, direction: Direction) -> None:
        self._timeline.bind()
        issued = self._issued[direction]
        while (job := issued.get()) is not None:
            if job.result is not None:  # failed before its copies were issued
                continue
            try:
                seconds = 0.0
                if job.end is not None:
                    self._timeline.wait(job.end)
                    seconds = self._timeline.seconds(job.start, job.end)
                if job.corrupt:
                    result = corrupt_result(job.job_id, seconds, job.corrupt)
                else:
                    if direction is Direction.STORE and job.slots is not None and len(job.slots):
                        sums = self._hasher.digests(job.slots) if self._integrity.checksums else None
                        self._integrity.seal(job.slots, sums)  # the host bytes are final once end fired
                    result = done_result(job.job_id, direction, job.runs.num_bytes, seconds)
            except Exception as exc:  # an asynchronous CUDA error surfaces here
                result = failed_result(job.job_id, direction, 0.0, exc)
            job.finish(result)
