"""No convoys, bounded waits: shared loads, ``max_recompute_pending_tokens``, ``sync_load_budget_bytes``.

* Shared loads: a request whose chunks another request is loading gets its hit at once and loads them into its
  own blocks (vLLM 0.33 defers it until the other load lands: the convoy of vLLM issue 44294).
* ``max_recompute_pending_tokens`` (vLLM PR 57959): a short run of chunks still being stored at the end of a hit
  is recomputed instead of waited for.
* ``sync_load_budget_bytes`` (vLLM 0.33): per step, hits whose bytes fit in the budget load inside the step.
"""

from __future__ import annotations

import hashlib

import pytest

from kvoffload import ConfigError, JobResult, MissReason, StepPlan, TransferJob, WorkerReport
from kvoffload._packed import unpack_int64
from kvoffload.assembly import build_scheduler, decode_extra_config
from kvoffload.offload.keys import make_offload_key
from kvoffload.offload.manager import HostBlockManager, LookupResult
from kvoffload.offload.scheduler import OffloadScheduler
from tests.helpers import offloading_config

TPC = 16  # tokens per chunk (one 16-token block per chunk, one hash per block)


def make(chunks: int = 32, **kw: int) -> tuple[OffloadScheduler, HostBlockManager]:
    manager = HostBlockManager(chunks)
    config = offloading_config(worker_kv_bytes_per_block=1024)  # 64 bytes per token on the worker
    return OffloadScheduler(config, manager, **kw), manager


def hashes(tag: str, n: int) -> list[bytes]:
    out: list[bytes] = []
    prev = b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}:{i}".encode()).digest()
        out.append(prev)
    return out


def done(jobs: tuple[TransferJob, ...] | list[TransferJob], *, store: bool, corrupt: bool = False) -> WorkerReport:
    return WorkerReport(
        rank=0,
        step=0,
        results=tuple(
            JobResult(
                job_id=j.job_id,
                success=not corrupt,
                is_store=store,
                num_bytes=1,
                seconds=0.0,
                corrupt_chunk_ids=j.chunk_ids[:8] if corrupt else b"",
            )
            for j in jobs
        ),
    )


def stored(sched: OffloadScheduler, req: str, hs: list[bytes], *, upto: int | None = None) -> StepPlan:
    """Request ``req`` computes ``upto`` tokens of its prompt ``hs`` (all by default); returns the store plan."""
    tokens = len(hs) * TPC
    if req not in sched._book.requests:
        sched.add_request(req, hs, tokens)
        assert sched.lookup(req, 0) == 0
        sched.on_blocks_allocated(req, [list(range(100, 100 + len(hs)))])
    sched.on_tokens_computed(req, tokens if upto is None else upto)
    return sched.build_step_plan()


def ready(sched: OffloadScheduler, hs: list[bytes]) -> None:
    """The prefix ``hs`` is in the host pool, ready, and the request that stored it is gone."""
    plan = stored(sched, "writer", hs)
    sched.on_worker_reports([done(plan.store_jobs, store=True)])
    sched.finish_request("writer")


# -- shared loads ------------------------------------------------------------------------------------------


def test_concurrent_requests_share_the_host_chunks_instead_of_queueing_behind_one_load() -> None:
    sched, manager = make()
    hs = hashes("prefix", 4)
    ready(sched, hs)
    # Two requests arrive together (one scheduling pass); the last chunk is always recomputed.
    for req in ("a", "b"):
        sched.add_request(req, hs, 64)
    assert sched.lookup("a", 0) == 48
    sched.on_blocks_allocated("a", [[10, 11, 12, 13]], num_external_tokens=48)
    assert sched.lookup("b", 0) == 48, "b waited for a's load of the same chunks (convoy)"
    sched.on_blocks_allocated("b", [[20, 21, 22, 23]], num_external_tokens=48)
    plan = sched.build_step_plan()
    load_a, load_b = plan.load_jobs  # in arrival order: the workers' load lane runs a's first
    assert (load_a.req_id, load_b.req_id) == ("a", "b")
    assert unpack_int64(load_a.chunk_ids) == unpack_int64(load_b.chunk_ids) == [0, 1, 2]
    assert unpack_int64(load_a.block_ids) == [10, 11, 12] and unpack_int64(load_b.block_ids) == [20, 21, 22]

    # A third request arrives while both loads are in flight on the workers: it joins too.
    sched.add_request("c", hs, 64)
    assert sched.lookup("c", 0) == 48
    sched.on_blocks_allocated("c", [[30, 31, 32, 33]], num_external_tokens=48)
    (load_c,) = sched.build_step_plan().load_jobs
    stats = sched.stats()
    assert stats.lookups_deferred == 0 and stats.lookup_hits == 3
    assert stats.shared_loads == 2 and stats.load_jobs == 3

    # Each load keeps the chunks pinned until it lands; the first to land frees nothing the others read.
    assert sched.on_worker_reports([done([load_a], store=False)]).finished_loads == ("a",)
    assert manager.stats().usage > 0
    keys = [make_offload_key(h, 0) for h in hs[:3]]
    assert all(manager.lookup(k) is LookupResult.HIT for k in keys)
    outcome = sched.on_worker_reports([done([load_b, load_c], store=False)])
    assert outcome.finished_loads == ("b", "c")
    assert manager.stats().usage == 0.0 and not sched.has_pending_work()
    assert sched.stats().tokens_loaded == 3 * 48


