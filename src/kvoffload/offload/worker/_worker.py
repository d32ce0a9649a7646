"""The worker side: applies each StepPlan to one rank's copy engine and reports finished jobs.

Per step, as vLLM 0.33's connector worker does: the stores planned in the previous step are
submitted first (they were deferred so that offload copies never delay sampling), then the jobs named in
``flush`` are waited for (their engine blocks are about to be reused), then this step's loads are submitted.
After the forward pass, this step's stores are queued for the next step. ``report`` collects what finished.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvoffload._generated import JobResult, StepPlan, TransferJob, WorkerReport
from kvoffload._packed import Int64Array
from kvoffload.errors import KVOffloadError
from kvoffload.offload._direction import Direction
from kvoffload.offload.worker.copy import CopyEngine, CopyJob

if TYPE_CHECKING:
    from kvoffload.tiers import TierWorker

__all__ = ["OffloadWorker"]


class OffloadWorker:
    """Drives one rank's :class:`CopyEngine` from StepPlans and turns its results into WorkerReports.

    A job the engine rejects (bad ids in a plan, a closed engine) is reported as failed instead of raising,
    so one bad job never takes the worker down. A load whose host chunks fail verification (integrity) is
    reported failed with the chunk ids in ``corrupt_chunk_ids``; ``corrupt_loads`` and ``corrupted_chunks``
    count them.
    """

    def __init__(self, engine: CopyEngine, *, rank: int, tiers: TierWorker | None = None) -> None:
        self.engine = engine
        self.rank = rank
        self.tiers = tiers  # secondary tiers: runs the plans' tier jobs (cascades, promotions)
        self._deferred_stores: list[TransferJob] = []
        self._in_flight: set[int] = set()
        self._failed: list[JobResult] = []
        self.corrupt_loads = 0
        """Loads failed because a host chunk did not verify (key tag or checksum), since construction."""
        self.corrupted_chunks = 0
        """Chunk ids reported corrupt by those loads (counted per load)."""

    @property
    def in_flight(self) -> frozenset[int]:
        """Jobs submitted to the copy engine and not yet reported."""
        return frozenset(self._in_flight)

    def start_step(self, plan: StepPlan) -> None:
        """Before the forward pass: finish tier IO after a reset, submit deferred stores, honour flushes, start
        this step's tier jobs, then submit its loads (a load reading chunks this plan promotes waits for that
        promotion first: chained promotions)."""
        if plan.flush_tiers and self.tiers is not None:
            self.tiers.wait()  # the reset freed the rows stale tier jobs still read or write
        self._submit_deferred()
        if plan.flush:
            self.engine.wait(Int64Array.from_buffer(plan.flush).tolist())
        promoted: set[int] = set()
        if self.tiers is not None and plan.tier_jobs:
            self.tiers.submit(plan.tier_jobs)
            for tier_job in plan.tier_jobs:
                if tier_job.is_promotion:
                    promoted.update(Int64Array.from_buffer(tier_job.chunk_ids).tolist())
        chained: list[TransferJob] = []
        for job in plan.load_jobs:
            if promoted and not promoted.isdisjoint(Int64Array.from_buffer(job.chunk_ids).tolist()):
                chained.append(job)  # it reads chunks a promotion of this plan writes: after the promotion
            else:
                self._submit(job, Direction.LOAD)
        if chained:
            self._submit_chained(chained)

    def wait_for_loads(self, plan: StepPlan, timeout: float | None = None) -> None:
        """Block until this step's loads are done (an engine that needs them before computing calls this)."""
        self.engine.wait((j.job_id for j in plan.load_jobs), timeout)

    def wait_for_promotions(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``, default the tiers' ``promotion_wait_s``) for the promotions this step started,
        so the step's report brings them and the next step loads them (CPU engines: left to the tier threads
        alone, they fight the engine loop for the GIL)."""
        return True if self.tiers is None else self.tiers.wait_for_promotions(timeout)

    def end_step(self, plan: StepPlan) -> None:
        """After the forward pass: queue this step's stores; they start at the beginning of the next step."""
        self._deferred_stores.extend(plan.store_jobs)

    def report(self, step: int) -> WorkerReport:
        """Jobs finished since the last report (submission order per direction; failures included)."""
        results = self.engine.poll()
        for r in results:
            if r.corrupt_chunk_ids:
                self.corrupt_loads += 1
                self.corrupted_chunks += len(r.corrupt_chunk_ids) // 8
        results.extend(self._failed)
        self._failed = []
        for r in results:
            self._in_flight.discard(r.job_id)
        tier_results = tuple(self.tiers.poll()) if self.tiers is not None else ()
        return WorkerReport(rank=self.rank, step=step, results=tuple(results), tier_results=tier_results)

    def drain(self, step: int, timeout: float | None = None) -> WorkerReport:
        """Submit what is deferred, wait for everything in flight, and report it (used at shutdown)."""
        self._submit_deferred()
        self.engine.wait(set(self._in_flight), timeout)
        if self.tiers is not None:
            self.tiers.wait(timeout)
        return self.report(step)

    def close(self) -> None:
        """Stop the copy engine (in-flight copies finish first) and the tiers."""
        self.engine.close()
        if self.tiers is not None:
            self.tiers.close()

    def _submit_chained(self, jobs: list[TransferJob]) -> None:
        """Loads that read chunks this plan's promotions write (a scheduler with chained promotions): they start
        once the promotions are done, or fail without copying when a promotion is not done in time."""
        tiers = self.tiers
        if tiers is not None and tiers.wait_for_promotions():
            for job in jobs:
                self._submit(job, Direction.LOAD)
            return
        for job in jobs:
            self._fail(job, Direction.LOAD, "a promotion it reads did not finish within promotion_wait_s", 0.0)

    def _submit_deferred(self) -> None:
        jobs, self._deferred_stores = self._deferred_stores, []
        for job in jobs:
            self._submit(job, Direction.STORE)

    def _submit(self, job: TransferJob, direction: Direction) -> None:
        started = time.perf_counter()
        try:
            self.engine.submit(CopyJob.from_transfer(job, direction))
        except KVOffloadError as exc:
            self._fail(job, direction, f"{type(exc).__name__}: {exc}", time.perf_counter() - started)
            return
        self._in_flight.add(job.job_id)

    def _fail(self, job: TransferJob, direction: Direction, error: str, seconds: float) -> None:
        self._failed.append(
            JobResult(
                job_id=job.job_id,
                success=False,
                is_store=direction.is_store,
                num_bytes=0,
                seconds=seconds,
                error=error,
            )
        )
