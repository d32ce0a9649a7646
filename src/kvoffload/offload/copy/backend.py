"""What a copy backend is: the :class:`CopyBackend` protocol, the :class:`Direction` of a job, and its
:class:`TransferResult`.

A backend executes already planned jobs (:class:`~kvoffload.offload.copy.runs.CopyRuns` plus the sub-blocks
they touch) asynchronously, in submission order per direction, and seals stores / verifies loads in the host
pool's integrity table through :class:`Integrity`. The CPU backend (:mod:`.cpu`) uses threads, the CUDA
backend (:mod:`.cuda`) streams and events; :class:`~kvoffload.offload.copy.engine.CopyEngine` picks one.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvoffload.offload.copy.runs import CopyRuns
from kvoffload.offload.integrity import BlockSlots, IntegrityTable

__all__ = ["CopyBackend", "Direction", "Integrity", "TransferResult", "corrupt_result", "failed_result"]


class Direction(enum.Enum):
    """Which way a job moves bytes: STORE is engine → host, LOAD is host → engine."""

    STORE = "store"
    LOAD = "load"

    @property
    def is_store(self) -> bool:
        """True for :attr:`STORE` (the flag :class:`TransferResult` carries)."""
        return self is Direction.STORE


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one job: bytes moved (0 on failure) and the seconds its copies took."""

    job_id: int
    success: bool
    is_store: bool
    num_bytes: int
    seconds: float
    error: str | None = None
    corrupt_chunk_ids: tuple[int, ...] = ()
    """Chunks whose key tag or checksum did not verify (a failed load); empty otherwise."""


def failed_result(job_id: int, direction: Direction, seconds: float, exc: BaseException) -> TransferResult:
    """A job that raised ``exc``: no bytes count as moved."""
    return TransferResult(job_id, False, direction.is_store, 0, seconds, f"{type(exc).__name__}: {exc}")


def corrupt_result(job_id: int, seconds: float, chunk_ids: Sequence[int]) -> TransferResult:
    """A load that found host chunks whose key tag or checksum did not verify."""
    message = f"integrity: host chunks {list(chunk_ids)} failed verification (key tag or content checksum)"
    return TransferResult(job_id, False, False, 0, seconds, message, tuple(chunk_ids))


@dataclass(frozen=True)
class Integrity:
    """What a backend needs to seal stores and verify loads: the pool's table and the host bytes."""

    table: IntegrityTable
    host: memoryview
    checksums: bool

    def seal(self, slots: BlockSlots | None, sums: list[int] | None = None) -> None:
        """Record a completed store's tags (and checksums: ``sums`` if already computed)."""
        if slots is not None and len(slots):
            self.table.seal(slots, self.host, checksums=self.checksums, sums=sums)

    def verify(self, slots: BlockSlots | None, sums: list[int] | None = None) -> list[int]:
        """Chunk ids of ``slots`` that do not verify (``sums``: the slots' digests if already computed)."""
        if slots is None or not len(slots):
            return []
        return self.table.verify(slots, self.host, checksums=self.checksums, sums=sums)


class CopyBackend(Protocol):
    """Executes planned jobs asynchronously; jobs of one direction complete in submission order."""

    def submit(self, job_id: int, direction: Direction, runs: CopyRuns, slots: BlockSlots | None) -> None:
        """Queue a job and return at once (``slots``: the sub-blocks to seal or verify, None for none)."""
        ...

    def poll(self) -> list[TransferResult]:
        """Finished jobs since the last call: stores then loads, each in submission order."""
        ...

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        """Block until the jobs have finished (their results stay for :meth:`poll`); False on timeout."""
        ...

    def close(self) -> None:
        """Finish the submitted jobs and release threads or streams."""
        ...
