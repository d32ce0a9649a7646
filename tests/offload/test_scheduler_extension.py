"""The scheduler's extension hooks: called at their documented points, with what they are documented to get."""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload import BlockStored, JobResult, Medium, OffloadKey, SchedulerExtension, WorkerReport, make_offload_key
from kvoffload._packed import pack_int64
from kvoffload.offload.manager import HostBlockManager, OffloadEvent
from kvoffload.offload.scheduler import ExtensionFigures, LookupAdvice, OffloadScheduler, TierFilter, parse_load_tiers
from kvoffload.tiers import TierJob
from tests.helpers import chained_hashes, offloading_config


class Recorder(SchedulerExtension):
    """An extension that records every call and defers lookups while ``defer`` is set."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.defer = False
        self.completed: list[OffloadKey] = []
        self.lookup_keys: list[list[OffloadKey]] = []
        self.pending = False
        self.jobs: tuple[TierJob, ...] = ()
        self.unavailable: set[OffloadKey] = set()

    def on_new_request(self, req_id: str, load_tiers: TierFilter) -> None:
        self.calls.append(f"on_new_request:{req_id}:{len(load_tiers.matchers)}")

    def take_events(self) -> list[OffloadEvent]:
        self.calls.append("take_events")
        return [OffloadEvent((make_offload_key(b"\x07" * 32, 0),), False, Medium.STORAGE)]

    def advise_lookup(
        self, req_id: str, keys: Sequence[Sequence[OffloadKey]], num_computed_tokens: int
    ) -> LookupAdvice:
        self.calls.append(f"advise_lookup:{req_id}:{num_computed_tokens}")
        self.lookup_keys = [list(k) for k in keys]
        return LookupAdvice(defer=self.defer, unavailable=frozenset(self.unavailable))

    def on_store_completed(self, keys: Sequence[OffloadKey]) -> None:
        self.calls.append("on_store_completed")
        self.completed.extend(keys)

    def plan_tier_jobs(self) -> tuple[TierJob, ...]:
        self.calls.append("plan_tier_jobs")
        jobs, self.jobs = self.jobs, ()
        return jobs

    def on_worker_reports(self, reports: Sequence[WorkerReport]) -> None:
        self.calls.append(f"on_worker_reports:{len(reports)}")

    def fail_in_flight(self) -> None:
        self.calls.append("fail_in_flight")

    def on_request_finished(self, req_id: str) -> None:
        self.calls.append(f"on_request_finished:{req_id}")

    def has_pending_work(self) -> bool:
        return self.pending

    def reset(self) -> None:
        self.calls.append("reset")

    def on_reset_flushed(self) -> None:
        self.calls.append("on_reset_flushed")

    def close(self) -> None:
        self.calls.append("close")


def _scheduler(ext: SchedulerExtension) -> OffloadScheduler:
    return OffloadScheduler(offloading_config(), HostBlockManager(8), extension=ext)


def _report(job_id: int, *, store: bool, success: bool = True) -> WorkerReport:
    return WorkerReport(
        rank=0, step=0, results=(JobResult(job_id=job_id, success=success, is_store=store, num_bytes=1, seconds=0.0),)
    )


def test_hooks_run_at_their_points_and_see_the_requests_keys() -> None:
    ext = Recorder()
    sched = _scheduler(ext)
    assert sched.extension is ext
    sched.add_request("r", chained_hashes("a", 2), 32)
    ext.defer = True
    assert sched.lookup("r", 0) is None  # the extension asked to be asked again
    stats = sched.stats()
    assert (stats.lookups, stats.lookups_deferred) == (0, 1), "a re-ask is not a lookup"
    assert ext.lookup_keys == [list(sched._book.requests["r"].keys[0])] and len(ext.lookup_keys[0]) == 2
    ext.defer = False
    assert sched.lookup("r", 0) == 0
    assert (sched.stats().lookups, sched.stats().lookups_deferred) == (1, 1), "the final answer is the lookup"
    sched.on_blocks_allocated("r", [[1, 2]])
    sched.on_tokens_computed("r", 32)
    tier_job = TierJob(job_id=7, tier=0, is_promotion=False, keys=(b"k",), chunk_ids=pack_int64([0]))
    ext.jobs = (tier_job,)
    plan = sched.build_step_plan()
    assert plan.tier_jobs == (tier_job,) and len(plan.store_jobs) == 1
    assert ext.calls[-1] == "plan_tier_jobs"
    (store,) = plan.store_jobs
    sched.on_worker_reports([_report(store.job_id, store=True)])
    assert ext.calls[-2:] == ["on_store_completed", "on_worker_reports:1"]  # stores first, then the reports
    assert ext.completed == list(sched._book.requests["r"].keys[0])
    sched.finish_request("r")
    assert ext.calls[-1] == "on_request_finished:r"


def test_a_failed_or_reset_store_is_never_handed_to_the_extension() -> None:
    ext = Recorder()
    sched = _scheduler(ext)
    sched.add_request("r", chained_hashes("b", 1), 16)
    assert sched.lookup("r", 0) == 0
    sched.on_blocks_allocated("r", [[1]])
    sched.on_tokens_computed("r", 16)
    (store,) = sched.build_step_plan().store_jobs
    sched.on_worker_reports([_report(store.job_id, store=True, success=False)])
    assert ext.completed == []
    sched.add_request("s", chained_hashes("c", 1), 16)
    assert sched.lookup("s", 0) == 0
    sched.on_blocks_allocated("s", [[2]])
    sched.on_tokens_computed("s", 16)
    (store,) = sched.build_step_plan().store_jobs
    sched.reset()
    assert "reset" in ext.calls
    sched.on_worker_reports([_report(store.job_id, store=True)])  # stale: the pool was reset since
    assert ext.completed == []


def test_the_extension_hears_when_the_reset_is_flushed() -> None:
    """vLLM's fence: ``on_reset_flushed`` once every copy job in flight at the reset has reported, at once when
    none was (promotions into freed host rows wait for it)."""
    ext = Recorder()
    sched = _scheduler(ext)
    sched.reset()
    assert ext.calls[-2:] == ["reset", "on_reset_flushed"]
    sched.add_request("r", chained_hashes("h", 1), 16)
    assert sched.lookup("r", 0) == 0
    sched.on_blocks_allocated("r", [[1]])
    sched.on_tokens_computed("r", 16)
    (store,) = sched.build_step_plan().store_jobs
    ext.calls.clear()
    sched.reset()
    assert ext.calls == ["reset"], "a store was in flight: the reset is not flushed yet"
    sched.on_worker_reports([])
    assert "on_reset_flushed" not in ext.calls
    sched.on_worker_reports([_report(store.job_id, store=True)])
    assert ext.calls[-1] == "on_reset_flushed"
    sched.on_worker_reports([_report(store.job_id, store=True)])
    assert ext.calls.count("on_reset_flushed") == 1


def test_pending_work_dead_workers_and_close_reach_the_extension() -> None:
    ext = Recorder()
    sched = _scheduler(ext)
    assert not sched.has_pending_work()
    ext.pending = True
    assert sched.has_pending_work()
    sched.fail_in_flight()
    assert "fail_in_flight" in ext.calls
    sched.close()
    assert ext.calls[-1] == "close"


def test_stats_has_no_side_effect_on_the_manager() -> None:
    """Reading the scheduler's stats leaves the manager's per-interval samples to whoever reads them."""
    manager = HostBlockManager(8)
    sched = OffloadScheduler(offloading_config(), manager)
    sched.add_request("r", chained_hashes("d", 3), 48)
    assert sched.lookup("r", 0) == 0
    sched.on_blocks_allocated("r", [[1, 2, 3]])
    sched.on_tokens_computed("r", 48)
    sched.build_step_plan()
    first, second = sched.stats(), sched.stats()
    assert first == second and first is not second
    assert manager.stats().allocation_sizes == (3,)  # still there: the scheduler's stats() took nothing


def test_chunks_the_extension_could_not_look_for_miss_as_tier_unavailable() -> None:
    """A host miss that a tier could not be asked for is a ``tier_unavailable`` miss, not ``never_stored``."""
    from kvoffload import MissReason

    ext = Recorder()
    sched = _scheduler(ext)
    sched.add_request("r", chained_hashes("e", 3), 48)
    keys = sched._book.requests["r"].keys[0]
    ext.unavailable = {keys[0], keys[1]}
    assert sched.lookup("r", 0) == 0
    assert [m.reason for m in sched.lookup_misses("r")] == [MissReason.TIER_UNAVAILABLE] * 2
    stats = sched.stats()
    assert stats.lookup_miss_reasons == {MissReason.TIER_UNAVAILABLE: 1}
    assert stats.chunk_miss_reasons == {MissReason.TIER_UNAVAILABLE: 2}
    ext.unavailable = set()
    sched.add_request("s", chained_hashes("e", 3), 48)
    assert sched.lookup("s", 0) == 0
    assert sched.stats().lookup_miss_reasons[MissReason.NEVER_STORED] == 1


def test_a_load_filter_reaches_the_extension_and_its_events_follow_the_pools() -> None:
    ext = Recorder()
    sched = _scheduler(ext)
    sched.add_request("r", chained_hashes("f", 1), 16)
    assert not any(c.startswith("on_new_request") for c in ext.calls), "no filter given: not called"
    sched.add_request("s", chained_hashes("g", 1), 16, load_tiers=parse_load_tiers([]))
    assert "on_new_request:s:0" in ext.calls
    events = sched.take_events()
    assert events == [BlockStored(block_hashes=(b"\x07" * 32,), group_idx=0, medium=Medium.STORAGE)]


def test_a_scheduler_without_an_extension_runs_the_null_one() -> None:
    """The base class is the null extension: every hook a no-op, nothing deferred, no tier jobs, no events."""
    sched = OffloadScheduler(offloading_config(), HostBlockManager(8))
    assert type(sched.extension) is SchedulerExtension
    sched.add_request("r", chained_hashes("n", 2), 32, load_tiers=parse_load_tiers([]))
    assert sched.lookup("r", 0) == 0
    sched.on_blocks_allocated("r", [[1, 2]])
    sched.on_tokens_computed("r", 32)
    plan = sched.build_step_plan()
    assert plan.tier_jobs == () and len(plan.store_jobs) == 1
    sched.on_worker_reports([_report(plan.store_jobs[0].job_id, store=True)])
    assert not sched.has_pending_work() and sched.take_events() == []
    assert sched.extension.figures() == ExtensionFigures() and sched.extension.describe() == []
    sched.reset()
    sched.close()
