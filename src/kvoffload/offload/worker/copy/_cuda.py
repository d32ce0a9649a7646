"""The CUDA backend: one stream per direction, each job one gather (store) or scatter (load) on the device
through a staging buffer, timed with CUDA events.

Integrity stays off the copy streams: a load's host sub-blocks are verified on the host before its copies are
enqueued, a store is sealed on the host once its end event has fired.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from kvoffload._generated import JobResult
from kvoffload.errors import TransferError
from kvoffload.offload.pool import BlockSlots
from kvoffload.offload.worker.copy._backend import Direction, Integrity, corrupt_result, done_result, failed_result
from kvoffload.offload.worker.copy._runs import CopyRuns, merge_runs

__all__ = ["CudaBackend"]

_ELEMENT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _element_index(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Index of every element of the runs, run after run (``starts[i] .. starts[i] + lengths[i] - 1``)."""
    before = lengths.cumsum(0) - lengths
    base = torch.repeat_interleave(starts - before, lengths, output_size=total)
    return base + torch.arange(total, dtype=torch.int64, device=starts.device)


def _indexed_transfer(
    kv_flat: torch.Tensor, host_flat: torch.Tensor, runs: CopyRuns, is_store: bool
) -> list[torch.Tensor]:
    """Move ``runs`` with one gather (store) or scatter (load) on ``kv_flat``'s device through a staging
    buffer, plus one host copy per host-contiguous stretch; issued on the current stream.

    Works on any device (the CPU tests run it); on CUDA the copies are asynchronous and the returned tensors
    must stay alive until the stream has passed them.
    """
    if len(runs) == 0:
        return []
    order = torch.argsort(runs.host_offsets)
    host, engine, length = runs.host_offsets[order], runs.engine_offsets[order], runs.lengths[order]
    total = int(length.sum())
    size = 8
    while size > 1 and (kv_flat.data_ptr() % size or bool(((engine | length) % size).any())):
        size //= 2
    dtype = _ELEMENT_DTYPES[size]
    kv_elems = kv_flat[: kv_flat.numel() // size * size].view(dtype)
    device = kv_flat.device
    starts = (engine // size).to(device, non_blocking=True)
    counts = (length // size).to(device, non_blocking=True)
    index = _element_index(starts, counts, total // size)
    staging = torch.empty(total, dtype=torch.uint8, device=device)
    (stretch_host,), stretch_len = merge_runs((host.numpy(),), length.numpy())
    stretch_stage = stretch_len.cumsum(0) - stretch_len
    stretches = zip(stretch_host.tolist(), stretch_stage.tolist(), stretch_len.tolist(), strict=True)
    if is_store:
        torch.index_select(kv_elems, 0, index, out=staging.view(dtype))
        for h, s, n in stretches:
            host_flat[h : h + n].copy_(staging[s : s + n], non_blocking=True)
    else:
        for h, s, n in stretches:
            staging[s : s + n].copy_(host_flat[h : h + n], non_blocking=True)
        kv_elems.index_copy_(0, index, staging.view(dtype))
    return [staging, index, starts, counts]


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _done(event: torch.cuda.Event) -> bool:
    return bool(event.query())  # type: ignore[no-untyped-call]


@dataclass
class _CudaJob:
    job_id: int
    num_bytes: int
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    keep: list[torch.Tensor]
    error: BaseException | None = None
    slots: BlockSlots | None = None
    corrupt: tuple[int, ...] = ()


class CudaBackend:
    """One CUDA stream per direction; jobs run in order on it and complete when their end event fires.

    Integrity stays off the copy streams: a load's host sub-blocks are verified on the host before its
    copies are enqueued (a mismatch fails the job without copying), and a store is sealed on the host in
    :meth:`poll` once its end event has completed. The compute stream is never synchronized.
    """

    def __init__(self, kv_flat: torch.Tensor, host_flat: torch.Tensor, integrity: Integrity) -> None:
        self._kv = kv_flat
        self._integrity = integrity
        self._host = host_flat
        self._device = kv_flat.device
        self._streams = {d: _new_stream(self._device) for d in Direction}
        self._jobs: dict[Direction, deque[_CudaJob]] = {d: deque() for d in Direction}
        self._last_end: dict[Direction, torch.cuda.Event | None] = dict.fromkeys(Direction)

    def submit(self, job_id: int, direction: Direction, runs: CopyRuns, slots: BlockSlots | None) -> None:
        stream = self._streams[direction]
        jobs = self._jobs[direction]
        start, end = _timing_event(), _timing_event()
        if direction is Direction.LOAD:
            try:
                bad = self._integrity.verify(slots)
            except Exception as exc:
                jobs.append(_CudaJob(job_id, 0, None, None, [], exc))
                return
            if bad:
                jobs.append(_CudaJob(job_id, 0, None, None, [], None, corrupt=tuple(bad)))
                return
        try:
            # Start after the compute stream's pending work (which produced or still reads these blocks)
            # and after this direction's previous job (strict FIFO per direction).
            stream.wait_stream(torch.cuda.current_stream(self._device))
            previous = self._last_end[direction]
            if previous is not None:
                stream.wait_event(previous)
            with torch.cuda.stream(stream):
                start.record(stream)
                keep = _indexed_transfer(self._kv, self._host, runs, direction.is_store)
                end.record(stream)
        except Exception as exc:
            jobs.append(_CudaJob(job_id, 0, None, None, [], exc))
            return
        self._last_end[direction] = end
        jobs.append(_CudaJob(job_id, runs.num_bytes, start, end, keep, slots=slots))

    def poll(self) -> list[JobResult]:
        out: list[JobResult] = []
        for direction in (Direction.STORE, Direction.LOAD):
            jobs = self._jobs[direction]
            while jobs:
                job = jobs[0]
                try:
                    if job.corrupt:
                        result = corrupt_result(job.job_id, 0.0, job.corrupt)
                    elif job.error is None and job.end is not None and job.start is not None:
                        if not _done(job.end):
                            break
                        seconds = job.start.elapsed_time(job.end) * 1e-3
                        if direction is Direction.STORE:
                            self._integrity.seal(job.slots)  # host bytes are final once the end event fired
                        result = done_result(job.job_id, direction, job.num_bytes, seconds)
                    else:
                        result = failed_result(job.job_id, direction, 0.0, job.error or TransferError("no events"))
                except Exception as exc:  # an asynchronous CUDA error surfaces here
                    result = failed_result(job.job_id, direction, 0.0, exc)
                jobs.popleft()
                out.append(result)
        return out

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for jobs in self._jobs.values():
            for job in list(jobs):
                if job.job_id not in job_ids or job.end is None:
                    continue
                if deadline is None:
                    job.end.synchronize()
                    continue
                while not _done(job.end):
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.0002)
        return True

    def close(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()
