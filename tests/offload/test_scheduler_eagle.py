"""EAGLE/MTP draft groups in the offload scheduler (vLLM 0.33 §5.4, §5.5).

Stores: while a request decodes, an EAGLE group's last offloadable chunk is volatile and waits for the next one
(``storable_chunks`` is one less). Lookups: an EAGLE group asks for one chunk past the hit end, then drops the
last chunk it found; the groups re-run until the hit converges.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import ConfigError, JobResult, StepPlan, WorkerReport
from kvoffload._packed import unpack_int32, unpack_int64
from kvoffload.offload.keys import BlockHash, make_offload_key
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.scheduler import OffloadScheduler
from tests.helpers import offloading_config

TPC = 16  # tokens per block = per chunk = per hash


def hashes(tag: str, n: int) -> list[BlockHash]:
    out: list[BlockHash] = []
    prev = b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}:{i}".encode()).digest()
        out.append(BlockHash(prev))
    return out


def scheduler(
    windows: list[int | None], eagle: list[int], *, chunks: int = 64, offload_prompt_only: bool = True
) -> OffloadScheduler:
    """Groups 0.. with ``windows`` (None: full attention), 16 tokens per block and chunk."""
    config = offloading_config(
        [(gid, TPC, (f"l{gid}",), w) for gid, w in enumerate(windows)], tokens_per_hash=TPC, world_size=1
    )
    return OffloadScheduler(
        config, HostBlockManager(chunks, "lru"), eagle_group_ids=eagle, offload_prompt_only=offload_prompt_only
    )


def store(sched: OffloadScheduler, hs: list[BlockHash], group: int, chunks: list[int]) -> None:
    keys = [make_offload_key(hs[c], group) for c in chunks]
    plan = sched.manager.prepare_store(keys)
    assert plan is not None and plan.keys_to_store == keys
    sched.manager.complete_store(keys)


def done(plan: StepPlan) -> list[WorkerReport]:
    results = tuple(
        JobResult(job_id=j.job_id, success=True, is_store=store, num_bytes=1, seconds=0.0)
        for jobs, store in ((plan.load_jobs, False), (plan.store_jobs, True))
        for j in jobs
    )
    return [WorkerReport(rank=0, step=plan.step, results=results)]


# -- stores: storable_chunks is one less for EAGLE groups while decoding -----------------------------------


def _store_step(sched: OffloadScheduler, computed: int) -> tuple[list[int], list[int], list[int]]:
    sched.on_tokens_computed("r", computed)
    plan = sched.build_step_plan()
    sched.on_worker_reports(done(plan))
    if not plan.store_jobs:
        return [0, 0], [0, 0], []
    (job,) = plan.store_jobs
    return unpack_int32(job.group_sizes), unpack_int32(job.block_indices), unpack_int64(job.block_ids)


def test_an_eagle_group_stores_its_last_chunk_only_once_the_next_one_is_complete_while_decoding() -> None:
    sched = scheduler([None, None], eagle=[1], offload_prompt_only=False)
    hs = hashes("a", 5)
    sched.add_request("r", hs[:2], 32)  # a prompt of two chunks
    assert sched.lookup("r", 0) == 0
    sched.on_blocks_allocated("r", [[0, 1], [10, 11]])
    # Prefill: the trailing chunk is stable (the draft input of its last position is the next prompt token).
    assert _store_step(sched, 32) == ([2, 2], [0, 0], [0, 1, 10, 11])
    sched.extend_request("r", hs[2:3], 48)
    sched.on_blocks_allocated("r", [[2], [12]])
    # Decoding: chunk 2 is the EAGLE group's last offloadable chunk; its store index does not move back either.
    assert _store_step(sched, 48) == ([1, 0], [2, 0], [2])
    sched.extend_request("r", hs[3:5], 80)
    sched.on_blocks_allocated("r", [[3, 4], [13, 14]])
    assert _store_step(sched, 80) == ([2, 2], [3, 2], [3, 4, 12, 13])  # chunk 4 of the EAGLE group waits
    assert sched.stats().store_jobs == 3


def test_without_eagle_groups_every_group_stores_every_complete_chunk_while_decoding() -> None:
    sched = scheduler([None, None], eagle=[], offload_prompt_only=False)
    hs = hashes("a", 3)
    sched.add_request("r", hs[:2], 32)
    assert sched.lookup("r", 0) == 0
    sched.on_blocks_allocated("r", [[0, 1], [10, 11]])
    _store_step(sched, 32)
    sched.extend_request("r", hs[2:3], 48)
    sched.on_blocks_allocated("r", [[2], [12]])
    assert _store_step(sched, 48) == ([1, 1], [2, 2], [2, 12])


def test_prompt_only_stores_never_see_the_decode_rule() -> None:
    sched = scheduler([None, None], eagle=[1])  # offload_prompt_only: offloadable tokens never pass the prompt
    hs = hashes("a", 4)
    sched.add_request("r", hs, 64)
    assert sched.lookup("r", 0) == 0
    sched.on_blocks_allocated("r", [[0, 1, 2, 3], [10, 11, 12, 13]])
    assert _store_step(sched, 64)[0] == [4, 4]


# -- lookups: one extra chunk, dropped ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "eagle", "stored", "hit"),
    [
        (None, [1], 5, 64),  # the extra (fifth) chunk is there: the drop costs nothing
        (None, [1], 4, 48),  # the group holds chunks 0-3: the hit stops one chunk before their end
        (None, [], 4, 64),
        (2, [1], 4, 48),  # a window group wants a window one chunk longer, ending at the extra chunk
        (2, [], 4, 64),
    ],
)
def test_an_eagle_group_queries_one_extra_chunk_and_drops_it(
    window: int | None, eagle: list[int], stored: int, hit: int
) -> None:
    sched = scheduler([None, window], eagle=eagle)
    hs = hashes("a", 5)
    for group in (0, 1):
        store(sched, hs, group, list(range(stored)))
    sched.add_request("r", hs, 80)  # the last token is recomputed: at most 4 chunks load
    assert sched.lookup("r", 0) == hit


def test_a_pending_extra_chunk_defers_the_lookup() -> None:
    sched = scheduler([None], eagle=[0])
    hs = hashes("a", 5)
    store(sched, hs, 0, [0, 1, 2, 3])
    extra = make_offload_key(hs[4], 0)
    assert sched.manager.prepare_store([extra]) is not None  # being written
    sched.add_request("r", hs, 80)
    assert sched.lookup("r", 0) is None  # the extra chunk was asked for
    sched.manager.complete_store([extra])
    assert sched.lookup("r", 0) == 64


def test_an_eagle_group_drops_again_when_a_non_eagle_group_moves_the_end() -> None:
    sched = scheduler([None, 2, 1], eagle=[1])
    hs = hashes("a", 10)
    store(sched, hs, 0, list(range(10)))
    store(sched, hs, 1, [3, 4, 5, 7, 8, 9])
    store(sched, hs, 2, [0, 1, 2, 3, 4, 5, 6, 7, 9])
    sched.add_request("r", hs, 160)
    # Group 1 first ends the hit at 9 chunks (window 7-8 plus the extra chunk 9); group 2 (no chunk 8) moves
    # it to 8; group 1 again needs a window ending at chunk 8 whose next chunk it holds: chunk 6 is missing, so
    # its window is 3-4 (extra chunk 5). Without the second drop the hit would be 6 chunks (window 4-5).
    assert sched.lookup("r", 0) == 80
    blocks = [list(range(g * 100, g * 100 + 10)) for g in range(3)]
    sched.on_blocks_allocated("r", blocks, num_external_tokens=80)
    (load,) = sched.build_step_plan().load_jobs
    assert unpack_int32(load.group_sizes) == [5, 2, 1] and unpack_int32(load.block_indices) == [0, 3, 4]
    assert -1 not in unpack_int64(load.chunk_ids)


def test_an_eagle_group_does_not_drop_again_at_an_end_another_eagle_group_set() -> None:
    sched = scheduler([2, 1], eagle=[0, 1])
    hs = hashes("a", 10)
    store(sched, hs, 0, [3, 4, 7, 8, 9])
    store(sched, hs, 1, [4, 5])
    sched.add_request("r", hs, 160)
    # Group 0 ends the hit at 9 chunks (window 7-8, extra 9); group 1 at 5 (window 4, extra 5), a dropped end:
    # group 0, re-checked there, needs its window 3-4 only. Dropping once more would need chunk 5 of group 0
    # and find no window at all.
    assert sched.lookup("r", 0) == 80


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([3], r"eagle_group_ids: group 3 is not an offloaded group \(offloaded group ids: \[0, 1\]\)"),
        ([True], r"eagle_group_ids must hold int group ids, got True"),
        ("0", r"eagle_group_ids must be a collection of KV cache group ids, got '0'"),
    ],
)
def test_bad_eagle_group_ids_are_config_errors(ids: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        scheduler([None, None], eagle=ids)  # type: ignore[arg-type]


# -- the converged hit (hypothesis) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    window: int | None
    eagle: bool
    present: tuple[bool, ...]


@st.composite
def cases(draw: st.DrawFn, *, max_eagle: int) -> tuple[list[Group], int, int, int]:
    n = draw(st.integers(1, 8))
    kinds = draw(
        st.lists(st.tuples(st.sampled_from([None, 1, 2, 3]), st.booleans()), min_size=1, max_size=3).filter(
            lambda ks: sum(e for _, e in ks) <= max_eagle
        )
    )
    groups = [Group(w, e, tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))) for w, e in kinds]
    num_tokens = n * TPC + draw(st.integers(0, TPC - 1))
    computed = draw(st.integers(0, n)) * TPC
    return groups, n, num_tokens, computed


def best_end(groups: list[Group], n: int, num_tokens: int, start: int, *, strict: bool) -> int:
    """The largest chunk end every group can serve (``strict``: an EAGLE group also holds the chunk after)."""

    def serves(g: Group, end: int) -> bool:
        hi = end + 1 if g.eagle and strict else end
        lo = start if g.window is None else max(start, end - g.window)
        return hi <= n and all(g.present[lo:hi])

    cap = min((num_tokens - 1) // TPC, n)
    return max((e for e in range(start + 1, cap + 1) if all(serves(g, e) for g in groups)), default=start)


def run_lookup(groups: list[Group], n: int, num_tokens: int, computed: int) -> tuple[OffloadScheduler, int]:
    eagle = [i for i, g in enumerate(groups) if g.eagle]
    sched = scheduler([g.window for g in groups], eagle=eagle)
    hs = hashes("h", n)
    for i, g in enumerate(groups):
        chunks = [c for c in range(n) if g.present[c]]
        if chunks:
            store(sched, hs, i, chunks)
    sched.add_request("r", hs, num_tokens)
    hit = sched.lookup("r", computed)
    assert hit is not None  # nothing is pending
    return sched, hit


@settings(max_examples=300, deadline=None)
@given(cases(max_eagle=1))
def test_the_converged_hit_is_the_longest_every_group_can_serve(case: tuple[list[Group], int, int, int]) -> None:
    groups, n, num_tokens, computed = case
    _, hit = run_lookup(groups, n, num_tokens, computed)
    start = computed // TPC
    assert hit == (best_end(groups, n, num_tokens, start, strict=True) - start) * TPC


@settings(max_examples=300, deadline=None)
@given(cases(max_eagle=3))
def test_the_converged_hit_never_exceeds_what_every_group_can_load(case: tuple[list[Group], int, int, int]) -> None:
    groups, n, num_tokens, computed = case
    sched, hit = run_lookup(groups, n, num_tokens, computed)
    start = computed // TPC
    assert best_end(groups, n, num_tokens, start, strict=True) - start <= hit // TPC
    assert hit // TPC <= best_end(groups, n, num_tokens, start, strict=False) - start
    if hit:
        blocks = [list(range(i * 100, i * 100 + n)) for i in range(len(groups))]
        sched.on_blocks_allocated("r", blocks, num_external_tokens=hit)
        (load,) = sched.build_step_plan().load_jobs
        assert -1 not in unpack_int64(load.chunk_ids)  # every chunk the load reads is in the pool
