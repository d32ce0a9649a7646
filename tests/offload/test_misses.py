"""Explainable misses: every reason code a lookup can give, the per-request API, and the departure hook."""

from __future__ import annotations

import pytest

from kvoffload import BlockRemoved, ConfigError, InvalidStateError, JobResult, MissReason, WorkerReport
from kvoffload._packed import pack_int64, unpack_int64
from kvoffload.offload.keys import make_offload_key
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.scheduler import OffloadScheduler
from tests.helpers import chained_hashes as hashes
from tests.helpers import offloading_config

TPC = 16  # tokens per chunk in these tests (block 16, one block per chunk, hash every 16 tokens)


def make(
    chunks: int = 16, *, window: int | None = None, store_threshold: int = 0, max_departures: int = 65_536
) -> tuple[OffloadScheduler, HostBlockManager]:
    manager = HostBlockManager(
        chunks, enable_events=True, store_threshold=store_threshold, max_departures=max_departures
    )
    config = offloading_config([(0, 16, ("l0",), window)], tokens_per_hash=16, events=True)
    return OffloadScheduler(config, manager), manager


_ids = iter(range(1_000_000))


def offer(sched: OffloadScheduler, hs: list[bytes], *, report: bool | None = True) -> str:
    """Run a request over ``hs`` that computes everything and offers it for storing; report the store or not."""
    req = f"w{next(_ids)}"
    tokens = len(hs) * TPC
    sched.add_request(req, hs, tokens)
    sched.on_blocks_allocated(req, [list(range(100, 100 + len(hs)))])
    sched.on_tokens_computed(req, tokens)
    plan = sched.build_step_plan()
    if report is not None and plan.store_jobs:
        results = tuple(
            JobResult(job_id=j.job_id, success=report, is_store=True, num_bytes=1, seconds=0.0) for j in plan.store_jobs
        )
        sched.on_worker_reports([WorkerReport(rank=0, step=plan.step, results=results)])
    return req


def ask(sched: OffloadScheduler, hs: list[bytes], **kw: int) -> tuple[str, int | None]:
    req = f"r{next(_ids)}"
    sched.add_request(req, hs, len(hs) * TPC, **kw)
    return req, sched.lookup(req, 0)


def reasons(sched: OffloadScheduler, req: str) -> list[tuple[int, MissReason]]:
    return [(m.chunk, m.reason) for m in sched.lookup_misses(req)]


def test_never_stored() -> None:
    sched, _ = make()
    req, hit = ask(sched, hashes("a", 4))
    assert hit == 0
    # 64 tokens: chunks 0..2 are wanted (the last token is always recomputed, so chunk 3 is not)
    assert reasons(sched, req) == [
        (0, MissReason.NEVER_STORED),
        (1, MissReason.NEVER_STORED),
        (2, MissReason.NEVER_STORED),
    ]
    stats = sched.stats()
    assert stats.lookup_miss_reasons == {MissReason.NEVER_STORED: 1}
    assert stats.chunk_miss_reasons == {MissReason.NEVER_STORED: 3}
    assert sum(stats.lookup_miss_reasons.values()) == stats.lookup_misses == 1


def test_short_tail_is_never_stored() -> None:
    sched, _ = make()
    req, hit = ask(sched, hashes("a", 1))  # 16 tokens: nothing fills a loadable chunk
    assert hit == 0 and reasons(sched, req) == []
    assert sched.stats().lookup_miss_reasons == {MissReason.NEVER_STORED: 1}


def test_evicted_by_policy() -> None:
    sched, _ = make(chunks=4)
    a, b = hashes("a", 4), hashes("b", 4)
    offer(sched, a)
    offer(sched, b)  # needs all 4 chunks: every chunk of a is evicted
    req, hit = ask(sched, a)
    assert hit == 0
    assert {r for _, r in reasons(sched, req)} == {MissReason.EVICTED}
    assert sched.stats().lookup_miss_reasons[MissReason.EVICTED] == 1


