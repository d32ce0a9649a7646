"""What the offload scheduler reports: the outcome of worker reports and its running totals."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvoffload._generated import MissReason

__all__ = ["ReportOutcome", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    """What worker reports completed: requests whose loads finished (ready to run) or failed (recompute)."""

    finished_loads: tuple[str, ...]
    failed_loads: tuple[str, ...]
    failed_stores: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Totals since construction (cache usage is the manager's current gauge)."""

    lookups: int
    lookup_hits: int
    lookup_misses: int
    lookups_deferred: int
    tokens_loaded: int
    tokens_stored: int
    allocation_failures: int
    load_jobs: int
    store_jobs: int
    failed_jobs: int
    bytes_loaded: int
    bytes_stored: int
    load_seconds: float
    store_seconds: float
    cache_usage: float
    jobs_in_flight: int
    corrupt_loads: int = 0
    """Load jobs failed because a worker found a host chunk corrupt (integrity); the request recomputes."""
    corrupted_chunks: int = 0
    """Keys dropped from the manager because their host chunk did not verify."""
    # -- observability (issue 13)
    lookup_miss_reasons: Mapping[MissReason, int] = field(default_factory=dict)
    """Lookups that loaded nothing (or were deferred by a pending store), by the reason of their first miss."""
    chunk_miss_reasons: Mapping[MissReason, int] = field(default_factory=dict)
    """Wanted chunks that lookups did not load, by reason (a chunk counts once per lookup)."""
    chunks_removed: Mapping[MissReason, int] = field(default_factory=dict)
    """Chunks dropped as corrupt by load reports (integrity) or through :meth:`OffloadScheduler.forget_chunk`."""
    failed_loads: int = 0
    failed_stores: int = 0
