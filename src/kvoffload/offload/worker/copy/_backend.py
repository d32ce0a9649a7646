"""What a copy backend is: the :class:`CopyBackend` protocol and the :class:`Direction` of a job.

A finished job is reported as the wire type :class:`~kvoffload.JobResult` itself (what a worker sends the
scheduler), so the outcome of a copy has one name from the backend to the scheduler.

A backend executes already planned jobs (:class:`~kvoffload.offload.worker.copy.CopyRuns` plus the sub-blocks
they touch) asynchronously, in submission order per direction, and seals stores / verifies loads in the host
pool's integrity table through :class:`Integrity`. The CPU backend (:mod:`._cpu`) uses threads, the CUDA
backend (:mod:`._cuda`) streams and events; :class:`~kvoffload.offload.worker.copy.CopyEngine` picks one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvoffload._generated import JobResult
from kvoffload._packed import pack_int64
from kvoffload.offload._direction import Direction
from kvoffload.offload.pool import BlockSlots, Digests, IntegrityTable
from kvoffload.offload.worker.copy._runs import CopyRuns

__all__ = ["CopyBackend", "Direction", "Integrity", "corrupt_result", "done_result", "failed_result"]


def done_result(job_id: int, direction: Direction, num_bytes: int, seconds: float) -> JobResult:
    """A job whose copies completed (and, for a load, verified)."""
    return JobResult(job_id=job_id, success=True, is_store=direction.is_store, num_bytes=num_bytes, seconds=seconds)


def failed_result(job_id: int, direction: Direction, seconds: float, exc: BaseException) -> JobResult:
    """A job that raised ``exc``: no bytes count as moved; ``error`` names the exception."""
    return JobResult(
        job_id=job_id,
        success=False,
        is_store=direction.is_store,
        num_bytes=0,
        seconds=seconds,
        error=f"{type(exc).__name__}: {exc}",
    )


def corrupt_result(job_id: int, seconds: float, chunk_ids: Sequence[int]) -> JobResult:
    """A load that found host chunks whose key tag or checksum did not verify."""
    message = f"integrity: host chunks {list(chunk_ids)} failed verification (key tag or content checksum)"
    return JobResult(
        job_id=job_id,
        success=False,
        is_store=False,
        num_bytes=0,
        seconds=seconds,
        error=message,
        corrupt_chunk_ids=pack_int64(chunk_ids),
    )


@dataclass(frozen=True)
class Integrity:
    """What a backend needs to seal stores and verify loads: the pool's table and the host bytes."""

    table: IntegrityTable
    host: memoryview
    checksums: bool

    def seal(self, slots: BlockSlots | None, sums: Digests | None = None) -> None:
        """Record a completed store's tags (and checksums: ``sums`` if already computed)."""
        if slots is not None and len(slots):
            self.table.seal(slots, self.host, checksums=self.checksums, sums=sums)

    def verify(self, slots: BlockSlots | None, sums: Digests | None = None) -> list[int]:
        """Chunk ids of ``slots`` that do not verify (``sums``: the slots' digests if already computed)."""
        if slots is None or not len(slots):
            return []
        return self.table.verify(slots, self.host, checksums=self.checksums, sums=sums)


class CopyBackend(Protocol):
    """Executes planned jobs asynchronously; jobs of one direction complete in submission order."""

    def submit(self, job_id: int, direction: Direction, runs: CopyRuns, slots: BlockSlots | None) -> None:
        """Queue a job and return at once (``slots``: the sub-blocks to seal or verify, None for none)."""
        ...

    def poll(self) -> list[JobResult]:
        """Finished jobs since the last call: stores then loads, each in submission order."""
        ...

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        """Block until the jobs have finished (their results stay for :meth:`poll`); False on timeout."""
        ...

    def close(self) -> None:
        """Finish the submitted jobs and release threads or streams."""
        ...