def test_departure_memory_is_bounded() -> None:
    sched, _ = make(chunks=4, max_departures=2)
    a = hashes("a", 4)
    offer(sched, a)
    offer(sched, hashes("b", 4))
    req, _ = ask(sched, a)
    # 4 keys were evicted, the request's tail first (vLLM 0.33's LRU ranks a request's chunks by position:
    # a3, a2, a1, a0); only the last 2 are remembered
    assert [r for _, r in reasons(sched, req)] == [
        MissReason.EVICTED,
        MissReason.EVICTED,
        MissReason.NEVER_STORED,
    ]


def test_below_store_threshold() -> None:
    sched, _ = make(store_threshold=2)
    a = hashes("a", 4)
    offer(sched, a)  # first offer: counted, not stored
    req, hit = ask(sched, a)
    assert hit == 0
    assert {r for _, r in reasons(sched, req)} == {MissReason.BELOW_STORE_THRESHOLD}
    offer(sched, a)  # second offer reaches the threshold: stored
    _, hit = ask(sched, a)
    assert hit == 48


def test_store_pending_defers_with_a_reason() -> None:
    sched, _ = make()
    a = hashes("a", 4)
    offer(sched, a, report=None)  # store planned, never reported
    req, hit = ask(sched, a)
    assert hit is None
    assert reasons(sched, req) == [
        (0, MissReason.STORE_PENDING),
        (1, MissReason.STORE_PENDING),
        (2, MissReason.STORE_PENDING),
    ]
    stats = sched.stats()
    assert stats.lookup_miss_reasons == {MissReason.STORE_PENDING: 1}
    assert stats.lookups_deferred == 1 and stats.lookup_misses == 0


def test_store_failed() -> None:
    sched, _ = make()
    a = hashes("a", 4)
    offer(sched, a, report=False)
    req, hit = ask(sched, a)
    assert hit == 0
    assert {r for _, r in reasons(sched, req)} == {MissReason.STORE_FAILED}


def test_outside_sliding_window() -> None:
    sched, _ = make(window=2)
    a = hashes("a", 7)
    offer(sched, a)
    req, hit = ask(sched, hashes("a", 7))
    # 112 tokens: wanted chunks 0..5; the window of 2 chunks ending at chunk 6 is loaded (chunks 4, 5)
    assert hit == 96
    assert reasons(sched, req) == [(c, MissReason.OUTSIDE_WINDOW) for c in range(4)]
    assert sched.stats().lookup_miss_reasons == {}


def test_load_limit() -> None:
    sched, _ = make()
    a = hashes("a", 5)
    offer(sched, a)
    req, hit = ask(sched, a, max_load_tokens=32)
    assert hit == 32
    assert reasons(sched, req) == [(2, MissReason.LOAD_LIMIT), (3, MissReason.LOAD_LIMIT)]
    req, hit = ask(sched, a, max_load_tokens=8)
    assert hit == 0 and sched.stats().lookup_miss_reasons == {MissReason.LOAD_LIMIT: 1}


def test_full_hit_has_no_misses() -> None:
    sched, _ = make()
    a = hashes("a", 4)
    offer(sched, a)
    req, hit = ask(sched, a)
    assert hit == 48 and sched.lookup_misses(req) == ()


def test_misses_are_those_of_the_last_lookup() -> None:
    sched, _ = make()
    a = hashes("a", 4)
    req, hit = ask(sched, a)
    assert hit == 0 and len(sched.lookup_misses(req)) == 3
    sched.on_blocks_allocated(req, [[1, 2, 3, 4]])
    sched.on_tokens_computed(req, 64)
    sched.build_step_plan()  # a store job is now in flight for the request
    assert sched.lookup(req, 0) is None  # deferred: the request has a job in flight, not a miss
    assert sched.lookup_misses(req) == ()
    assert sched.stats().lookup_miss_reasons == {MissReason.NEVER_STORED: 1}


def test_corrupt_via_forget_chunk_and_after_gap() -> None:
    sched, manager = make()
    a = hashes("a", 5)
    offer(sched, a)
    manager.take_events()
    key1 = make_offload_key(a[1], 0)
    assert sched.forget_chunk(key1, MissReason.CORRUPT) is True
    assert key1 not in manager
    (event,) = sched.take_events()
    assert isinstance(event, BlockRemoved) and event.block_hashes == (a[1],)
    req, hit = ask(sched, a)
    assert hit == 16  # chunk 0 only: chunk 1 is gone, chunks 2 and 3 are stored but after the gap
    assert reasons(sched, req) == [(1, MissReason.CORRUPT), (2, MissReason.AFTER_GAP), (3, MissReason.AFTER_GAP)]
    assert sched.stats().chunks_removed == {MissReason.CORRUPT: 1}