def test_a_corrupt_chunk_of_a_shared_load_fails_every_load_of_it_and_is_never_served_again() -> None:
    sched, manager = make()
    hs = hashes("prefix", 3)
    ready(sched, hs)
    for i, req in enumerate(("a", "b")):
        sched.add_request(req, hs, 48)
        assert sched.lookup(req, 0) == 32
        sched.on_blocks_allocated(req, [[10 * i + 1, 10 * i + 2, 10 * i + 3]], num_external_tokens=32)
    load_a, load_b = sched.build_step_plan().load_jobs
    # The workers verify every load: both find the first chunk corrupt; it is dropped once, freed at the last unpin.
    assert sched.on_worker_reports([done([load_a], store=False, corrupt=True)]).failed_loads == ("a",)
    assert sched.on_worker_reports([done([load_b], store=False, corrupt=True)]).failed_loads == ("b",)
    stats = sched.stats()
    assert stats.corrupt_loads == 2 and stats.corrupted_chunks == 1
    assert manager.stats().usage == 0.0
    sched.add_request("c", hs, 48)
    assert sched.lookup("c", 0) == 0
    assert sched.lookup_misses("c")[0].reason is MissReason.CORRUPT


def test_an_aborted_sharer_releases_only_its_own_pins() -> None:
    sched, manager = make()
    hs = hashes("prefix", 3)
    ready(sched, hs)
    for i, req in enumerate(("a", "b")):
        sched.add_request(req, hs, 48)
        assert sched.lookup(req, 0) == 32
        sched.on_blocks_allocated(req, [[10 * i + 1, 10 * i + 2, 10 * i + 3]], num_external_tokens=32)
    sched.abort_request("b")  # its load was never sent
    (load_a,) = sched.build_step_plan().load_jobs
    assert manager.stats().usage > 0  # a's load still pins the chunks
    sched.on_worker_reports([done([load_a], store=False)])
    assert manager.stats().usage == 0.0 and sched._book.loading == {}


# -- max_recompute_pending_tokens --------------------------------------------------------------------------


def pending_tail(sched: OffloadScheduler) -> list[bytes]:
    """A prompt of 5 chunks whose first 2 chunks are ready and next 2 still being stored (the 5th is new)."""
    hs = hashes("prefix", 5)
    first = stored(sched, "writer", hs[:4], upto=32)
    sched.on_worker_reports([done(first.store_jobs, store=True)])
    assert stored(sched, "writer", hs[:4]).store_jobs  # chunks 2 and 3: in flight, never reported here
    sched.add_request("b", hs, 80)
    return hs


def test_by_default_a_lookup_waits_for_chunks_still_being_stored() -> None:
    sched, _ = make()
    pending_tail(sched)
    assert sched.lookup("b", 0) is None
    assert sched.stats().pending_recomputes == 0


def test_a_short_pending_run_is_recomputed_instead_of_waited_for() -> None:
    sched, _ = make(max_recompute_pending_tokens=32)
    pending_tail(sched)
    assert sched.lookup("b", 0) == 32, "the ready prefix loads now, the 2 pending chunks are recomputed"
    assert not sched.is_sync_load("b")
    misses = sched.lookup_misses("b")
    assert [(m.chunk, m.reason) for m in misses] == [(2, MissReason.STORE_PENDING), (3, MissReason.STORE_PENDING)]
    stats = sched.stats()
    assert stats.pending_recomputes == 1 and stats.lookups_deferred == 0
    sched.on_blocks_allocated("b", [[1, 2, 3, 4, 5]], num_external_tokens=32)
    (load,) = sched.build_step_plan().load_jobs
    assert unpack_int64(load.block_ids) == [1, 2]


