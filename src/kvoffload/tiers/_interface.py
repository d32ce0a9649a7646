"""The interface of a secondary tier (:class:`SecondaryTier`) and what it reports: finished jobs
(:class:`TierIOResult`) and counters (:class:`TierStats`). :mod:`kvoffload.tiers._base` implements it once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.scheduler import Direction

__all__ = ["SecondaryTier", "TierIOResult", "TierStats"]


@dataclass(frozen=True, slots=True)
class TierIOResult:
    """A finished job on one tier (its IO; the wire's ``TierJobResult`` is per worker): which keys failed
    (indices into the job's keys), which of them had a bad record (counted and deleted), which of them were on a
    part of the medium that could not be reached (a dead cluster node), bytes moved, seconds."""

    job_id: int
    direction: Direction
    num_keys: int
    failed: tuple[int, ...]
    num_bytes: int
    seconds: float
    corrupt: tuple[int, ...] = ()
    unreachable: tuple[int, ...] = ()

    @property
    def success(self) -> bool:
        """True when every key of the job succeeded."""
        return not self.failed


@dataclass(slots=True)
class TierStats:
    """Counters of one tier instance since it was opened."""

    stores: int = 0
    stores_dropped: int = 0
    store_failures: int = 0
    loads: int = 0
    load_hits: int = 0
    load_misses: int = 0
    corrupt_records: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    write_busy_seconds: float = 0.0
    """Wall time during which at least one store job was in flight (jobs overlap: their seconds add up to more)."""
    read_busy_seconds: float = 0.0
    """Wall time during which at least one load job was in flight."""
    unavailable_events: int = 0
    unreachable_keys: int = 0
    """Keys of loads, stores and lookups whose part of the medium (a cluster node) could not be reached while the
    rest answered: counted among the misses or failed stores too; the tier stayed available."""
    resident_bytes: int = 0
    """Bytes of the records this instance holds (written, read, or found at start), a gauge."""
    resident_records: int = 0
    """Records this instance holds, a gauge."""
    available: bool = True
    last_error: str = ""
    extra: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class SecondaryTier(Protocol):
    """The interface every secondary tier (disk, Valkey, out-of-tree) offers to the tier workers."""

    name: str

    def submit_store(self, job_id: int, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> None:
        """Start writing ``rows[i]`` as the record of ``keys[i]``; never blocks on the medium."""
        ...

    def submit_load(self, job_id: int, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> None:
        """Start reading the record of ``keys[i]`` into the writable ``rows[i]`` (verified before success)."""
        ...

    def poll(self) -> list[TierIOResult]:
        """Jobs finished since the last call."""
        ...

    def wait(self, job_ids: Sequence[int], timeout: float | None = None) -> bool:
        """Block until the named jobs finished (True) or ``timeout`` passed (False)."""
        ...

    def lookup(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Whether each key has a record (a miss when the tier is unavailable)."""
        ...

    @property
    def available(self) -> bool:
        """False while the tier backs off after a fault."""
        ...

    def stats(self) -> TierStats:
        """A copy of the counters."""
        ...

    def close(self) -> None:
        """Finish in-flight work and release threads, files and connections."""
        ...
