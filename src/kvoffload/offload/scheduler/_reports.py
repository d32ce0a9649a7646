"""The offload scheduler's handling of worker reports: a job completes once every worker reported it; a failed
job never marks data ready; chunks a load found corrupt are dropped from the manager."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvoffload._generated import MissReason, WorkerReport
from kvoffload._packed import Int64Array
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.scheduler._results import ReportOutcome
from kvoffload.offload.scheduler._state import JobState, SchedulerBook
from kvoffload.offload.scheduler._transfers import Transfers

__all__ = ["Reports"]


class Reports:
    """The report-handling part of the offload scheduler: completing, failing and integrity-checking jobs.

    ``on_store_completed`` is called with the keys of every store that completed and is usable (not failed, not
    stale): the scheduler's extension point for what comes after the host pool (tiers cascade them).
    """

    def __init__(
        self, book: SchedulerBook, transfers: Transfers, on_store_completed: Callable[[list[OffloadKey]], None]
    ) -> None:
        self._book = book
        self._stats = book.stats
        self._manager = book.manager
        self._transfers = transfers
        self._on_store_completed = on_store_completed

    # --------------------------------------------------------------------------------------- completions

    def on_worker_reports(self, reports: Iterable[WorkerReport]) -> ReportOutcome:
        """Count copy-job results; a job completes once every worker reported it."""
        finished: list[str] = []
        failed_loads: list[str] = []
        failed_stores: list[str] = []
        missed: list[str] = []
        for report in reports:
            for result in report.results:
                job = self._book.jobs.get(result.job_id)
                if job is None or report.rank in job.reported:
                    continue  # unknown, already completed, or a repeated report from the same worker
                job.reported.add(report.rank)
                if result.corrupt_chunk_ids and not job.is_store:
                    self._drop_corrupt(job, Int64Array.from_buffer(result.corrupt_chunk_ids).tolist())
                stats = self._stats
                if job.is_store:
                    stats.bytes_stored += result.num_bytes
                    stats.store_seconds += result.seconds
                else:
                    stats.bytes_loaded += result.num_bytes
                    stats.load_seconds += result.seconds
                if not result.success:
                    job.failed = True
                    job.tier_miss = job.tier_miss and result.tier_miss
                job.pending -= 1
                if job.pending > 0:
                    continue
                self._complete(job, finished, failed_loads, failed_stores, missed)
        return ReportOutcome(tuple(finished), tuple(failed_loads), tuple(failed_stores), tuple(missed))

    def _drop_corrupt(self, job: JobState, chunk_ids: list[int]) -> None:
        """A worker found chunks of this load corrupt: drop their keys so they are never served again."""
        if not job.corrupt:
            job.corrupt = True
            self._stats.corrupt_loads += 1
        if job.stale:
            return  # reset since: the ids may name chunks of the new generation
        keys = [job.chunk_keys[c] for c in chunk_ids if c in job.chunk_keys]
        dropped = len(self._manager.drop(keys, MissReason.CORRUPT))
        self._stats.corrupted_chunks += dropped
        if dropped:
            self._stats.count(self._stats.chunks_removed, MissReason.CORRUPT, dropped)

    def fail_jobs(self, job_ids: Iterable[int]) -> ReportOutcome:
        """Fail jobs outright (e.g. a worker died before reporting them): pins released, data never ready."""
        finished: list[str] = []
        failed_loads: list[str] = []
        failed_stores: list[str] = []
        missed: list[str] = []
        for job_id in list(job_ids):
            job = self._book.jobs.get(job_id)
            if job is not None:
                job.failed = True
                job.tier_miss = False
                self._complete(job, finished, failed_loads, failed_stores, missed)
        return ReportOutcome(tuple(finished), tuple(failed_loads), tuple(failed_stores), tuple(missed))

    def _complete(
        self, job: JobState, finished: list[str], failed_loads: list[str], failed_stores: list[str], missed: list[str]
    ) -> None:
        del self._book.jobs[job.job_id]
        req = self._book.requests.get(job.req_id)
        if job.is_store:
            self._transfers.unfence(job)
            if not job.stale:
                self._manager.complete_store(job.keys, success=not job.failed)
            if job.failed:
                self._stats.failed_jobs += 1
                self._stats.failed_stores += 1
                failed_stores.append(job.req_id)
            elif not job.stale:
                self._stats.tokens_stored += job.num_tokens
                self._stats.chunks_stored += len(job.keys)
                self._on_store_completed(job.keys)
        else:
            self._book.release_load(job)
            if job.failed and job.tier_miss:
                self._stats.tier_missed_loads += 1
                missed.append(job.req_id)
            elif job.failed:
                self._stats.failed_jobs += 1
                self._stats.failed_loads += 1
                failed_loads.append(job.req_id)
            else:
                self._stats.tokens_loaded += job.num_tokens
                self._stats.chunks_loaded += len(job.keys)
                if req is not None and not req.finished:
                    finished.append(job.req_id)
        if req is not None:
            req.jobs.discard(job.job_id)
            if req.finished and not req.jobs:
                self._book.drop(req)