def test_a_pending_run_longer_than_the_bound_still_waits() -> None:
    sched, _ = make(max_recompute_pending_tokens=31)  # rounded down to whole chunks: 1 chunk < 2 pending
    pending_tail(sched)
    assert sched.lookup("b", 0) is None
    assert sched.stats().pending_recomputes == 0


def test_a_prefix_entirely_pending_is_recomputed_from_the_start() -> None:
    sched, _ = make(max_recompute_pending_tokens=1 << 20)
    hs = hashes("prefix", 3)
    stored(sched, "writer", hs)  # the store is in flight
    sched.add_request("b", hs, 48)
    assert sched.lookup("b", 0) == 0
    stats = sched.stats()
    assert stats.pending_recomputes == 1 and stats.lookup_miss_reasons[MissReason.STORE_PENDING] == 1


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_recompute_pending_tokens"):
        make(max_recompute_pending_tokens=-1)
    with pytest.raises(ConfigError, match="sync_load_budget_bytes"):
        make(sync_load_budget_bytes=-1)
    with pytest.raises(ConfigError, match="sync_load_budget_bytes"):
        decode_extra_config({"cpu_bytes_to_use": 1 << 20, "sync_load_budget_bytes": -1})


# -- sync_load_budget_bytes --------------------------------------------------------------------------------


def test_hits_within_the_step_budget_load_inside_the_step() -> None:
    # 48 tokens x 64 bytes = 3072 bytes per hit: the budget holds one hit per step.
    sched, _ = make(sync_load_budget_bytes=4000)
    hs = hashes("prefix", 4)
    ready(sched, hs)
    for req in ("a", "b", "c"):
        sched.add_request(req, hs, 64)
    assert sched.lookup("a", 0) == 48 and sched.is_sync_load("a")
    assert sched.lookup("b", 0) == 48 and not sched.is_sync_load("b"), "over the step's budget: between steps"
    for i, req in enumerate(("a", "b")):
        sched.on_blocks_allocated(req, [[10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4]], num_external_tokens=48)
    assert [(j.req_id, j.sync) for j in sched.build_step_plan().load_jobs] == [("a", True), ("b", False)]
    # The next step has its budget again.
    assert sched.lookup("c", 0) == 48 and sched.is_sync_load("c")
    sched.on_blocks_allocated("c", [[31, 32, 33, 34]], num_external_tokens=48)
    assert [j.sync for j in sched.build_step_plan().load_jobs] == [True]
    assert sched.stats().sync_loads == 2


def test_without_a_budget_every_load_is_asynchronous() -> None:
    sched, _ = make()
    hs = hashes("prefix", 4)
    ready(sched, hs)
    sched.add_request("a", hs, 64)
    assert sched.lookup("a", 0) == 48 and not sched.is_sync_load("a")
    sched.on_blocks_allocated("a", [[1, 2, 3, 4]], num_external_tokens=48)
    assert [j.sync for j in sched.build_step_plan().load_jobs] == [False]
    assert sched.stats().sync_loads == 0


def test_build_scheduler_takes_both_bounds_from_the_connector_keys() -> None:
    extra = {"cpu_bytes_to_use": 1 << 20, "sync_load_budget_bytes": 1 << 16, "max_recompute_pending_tokens": 256}
    sched = build_scheduler(offloading_config(extra_config=extra))
    assert (sched.sync_load_budget_bytes, sched.max_recompute_pending_tokens) == (1 << 16, 256)
    defaults = build_scheduler(offloading_config(extra_config={"cpu_bytes_to_use": 1 << 20}))
    assert (defaults.sync_load_budget_bytes, defaults.max_recompute_pending_tokens) == (0, 0)


def test_a_hit_the_engine_does_not_load_is_no_sync_load() -> None:
    sched, _ = make(sync_load_budget_bytes=1 << 20)
    hs = hashes("prefix", 4)
    ready(sched, hs)
    sched.add_request("a", hs, 64)
    assert sched.lookup("a", 0) == 48 and sched.is_sync_load("a")
    sched.on_blocks_allocated("a", [[1, 2, 3, 4]])  # the engine computes instead (e.g. it capped the hit)
    assert not sched.is_sync_load("a")
    assert sched.build_step_plan().load_jobs == () and sched.stats().sync_loads == 0
