"""The offload scheduler's handling of worker reports: a job completes once every worker reported it; a failed
job never marks data ready; chunks a load found corrupt are dropped from the manager."""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload._generated import MissReason, WorkerReport
from kvoffload._packed import Int64Array
from kvoffload.offload.scheduler._results import ReportOutcome
from kvoffload.offload.scheduler._state import JobState, SchedulerState

__all__ = ["SchedulerReports"]


class SchedulerReports(SchedulerState):
    """The report-handling part of the offload scheduler: completing, failing and integrity-checking jobs."""

    # --------------------------------------------------------------------------------------- completions

    def on_worker_reports(self, reports: Iterable[WorkerReport]) -> ReportOutcome:
        """Count worker results; a job completes once all ``world_size`` workers reported it.

        A job any worker failed is a failure: its stored chunks are freed (never marked ready) and a failed
        load's request must recompute. Reports of unknown or stale jobs are ignored.
        """
        finished: list[str] = []
        failed_loads: list[str] = []
        failed_stores: list[str] = []
        for report in reports:
            for result in report.results:
                job = self._jobs.get(result.job_id)
                if job is None or report.rank in job.reported:
                    continue  # unknown, already completed, or a repeated report from the same worker
                job.reported.add(report.rank)
                if result.corrupt_chunk_ids and not job.is_store:
                    self._drop_corrupt(job, Int64Array.from_buffer(result.corrupt_chunk_ids).tolist())
                self._counters["bytes_stored" if job.is_store else "bytes_loaded"] += result.num_bytes
                self._seconds["store" if job.is_store else "load"] += result.seconds
                job.failed = job.failed or not result.success
                job.pending -= 1
                if job.pending > 0:
                    continue
                self._complete(job, finished, failed_loads, failed_stores)
        return ReportOutcome(tuple(finished), tuple(failed_loads), tuple(failed_stores))

    def _drop_corrupt(self, job: JobState, chunk_ids: list[int]) -> None:
        """A worker found chunks of this load corrupt: drop their keys so they are never served again."""
        if not job.corrupt:
            job.corrupt = True
            self._counters["corrupt_loads"] += 1
        if job.stale:
            return  # reset since: the ids may name chunks of the new generation
        keys = [job.chunk_keys[c] for c in chunk_ids if c in job.chunk_keys]
        dropped = len(self.manager.drop(keys, MissReason.CORRUPT))
        self._counters["corrupted_chunks"] += dropped
        if dropped:
            self._removed[MissReason.CORRUPT] = self._removed.get(MissReason.CORRUPT, 0) + dropped

    def fail_jobs(self, job_ids: Iterable[int]) -> ReportOutcome:
        """Fail jobs outright (e.g. a worker died before reporting them): pins released, data never ready."""
        finished: list[str] = []
        failed_loads: list[str] = []
        failed_stores: list[str] = []
        for job_id in list(job_ids):
            job = self._jobs.get(job_id)
            if job is not None:
                job.failed = True
                self._complete(job, finished, failed_loads, failed_stores)
        return ReportOutcome(tuple(finished), tuple(failed_loads), tuple(failed_stores))

    def in_flight_job_ids(self) -> list[int]:
        """Ids of jobs not yet reported by every worker."""
        return sorted(self._jobs)

    def _complete(self, job: JobState, finished: list[str], failed_loads: list[str], failed_stores: list[str]) -> None:
        del self._jobs[job.job_id]
        req = self._requests.get(job.req_id)
        if job.is_store:
            for block in job.blocks:
                if self._fenced.get(block) == job.job_id:
                    del self._fenced[block]
            if not job.stale:
                self.manager.complete_store(job.keys, success=not job.failed)
            if job.failed:
                self._counters["failed_jobs"] += 1
                self._failed["store"] += 1
                failed_stores.append(job.req_id)
            elif not job.stale:
                self._counters["tokens_stored"] += job.num_tokens
        else:
            self._release_load(job)
            if job.failed:
                self._counters["failed_jobs"] += 1
                self._failed["load"] += 1
                failed_loads.append(job.req_id)
            else:
                self._counters["tokens_loaded"] += job.num_tokens
                if req is not None and not req.finished:
                    finished.append(job.req_id)
        if req is not None:
            req.jobs.discard(job.job_id)
            if req.finished and not req.jobs:
                self._drop(req)
