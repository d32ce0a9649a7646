"""The scheduler's book of tier jobs: each job in flight until every rank reported it, the jobs queued for the next
plan, the promotions each request waits for, and the fence of jobs in flight at a reset; and what a finished job
adds to its tier's figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload._generated import TierJob, TierJobResult
from kvoffload._packed import Int32Array, pack_int64
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.scheduler import TierStatsRow

__all__ = ["TierJobBook", "TierJobState", "count_finished"]


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
    corrupt_records: int = 0  # bad records the ranks found, one per rank namespace
    num_bytes: int = 0
    seconds: float = 0.0
    stale: bool = False


def count_finished(row: TierStatsRow, state: TierJobState, good: int, bad: int) -> None:
    """Add a job every rank reported (``good`` chunks succeeded everywhere, ``bad`` failed somewhere) to ``row``."""
    row.corrupt_records += state.corrupt_records
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


class TierJobBook:
    """Tier jobs from creation until every one of ``ranks`` reported them (or they failed)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.jobs: dict[int, TierJobState] = {}
        self._next_id = 0
        self._queued: list[TierJob] = []
        self._promoting: dict[str, set[int]] = {}  # request -> its promotion jobs in flight
        self.fence: set[int] = set()  # jobs in flight at the last reset, not yet reported

    def new(
        self, tier: int, is_promotion: bool, keys: list[OffloadKey], chunks: list[int], req_id: str | None, tokens: int
    ) -> TierJob:
        """A job queued for the next plan (a promotion counts for ``req_id`` until it finishes)."""
        job = TierJob(
            job_id=self._next_id, tier=tier, is_promotion=is_promotion, keys=tuple(keys), chunk_ids=pack_int64(chunks)
        )
        self._next_id += 1
        self.jobs[job.job_id] = TierJobState(job, req_id, self.ranks, tokens)
        self._queued.append(job)
        if is_promotion and req_id is not None:
            self._promoting.setdefault(req_id, set()).add(job.job_id)
        return job

    def take_queued(self) -> tuple[TierJob, ...]:
        """The jobs for this plan."""
        jobs, self._queued = self._queued, []
        return tuple(jobs)

    def promoting(self, req_id: str) -> bool:
        """Whether a promotion of the request is in flight."""
        return bool(self._promoting.get(req_id))

    def on_result(self, rank: int, result: TierJobResult) -> TierJobState | None:
        """Count one rank's result; the job's state once every rank reported it (then :meth:`finish` it)."""
        state = self.jobs.get(result.job_id)
        if state is None or rank in state.reported:
            return None
        state.reported.add(rank)
        state.failed.update(Int32Array.from_buffer(result.failed).tolist())
        if result.corrupt:
            corrupt = Int32Array.from_buffer(result.corrupt).tolist()
            state.corrupt.update(corrupt)
            state.corrupt_records += len(corrupt)
        state.num_bytes += result.num_bytes
        state.seconds = max(state.seconds, result.seconds)
        state.pending -= 1
        return state if state.pending == 0 else None

    def finish(self, state: TierJobState) -> None:
        """Forget a job every rank reported, or that failed."""
        job_id = state.job.job_id
        del self.jobs[job_id]
        self.fence.discard(job_id)
        if state.req_id is not None and state.job.is_promotion:
            jobs = self._promoting.get(state.req_id)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self._promoting[state.req_id]

    def reset(self) -> None:
        """vLLM ``reset_cache``: jobs not yet sent are dropped (the reset frees their chunks); jobs in flight become
        stale (their results no longer touch the pool) and fence the reset until they have all reported."""
        for job in self._queued:
            self.finish(self.jobs[job.job_id])
        self._queued = []
        for state in self.jobs.values():
            state.stale = True
        self.fence = set(self.jobs)
