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
from kvoffload.faults import active_faults
from kvoffload.offload._direction import Direction
from kvoffload.offload.worker.copy import CopyEngine, CopyJob

if TYPE_CHECKING:
    from kvoffload.offload.worker._layerwise import LayerwiseCopies
    from kvoffload.tiers import TierWorker

__all__ = ["OffloadWorker"]


class OffloadWorker:
    """Drives one rank's :class:`CopyEngine` from StepPlans and turns its results into WorkerReports.

    A job the engine rejects (bad ids in a plan, a closed engine) is reported as failed instead of raising,
    so one bad job never takes the worker down. A load whose host chunks fail verification (integrity) is
    reported failed with the chunk ids in ``corrupt_chunk_ids``; ``corrupt_loads`` and ``corrupted_chunks``
    count them.
    """

    def __init__(
        self,
        engine: CopyEngine,
        *,
        rank: int,
        tiers: TierWorker | None = None,
        layerwise: LayerwiseCopies | None = None,
    ) -> None:
        self.engine = engine
        self.rank = rank
        self.tiers = tiers  # secondary tiers: runs the plans' tier jobs (cascades, promotions)
        self.layerwise = layerwise  # per-layer copies of the loads a step reads and of its stores
        self._step_stores: tuple[TransferJob, ...] = ()
        self._deferred_stores: list[TransferJob] = []
        self._in_flight: set[int] = set()
        self._failed: list[JobResult] = []
        self.corrupt_loads = 0
        """Loads failed because a host chunk did not verify (key tag or checksum), since construction."""
        self.corrupted_chunks = 0
        """Chunk ids reported corrupt by those loads (counted per load)."""

    @property
    def in_flight(self) -> frozenset[int]:
        """Jobs submitted to the copy engine (or copied layer by layer) and not yet reported."""
        if self.layerwise is None:
            return frozenset(self._in_flight)
        return frozenset(self._in_flight) | self.layerwise.in_flight

    def start_step(self, plan: StepPlan) -> None:
        """Before the forward pass: finish tier IO after a reset, submit deferred stores, honour flushes, start
        this step's tier jobs, then submit its loads (a load reading chunks this plan promotes waits for that
        promotion first: chained promotions)."""
        if plan.flush_tiers and self.tiers is not None:
            self.tiers.wait()  # the reset freed the rows stale tier jobs still read or write
        self._submit_deferred()
        if plan.flush:
            flush = Int64Array.from_buffer(plan.flush).tolist()
            self.engine.wait(flush)
            if self.layerwise is not None:
                self.layerwise.wait(flush)
        promoted: set[int] = set()
        if self.tiers is not None and plan.tier_jobs:
            self.tiers.submit(plan.tier_jobs)
            for tier_job in plan.tier_jobs:
                if tier_job.is_promotion:
                    promoted.update(Int64Array.from_buffer(tier_job.chunk_ids).tolist())
        chained: list[TransferJob] = []
        layered: list[TransferJob] = []
        layerwise = self.layerwise
        faults = active_faults()  # None unless a test or a chaos run turned fault injection on
        for job in plan.load_jobs:
            if faults is not None and faults.fail_host_load():
                self._fail(job, Direction.LOAD, "an injected fault (KVOFFLOAD_FAULTS): the load copied nothing")
            elif promoted and not promoted.isdisjoint(Int64Array.from_buffer(job.chunk_ids).tolist()):
                chained.append(job)  # it reads chunks a promotion of this plan writes: after the promotion
            elif layerwise is not None and layerwise.takes(job):
                layered.append(job)
            else:
                self._submit(job, Direction.LOAD)
        if chained:
            layered.extend(self._submit_chained(chained))
        if layered and layerwise is not None:
            layerwise.start_loads(layered)
        self._step_stores = plan.store_jobs if layerwise is not None else ()

    def wait_for_loads(self, plan: StepPlan, timeout: float | None = None) -> None:
        """Block until this step's loads are done (an engine that needs them before computing calls this)."""
        layerwise = self.layerwise
        if layerwise is None:
            self.engine.wait((j.job_id for j in plan.load_jobs), timeout)
            return
        copied = layerwise.in_flight
        self.engine.wait((j.job_id for j in plan.load_jobs if j.job_id not in copied), timeout)
        layerwise.wait((j.job_id for j in plan.load_jobs if j.job_id in copied), timeout)

    def wait_in_flight(self, timeout: float | None = None) -> None:
        """Block until every copy in flight is done (layer-wise ones included); results stay for :meth:`report`."""
        self.engine.wait(set(self._in_flight), timeout)
        if self.layerwise is not None:
            self.layerwise.wait(None, timeout)

    def wait_for_step_loads(self, plan: StepPlan, *, every_load: bool, timeout: float | None = None) -> None:
        """Before the forward pass, with layer-wise copies: wait for the loads it reads that are not copied
        layer by layer, and for the layers of those that are which get no per-layer hook (``every_load``: the
        step reads all its loads, else those marked ``sync``)."""
        copied = self.layerwise.in_flight if self.layerwise is not None else frozenset()
        whole = [j.job_id for j in plan.load_jobs if (every_load or j.sync) and j.job_id not in copied]
        self.engine.wait(whole, timeout)
        if self.layerwise is not None:
            self.layerwise.wait_unhooked(timeout)

    def wait_for_layer(self, layer_name: str, timeout: float | None = None) -> None:
        """Block until layer ``layer_name`` of this step's layer-wise loads is copied (its forward reads it)."""
        if self.layerwise is not None:
            self.layerwise.wait_layer(layer_name, timeout)

    def store_layer(self, layer_name: str) -> None:
        """Layer ``layer_name`` of this step's KV is written: with layer-wise copies, its stores start now."""
        if self.layerwise is not None and self._step_stores:
            self.layerwise.store_layer(layer_name, self._step_stores)

    def wait_for_promotions(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``, default the tiers' ``promotion_wait_s``) for the promotions this step started,
        so the step's report brings them and the next step loads them (CPU engines: left to the tier threads
        alone, they fight the engine loop for the GIL)."""
        return True if self.tiers is None else self.tiers.wait_for_promotions(timeout)

    def end_step(self, plan: StepPlan) -> None:
        """After the forward pass: queue this step's stores; they start at the beginning of the next step (with
        layer-wise copies they started layer by layer: the layers not started yet start now)."""
        if self.layerwise is not None:
            self.layerwise.finish_stores(plan.store_jobs)
            self._step_stores = ()
            return
        self._deferred_stores.extend(plan.store_jobs)

    def report(self, step: int) -> WorkerReport:
        """Jobs finished since the last report (submission order per direction; failures included)."""
        results = self.engine.poll()
        if self.layerwise is not None:
            results.extend(self.layerwise.poll())
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
        if self.layerwise is not None:
            self.layerwise.finish_stores()  # stores some layers of which were never saved (no end_step)
        self.wait_in_flight(timeout)
        if self.tiers is not None:
            self.tiers.wait(timeout)
        return self.report(step)

    def close(self) -> None:
        """Stop the copy engines (in-flight copies finish first) and the tiers."""
        self.engine.close()
        if self.layerwise is not None:
            self.layerwise.close()
        if self.tiers is not None:
            self.tiers.close()

    def _submit_chained(self, jobs: list[TransferJob]) -> list[TransferJob]:
        """Loads that read chunks this plan's promotions write (a scheduler with chained promotions): they start
        once the promotions are done; returns those to copy layer by layer. A load fails without copying when a
        promotion it reads is not done in time or failed (a tier miss, not host corruption), or when this rank
        does not promote its rows (a pool shared across ranks: its writer promotes them)."""
        tiers = self.tiers
        if tiers is None or not tiers.promotes:
            for job in jobs:
                self._fail(
                    job, Direction.LOAD, "chained to a promotion another rank runs (a shared pool)", tier_miss=True
                )
            return []
        if not tiers.wait_for_promotions():
            for job in jobs:
                late = "a promotion it reads did not finish within promotion_wait_s"
                self._fail(job, Direction.LOAD, late, tier_miss=True)
            return []
        failed = tiers.failed_promotion_chunks()
        layered: list[TransferJob] = []
        for job in jobs:
            if failed and not failed.isdisjoint(Int64Array.from_buffer(job.chunk_ids).tolist()):
                failed_promotion = "a promotion it reads failed (its tier record is missing or bad)"
                self._fail(job, Direction.LOAD, failed_promotion, tier_miss=True)
            elif self.layerwise is not None and self.layerwise.takes(job):
                layered.append(job)
            else:
                self._submit(job, Direction.LOAD)
        return layered

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

    def _fail(
        self, job: TransferJob, direction: Direction, error: str, seconds: float = 0.0, *, tier_miss: bool = False
    ) -> None:
        """Report ``job`` failed without copying (``tier_miss``: it reads chunks a failed or late promotion never
        wrote, so the scheduler counts a tier miss, not a failure)."""
        self._failed.append(
            JobResult(
                job_id=job.job_id,
                success=False,
                is_store=direction.is_store,
                num_bytes=0,
                seconds=seconds,
                error=error,
                tier_miss=tier_miss,
            )
        )
