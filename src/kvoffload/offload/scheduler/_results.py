"""What the offload scheduler reports: the outcome of worker reports and its running totals."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvoffload._generated import MissReason

__all__ = ["ExtensionFigures", "ReportOutcome", "SchedulerStats", "TierStatsRow"]


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    """What worker reports completed: requests whose loads finished (ready to run), failed or missed on a tier
    (a promotion they read failed or was late): both recompute."""

    finished_loads: tuple[str, ...]
    failed_loads: tuple[str, ...]
    failed_stores: tuple[str, ...]
    tier_missed_loads: tuple[str, ...] = ()

    @property
    def recompute(self) -> tuple[str, ...]:
        """Requests whose load copied nothing usable: failed or missed on a tier."""
        return self.failed_loads + self.tier_missed_loads


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's running totals since construction, and two gauges filled in by ``stats()``.

    The scheduler counts into one instance of this class as it works; :meth:`OffloadScheduler.stats` returns a
    copy with ``cache_usage`` (the manager's current gauge) and ``jobs_in_flight`` set, so a caller's copy never
    changes under it. Anything keyed by field name (metrics, the vLLM connector's interval stats) reads these
    field names.
    """

    lookups: int = 0
    """Lookups answered for good (a request counts once per final answer, as vLLM counts it for its hit rate)."""
    lookup_hits: int = 0
    lookup_misses: int = 0
    lookups_deferred: int = 0
    """Lookups answered "ask again later" (None): re-asks, not counted in ``lookups``."""
    tokens_loaded: int = 0
    tokens_stored: int = 0
    allocation_failures: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    failed_jobs: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    cache_usage: float = 0.0
    """Gauge: share of host chunks that cannot be evicted (the manager's ``usage``), at the ``stats()`` call."""
    jobs_in_flight: int = 0
    """Gauge: copy jobs not yet reported by every worker, at the ``stats()`` call."""
    corrupt_loads: int = 0
    """Load jobs failed because a worker found a host chunk corrupt (integrity); the request recomputes."""
    corrupted_chunks: int = 0
    """Keys dropped from the manager because their host chunk did not verify."""
    lookup_miss_reasons: dict[MissReason, int] = field(default_factory=dict)
    """Lookups that loaded nothing (or were deferred by a pending store), by the reason of their first miss."""
    chunk_miss_reasons: dict[MissReason, int] = field(default_factory=dict)
    """Wanted chunks that lookups did not load, by reason (a chunk counts once per lookup)."""
    chunks_removed: dict[MissReason, int] = field(default_factory=dict)
    """Chunks dropped as corrupt by load reports (integrity) or through :meth:`OffloadScheduler.forget_chunk`."""
    failed_loads: int = 0
    failed_stores: int = 0
    tier_missed_loads: int = 0
    """Load jobs that copied nothing because a promotion they read failed or was late (the request recomputes):
    misses, not failures (not in ``failed_jobs`` or ``failed_loads``)."""
    chunks_loaded: int = 0
    """Chunks (one key per group) of completed load jobs."""
    chunks_stored: int = 0
    """Chunks (one key per group) of completed store jobs."""
    pending_recomputes: int = 0
    """Lookups that recomputed chunks whose store was still in flight instead of waiting for it
    (``max_recompute_pending_tokens``)."""
    shared_loads: int = 0
    """Load jobs that read host chunks another request's load was reading too (shared, not waited for)."""
    sync_loads: int = 0
    """Load jobs done inside the engine step under ``sync_load_budget_bytes`` (the others load between steps)."""

    def count(self, reasons: dict[MissReason, int], reason: MissReason, n: int = 1) -> None:
        """Add ``n`` to ``reasons[reason]`` (one of the three by-reason tables of this instance)."""
        reasons[reason] = reasons.get(reason, 0) + n

    def snapshot(self, *, cache_usage: float, jobs_in_flight: int) -> SchedulerStats:
        """A copy (the by-reason tables copied too) with the two gauges set."""
        return replace(
            self,
            cache_usage=cache_usage,
            jobs_in_flight=jobs_in_flight,
            lookup_miss_reasons=dict(self.lookup_miss_reasons),
            chunk_miss_reasons=dict(self.chunk_miss_reasons),
            chunks_removed=dict(self.chunks_removed),
        )


@dataclass(slots=True)
class TierStatsRow:
    """What one tier did for this scheduler: cascades, drops, promotions, their bytes and seconds, and outages."""

    name: str
    cascaded_chunks: int = 0
    cascade_failures: int = 0
    dropped_chunks: int = 0
    promoted_chunks: int = 0
    promotion_failures: int = 0
    cascade_job_failures: int = 0
    """Cascade jobs with at least one failed chunk (vLLM's ``cascade_job_failures``)."""
    promotion_job_failures: int = 0
    """Promotion jobs with at least one failed chunk (vLLM's ``promotion_job_failures``)."""
    chunk_queries: int = 0
    """Chunks the scheduler's lookups asked the tier about (vLLM's ``chunk_queries``)."""
    chunk_hits: int = 0
    """Of those, chunks every rank's namespace had (vLLM's ``chunk_hits``)."""
    corrupt_records: int = 0
    """Records a worker found bad (damaged, of another namespace, not authenticated): missed and deleted."""
    tokens_promoted: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    bytes_read: int = 0
    read_seconds: float = 0.0
    index: int = 0
    """The tier's position in ``secondary_tiers``."""
    available: bool = True
    """Whether the scheduler's last lookup (or probe) reached every rank's namespace of the tier."""
    outages: int = 0
    """Times the tier went unavailable, as the scheduler saw it (one per outage, whatever the ranks)."""
    unavailable_reason: str = ""
    """Why the tier went unavailable last (kept after it came back)."""
    resident_bytes: int = 0
    """Bytes of records the workers' instances of the tier hold, summed over ranks (a gauge: each rank's last
    report with its tier job results; a rank that has not reported a job yet counts 0)."""
    resident_records: int = 0
    """Records the workers' instances of the tier hold, summed over ranks (a gauge, as ``resident_bytes``)."""

    @property
    def label(self) -> str:
        """The tier's metric label: its kind and index (``fs0``, ``valkey1``)."""
        return f"{self.name}{self.index}"

    @property
    def vllm_label(self) -> str:
        """The tier's label as vLLM's tiering metrics spell it: its place below the host pool (the primary tier is
        0) and its kind (``1:fs``, ``2:valkey``)."""
        return f"{self.index + 1}:{self.name}"

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0


@dataclass(frozen=True, slots=True)
class ExtensionFigures:
    """What an extension reports for metrics and logs: one row per tier (config order) and its counters that
    are not per tier (``tier_lookups_retry``, ``promotions_refused``, ...). Empty for the null extension."""

    tiers: tuple[TierStatsRow, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)