def test_forget_pinned_chunk_turns_dead_and_goes_at_last_unpin() -> None:
    sched, manager = make()
    a = hashes("a", 4)
    offer(sched, a)
    req, hit = ask(sched, a)  # pins chunks 0..2
    assert hit == 48
    key0 = make_offload_key(a[0], 0)
    assert sched.forget_chunk(key0, MissReason.CORRUPT) is True
    assert key0 in manager  # still resident: the lookup's pin holds it ...
    assert manager.miss_reason(key0) is MissReason.CORRUPT  # ... but it is dead: never served again
    other, hit = ask(sched, a)
    assert hit == 0 and reasons(sched, other)[0] == (0, MissReason.CORRUPT)
    sched.on_blocks_allocated(req, [[1, 2, 3, 4]])  # no external tokens: pins released
    assert key0 not in manager
    assert manager.miss_reason(key0) is MissReason.CORRUPT
    assert not manager.has_pending_work()


def test_tier_unavailable_hook_on_absent_key() -> None:
    sched, _ = make()
    a = hashes("a", 4)
    for h in a[:3]:
        assert sched.forget_chunk(make_offload_key(h, 0), MissReason.TIER_UNAVAILABLE) is False
    req, hit = ask(sched, a)
    assert hit == 0 and {r for _, r in reasons(sched, req)} == {MissReason.TIER_UNAVAILABLE}
    assert sched.stats().lookup_miss_reasons == {MissReason.TIER_UNAVAILABLE: 1}


def test_remove_refuses_in_flight_store_and_bad_reason() -> None:
    sched, manager = make()
    a = hashes("a", 4)
    offer(sched, a, report=None)
    key0 = make_offload_key(a[0], 0)
    with pytest.raises(InvalidStateError, match="store is in flight"):
        manager.remove([make_offload_key(a[1], 0), key0], MissReason.CORRUPT)
    assert key0 in manager and make_offload_key(a[1], 0) in manager
    with pytest.raises(ConfigError, match="reason must be a MissReason"):
        manager.remove([key0], "corrupt")  # type: ignore[arg-type]


def test_manager_miss_reason_does_not_count_lookups() -> None:
    _, manager = make()
    before = manager.stats()
    assert manager.miss_reason(b"x" * 36) is MissReason.NEVER_STORED
    after = manager.stats()
    assert (after.lookups, after.misses) == (before.lookups, before.misses)


def test_corrupt_chunk_reported_by_a_worker_is_explained() -> None:
    """Integrity's path: a load report naming a corrupt chunk drops it, and later misses say ``corrupt``."""
    sched, manager = make()
    a = hashes("a", 4)
    offer(sched, a)
    req, hit = ask(sched, a)
    assert hit == 48
    sched.on_blocks_allocated(req, [[1, 2, 3, 4]], num_external_tokens=48)
    plan = sched.build_step_plan()
    (job,) = plan.load_jobs
    bad_chunk = unpack_int64(job.chunk_ids)[1]
    result = JobResult(
        job_id=job.job_id,
        success=False,
        is_store=False,
        num_bytes=0,
        seconds=0.0,
        corrupt_chunk_ids=pack_int64([bad_chunk]),
    )
    outcome = sched.on_worker_reports([WorkerReport(rank=0, step=plan.step, results=(result,))])
    assert outcome.failed_loads == (req,)
    other, hit = ask(sched, a)
    assert hit == 16
    assert reasons(sched, other) == [(1, MissReason.CORRUPT), (2, MissReason.AFTER_GAP)]
    stats = sched.stats()
    assert stats.corrupted_chunks == 1 and stats.chunks_removed == {MissReason.CORRUPT: 1}
    assert manager.miss_reason(make_offload_key(a[1], 0)) is MissReason.CORRUPT
