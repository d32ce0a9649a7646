"""Hypothesis state machine: random request lifecycles, plans and out-of-order (possibly failed) reports.

Whatever the interleaving, every job is planned once and completes once, failed stores never become hits,
and once every request is finished and every report delivered, no chunk stays pinned or pending and no
job stays in flight.
"""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload import JobResult, WorkerReport
from kvoffload.offload.manager import HostBlockManager, LookupResult
from kvoffload.offload.scheduler import OffloadScheduler
from tests.helpers import offloading_config

WORLD = 2
TPH = 16


def family_hashes(family: int, n: int) -> list[bytes]:
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{family}:{i}".encode()).digest()
        out.append(prev)
    return out


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = HostBlockManager(6, "lru")
        self.sched = OffloadScheduler(
            offloading_config(tokens_per_hash=TPH, blocks_per_chunk=1, world_size=WORLD), self.manager
        )
        self.active: dict[str, dict[str, object]] = {}
        self.next_req = 0
        self.next_block = 0
        self.outstanding: dict[int, set[int]] = {}  # job id -> ranks that still owe a report
        self.is_store: dict[int, bool] = {}
        self.planned: set[int] = set()
        self.failed_store_keys: set[bytes] = set()

    @precondition(lambda self: len(self.active) < 4)
    @rule(family=st.integers(0, 1), blocks=st.integers(2, 5))
    def add(self, family: int, blocks: int) -> None:
        rid = f"r{self.next_req}"
        self.next_req += 1
        self.sched.add_request(rid, family_hashes(family, blocks), blocks * TPH)
        self.active[rid] = {"blocks": blocks, "allocated": False, "hit": 0}

    @rule(data=st.data())
    def lookup_and_allocate(self, data: st.DataObject) -> None:
        waiting = [r for r, s in self.active.items() if not s["allocated"]]
        if not waiting:
            return
        rid = data.draw(st.sampled_from(waiting))
        state = self.active[rid]
        hit = self.sched.lookup(rid, 0)
        if hit is None:
            event("lookup deferred")
            return
        event("lookup hit" if hit else "lookup miss")
        assert hit % TPH == 0 and hit < int(state["blocks"]) * TPH  # type: ignore[call-overload]
        use = data.draw(st.sampled_from([hit, hit, 0]))
        n = int(state["blocks"])  # type: ignore[call-overload]
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.sched.on_blocks_allocated(rid, [ids], num_external_tokens=use)
        state["allocated"] = True
        self.sched.on_tokens_computed(rid, n * TPH)
        if use and data.draw(st.booleans()):
            event("abort with a load queued")
            self.sched.abort_request(rid)  # before the load is ever sent
            del self.active[rid]

    @rule()
    def plan(self) -> None:
        plan = self.sched.build_step_plan()
        for job, is_store in [(j, False) for j in plan.load_jobs] + [(j, True) for j in plan.store_jobs]:
            assert job.job_id not in self.planned, "a job is planned once"
            self.planned.add(job.job_id)
            self.outstanding[job.job_id] = set(range(WORLD))
            self.is_store[job.job_id] = is_store
            event("store job planned" if is_store else "load job planned")

    @rule(data=st.data(), success=st.sampled_from([True, True, True, False]))
    def report(self, data: st.DataObject, success: bool) -> None:
        if not self.outstanding:
            return
        job_id = data.draw(st.sampled_from(sorted(self.outstanding)))
        rank = data.draw(st.sampled_from(sorted(self.outstanding[job_id])))
        self.outstanding[job_id].discard(rank)
        if not self.outstanding[job_id]:
            del self.outstanding[job_id]
        result = JobResult(job_id=job_id, success=success, is_store=self.is_store[job_id], num_bytes=1, seconds=0.0)
        self.sched.on_worker_reports([WorkerReport(rank=rank, step=0, results=(result,))])

    @rule(data=st.data(), success=st.sampled_from([True, True, True, False]))
    def report_all_ranks(self, data: st.DataObject, success: bool) -> None:
        if not self.outstanding:
            return
        job_id = data.draw(st.sampled_from(sorted(self.outstanding)))
        ranks = data.draw(st.permutations(sorted(self.outstanding.pop(job_id))))
        results = [
            WorkerReport(
                rank=rank,
                step=0,
                results=(
                    JobResult(job_id=job_id, success=success, is_store=self.is_store[job_id], num_bytes=1, seconds=0.0),
                ),
            )
            for rank in ranks
        ]
        self.sched.on_worker_reports(results)

    @rule(data=st.data(), abort=st.booleans())
    def finish(self, data: st.DataObject, abort: bool) -> None:
        if not self.active or data.draw(st.integers(0, 2)):
            return  # finishing is rarer than the other steps, so prefixes live long enough to be reused
        rid = data.draw(st.sampled_from(sorted(self.active)))
        event("abort" if abort else "finish")
        (self.sched.abort_request if abort else self.sched.finish_request)(rid)
        del self.active[rid]

    @invariant()
    def in_flight_matches_outstanding(self) -> None:
        # Every job the scheduler still tracks was planned and owes a report (or is queued for the next plan).
        tracked = set(self.sched.in_flight_job_ids())
        assert set(self.outstanding) <= tracked
        assert self.manager.stats().usage <= 1.0

    def teardown(self) -> None:
        for rid in list(self.active):
            self.sched.finish_request(rid)
        self.plan()
        for job_id, ranks in list(self.outstanding.items()):
            for rank in ranks:
                result = JobResult(
                    job_id=job_id, success=True, is_store=self.is_store[job_id], num_bytes=1, seconds=0.0
                )
                self.sched.on_worker_reports([WorkerReport(rank=rank, step=0, results=(result,))])
        assert not self.sched.has_pending_work(), self.sched.in_flight_job_ids()
        stats = self.manager.stats()
        assert stats.usage == 0.0 and stats.write_usage == 0.0, stats  # nothing pinned, nothing pending
        for key in list(self.manager.store_counts):
            assert self.manager.lookup(key) is not LookupResult.HIT_PENDING


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=400, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
