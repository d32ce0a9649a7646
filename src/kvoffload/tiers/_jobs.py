"""The scheduler's record of one tier job in flight, and what a finished one adds to its tier's figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload._generated import TierJob
from kvoffload.tiers._health import TierStatsRow

__all__ = ["TierJobState", "count_finished"]


@dataclass(slots=True)
class TierJobState:
    """A tier job until every rank reported it: who reported, which keys failed or had a bad record, its IO."""

    job: TierJob
    req_id: str | None
    pending: int
    tokens: int
    reported: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    corrupt: set[int] = field(default_factory=set)
    num_bytes: int = 0
    seconds: float = 0.0
    stale: bool = False


def count_finished(row: TierStatsRow, state: TierJobState, good: int, bad: int) -> None:
    """Add a job every rank reported (``good`` chunks succeeded everywhere, ``bad`` failed somewhere) to ``row``."""
    if state.job.is_promotion:
        row.promoted_chunks += good
        row.promotion_failures += bad
        row.promotion_job_failures += bool(bad)
        row.tokens_promoted += state.tokens * good // max(1, good + bad)
        row.bytes_read += state.num_bytes
        row.read_seconds += state.seconds
    else:
        row.cascaded_chunks += good
        row.cascade_failures += bad
        row.cascade_job_failures += bool(bad)
        row.bytes_written += state.num_bytes
        row.write_seconds += state.seconds
