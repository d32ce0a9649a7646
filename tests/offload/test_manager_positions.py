"""Position hints through the manager and the scheduler, and out-of-tree policies (``cache_policy_module_path``).

The manager hands a request's :class:`RequestContext` to the policy as vLLM 0.33's ``CPUOffloadingManager`` does
(the spec's section 4.4): store misses (``on_store_miss``), then the offer's store candidates and stored keys in
offer order (``on_request_access``), then the inserts; a load's keys (``on_request_access``); at finish the keys
per KV-cache group in ascending group order, each sorted by position when all are known, with the insertion-only
and reused keys apart. The scheduler records position ``(i + 1) x tokens_per_chunk`` for chunk ``i`` (section
5.4), so a running request's tail is evicted before its head, and before the chunks of later requests.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path

import msgspec
import pytest

from kvoffload import ConfigError, ConfigImportError, EngineSnapshot, JobResult, WorkerReport, codecs
from kvoffload.assembly import build_scheduler, decode_extra_config
from kvoffload.demo import default_snapshot
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.manager.policies import ARCPolicy, LRUPolicy, RequestContext, policy_factory
from kvoffload.offload.scheduler import OffloadScheduler
from kvoffload.translate import translate_snapshot, validate_runnable
from tests.helpers import chained_hashes as hashes
from tests.helpers import offloading_config

TPC = 16


def key(i: int, group: int = 0) -> bytes:
    return b"k%03d" % i + group.to_bytes(4, "big")


def keys(ids: Sequence[int], group: int = 0) -> list[bytes]:
    return [key(i, group) for i in ids]


class Recording(LRUPolicy):
    """LRU that records the request-scoped hooks it is given."""

    name = "recording"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.calls: list[tuple[object, ...]] = []

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        self.calls.append(("miss", list(keys), ctx))
        super().on_store_miss(keys, ctx)

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        self.calls.append(("access", list(keys), ctx))
        super().on_request_access(keys, ctx)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]] | Sequence[OffloadKey],
        insertion_only: AbstractSet[OffloadKey],
        reused: AbstractSet[OffloadKey] | None = None,
        ctx: RequestContext | None = None,
    ) -> None:
        self.calls.append(("finish", key_groups, insertion_only, reused, ctx))
        super().on_request_finished(key_groups, insertion_only, reused, ctx)


def recording_manager(chunks: int = 8) -> tuple[HostBlockManager, Recording]:
    manager = HostBlockManager(chunks, "lru")
    policy = Recording(chunks)
    manager._table._policy = policy  # the hooks are what is under test
    return manager, policy


def test_manager_hands_the_request_context_to_the_policy() -> None:
    manager, policy = recording_manager()
    ctx = manager.request_context("r")
    assert manager.request_context("r") is ctx
    ctx.set_offload_key_positions({key(i): 16 * i for i in range(1, 6)})
    stored = keys([1])
    assert manager.prepare_store(stored) is not None
    manager.complete_store(stored)
    assert manager.prepare_store(keys([2])) is not None  # pending: neither a candidate nor stored
    policy.calls.clear()
    plan = manager.prepare_store(keys([3, 2, 1, 4]), request_id="r")
    assert plan is not None and plan.keys_to_store == keys([3, 4])
    assert policy.calls == [("miss", keys([3, 4]), ctx), ("access", keys([3, 1, 4]), ctx)]
    rank3, rank4 = policy.rank(key(3)), policy.rank(key(4))
    assert rank3 is not None and rank4 is not None
    assert rank3[0] == rank4[0] and (rank3[1], rank4[1]) == (-48, -64)  # one request rank, then by position
    policy.calls.clear()
    assert manager.prepare_store(keys([1, 2]), request_id="r") is not None  # nothing new: stored keys still seen
    assert policy.calls == [("access", keys([1]), ctx)]
    policy.calls.clear()
    manager.complete_store(keys([3, 4]))
    manager.prepare_load(keys([1, 3]), request_id="r")
    manager.prepare_load(keys([4]))  # no request: no access
    assert policy.calls == [("access", keys([1, 3]), ctx)]


def test_finish_hands_key_groups_sorted_by_position_and_drops_the_context() -> None:
    manager, policy = recording_manager()
    ctx = manager.request_context("r")
    g0, g1 = keys([1, 2, 3]), keys([2, 4], group=1)
    ctx.set_offload_key_positions({g0[0]: 16, g0[1]: 32, g0[2]: 48, g1[0]: 32, g1[1]: 64})
    manager.on_request_finished([g1[1], g0[2], g0[0], g1[0], g0[1], g0[0]], {g0[0], g1[0]}, request_id="r")
    ((_, key_groups, insertion_only, reused, got),) = policy.calls
    assert key_groups == (tuple(g0), tuple(g1)) and got is ctx
    assert insertion_only == {g0[1], g0[2], g1[1]} and reused == {g0[0], g1[0]}
    assert manager.request_context("r") is not ctx  # dropped at finish: a new request starts afresh
    policy.calls.clear()
    manager.on_request_finished(keys([2, 1]), [key(1)])  # no request: the two-argument form, keys as given
    assert policy.calls == [("finish", keys([2, 1]), {key(1)}, None, None)]


def test_a_group_with_a_key_without_position_keeps_its_order() -> None:
    manager, policy = recording_manager()
    ctx = manager.request_context("r")
    ctx.set_offload_key_positions({key(1): 16, key(2): 32})
    manager.on_request_finished([key(2), key(1), key(3)], set(), request_id="r")
    assert policy.calls[0][1] == (tuple(keys([2, 1, 3])),)


def test_manager_victims_differ_with_positions() -> None:
    """The same calls, with and without the request's positions: a running request loses its tail first."""
    for hinted, expected in ((False, keys([1, 2])), (True, keys([4, 3]))):
        manager = HostBlockManager(4)
        request_id = "a" if hinted else None
        if hinted:
            manager.request_context("a").set_offload_key_positions({key(i): TPC * i for i in range(1, 5)})
        for batch in (keys([1, 2]), keys([3, 4])):
            assert manager.prepare_store(batch, request_id=request_id) is not None
            manager.complete_store(batch)
        plan = manager.prepare_store(keys([7, 8]))
        assert plan is not None and plan.evicted_keys == expected


def test_a_policy_written_for_1_4_still_works_without_contexts() -> None:
    class Old(LRUPolicy):
        def insert(self, key: bytes, chunk_id: int) -> None:  # type: ignore[override]
            super().insert(key, chunk_id)

        def insert_many(self, keys: Sequence[bytes], chunk_ids: Sequence[int]) -> None:  # type: ignore[override]
            super().insert_many(keys, chunk_ids)

        def touch(self, keys: Sequence[bytes]) -> None:  # type: ignore[override]
            super().touch(keys)

        def on_store_miss(self, keys: Sequence[bytes]) -> None:  # type: ignore[override]
            super().on_store_miss(keys)

        def on_request_finished(self, keys: Sequence[bytes], reused: AbstractSet[bytes]) -> None:  # type: ignore[override]
            super().on_request_finished(keys, reused)

    manager = HostBlockManager(2)
    manager._table._policy = Old(2)
    assert manager.prepare_store(keys([1, 2]), request_id="r") is not None
    manager.complete_store(keys([1, 2]))
    manager.touch(keys([1]))
    manager.on_request_finished(keys([2]), set(), request_id="r")
    plan = manager.prepare_store(keys([3]))
    assert plan is not None and plan.evicted_keys == keys([1])


# --------------------------------------------------------------------------- the scheduler records positions


def _report(sched: OffloadScheduler) -> None:
    plan = sched.build_step_plan()
    results = tuple(
        JobResult(job_id=j.job_id, success=True, is_store=store, num_bytes=1, seconds=0.0)
        for jobs, store in ((plan.load_jobs, False), (plan.store_jobs, True))
        for j in jobs
    )
    sched.on_worker_reports([WorkerReport(rank=0, step=plan.step, results=results)])


def test_scheduler_evicts_a_running_requests_tail_first_and_later_requests_last() -> None:
    """Request a stores its prompt in two steps, b stores in between, c needs two chunks: vLLM 0.33 takes a's
    tail (a's chunks rank at a's request rank, by position), where insertion order would take a's head."""
    config = offloading_config([(0, 16, ("l0",), None)], tokens_per_hash=16)
    manager = HostBlockManager(6)
    sched = OffloadScheduler(config, manager)
    a, b, c = hashes("a", 4), hashes("b", 2), hashes("c", 2)
    sched.add_request("a", a, 4 * TPC)
    sched.on_blocks_allocated("a", [[1, 2, 3, 4]])
    sched.on_tokens_computed("a", 2 * TPC)
    _report(sched)  # a0 a1
    sched.add_request("b", b, 2 * TPC)
    sched.on_blocks_allocated("b", [[5, 6]])
    sched.on_tokens_computed("b", 2 * TPC)
    _report(sched)  # b0 b1
    sched.on_tokens_computed("a", 4 * TPC)
    _report(sched)  # a2 a3
    sched.add_request("c", c, 2 * TPC)
    sched.on_blocks_allocated("c", [[7, 8]])
    sched.on_tokens_computed("c", 2 * TPC)
    plan = sched.build_step_plan()
    assert len(plan.store_jobs) == 1
    a_keys = [manager.lookup(k).name for k in (key_of(h) for h in a)]
    assert a_keys == ["HIT", "HIT", "MISS", "MISS"]  # a3 and a2 went, a's head and all of b stayed
    assert all(manager.is_ready(key_of(h)) for h in b)


def test_scheduler_rereading_its_own_chunks_is_no_reuse_for_arc() -> None:
    """A request that loads back chunks it stored itself (a preempted request looking up again) has not reused
    them: vLLM keeps them insertion-only, so ARC leaves them in T1 at finish."""
    config = offloading_config([(0, 16, ("l0",), None)], tokens_per_hash=16)
    manager = HostBlockManager(8, "arc")
    sched = OffloadScheduler(config, manager)
    hs = hashes("a", 3)
    sched.add_request("a", hs, 3 * TPC)
    sched.on_blocks_allocated("a", [[1, 2, 3]])
    sched.on_tokens_computed("a", 3 * TPC)
    _report(sched)  # a0 a1 a2 stored
    assert sched.lookup("a", 0) == 2 * TPC  # preempted: its own first two chunks are hits
    sched.on_blocks_allocated("a", [[4, 5, 6]], num_external_tokens=2 * TPC)
    _report(sched)
    sched.finish_request("a")
    arc = manager.policy
    assert isinstance(arc, ARCPolicy)
    assert not arc.t2
    assert list(arc.t1) == [key_of(h) for h in reversed(hs)]  # tail to head: the head ends most recent


def key_of(block_hash: bytes) -> bytes:
    return block_hash + b"\x00\x00\x00\x00"


def test_scheduler_drops_the_context_when_a_request_finishes() -> None:
    config = offloading_config([(0, 16, ("l0",), None)], tokens_per_hash=16)
    manager = HostBlockManager(4)
    sched = OffloadScheduler(config, manager)
    hs = hashes("a", 2)
    sched.add_request("a", hs, 2 * TPC)
    assert manager.request_context("a").get_offload_key_position(key_of(hs[1])) == 2 * TPC
    sched.finish_request("a")
    assert manager.request_context("a").get_offload_key_position(key_of(hs[1])) is None


# --------------------------------------------------------------------------- cache_policy_module_path

_MODULE = """
from kvoffload import CachePolicy
from kvoffload.offload.manager.policies import LRUPolicy

class MRU(LRUPolicy):
    def evict(self, n, protected):
        return super().evict(n, protected)

NotAPolicy = 3

class Abstract(CachePolicy):
    pass
"""


@pytest.fixture
def policy_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "kvo_test_policies.py").write_text(textwrap.dedent(_MODULE))
    (tmp_path / "kvo_test_broken.py").write_text("import kvo_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "kvo_test_policies"
    for name in ("kvo_test_policies", "kvo_test_broken"):
        sys.modules.pop(name, None)


def test_module_path_imports_an_out_of_tree_policy(policy_module: str) -> None:
    manager = HostBlockManager(4, "MRU", cache_policy_module_path=policy_module)
    assert type(manager.policy).__name__ == "MRU" and manager.policy_name == "MRU"
    assert manager.policy.capacity == 4
    assert isinstance(HostBlockManager(4, "lru", cache_policy_module_path=policy_module).policy, LRUPolicy)
    assert policy_factory("arc", policy_module) is policy_factory("arc")  # a registered name wins


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("NotAPolicy", r"not a kvoffload CachePolicy subclass"),
        ("Missing", r"has no 'Missing'"),
        ("Abstract", r"is abstract"),
        ("not a name", r"must name a class"),
    ],
)
def test_module_path_errors_name_the_keys(policy_module: str, name: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as info:
        HostBlockManager(4, name, cache_policy_module_path=policy_module)
    assert f"eviction_policy={name!r}" in str(info.value)
    assert f"cache_policy_module_path={policy_module!r}" in str(info.value)


@pytest.mark.parametrize("module", ["kvo_no_such_module", "kvo_test_broken"])
def test_an_unimportable_module_chains_the_import_error(policy_module: str, module: str) -> None:
    with pytest.raises(ConfigImportError, match=f"cache_policy_module_path='{module}'") as info:
        HostBlockManager(4, "MRU", cache_policy_module_path=module)
    assert isinstance(info.value, ImportError) and isinstance(info.value, ConfigError)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_unknown_policy_without_module_path_is_vllms_error() -> None:
    with pytest.raises(ConfigError, match=r"^Unknown cache policy: 'MRU' .*cache_policy_module_path"):
        HostBlockManager(4, "MRU")
    with pytest.raises(ConfigError, match="non-empty module path"):
        HostBlockManager(4, "MRU", cache_policy_module_path="")


def test_the_connector_key_reaches_the_manager(policy_module: str) -> None:
    extra = {"cpu_bytes_to_use": 1 << 20, "eviction_policy": "MRU", "cache_policy_module_path": policy_module}
    assert decode_extra_config(extra).cache_policy_module_path == policy_module
    assert decode_extra_config({"cpu_bytes_to_use": 1}).cache_policy_module_path is None
    sched = build_scheduler(offloading_config(extra_config=extra, worker_kv_bytes_per_block=4096))
    try:
        assert type(sched.manager.policy).__name__ == "MRU"
    finally:
        sched.close()


def _snapshot_with(extra: dict[str, object]) -> EngineSnapshot:
    doc = msgspec.json.decode(codecs.encode(default_snapshot(workers=2), format="json"))
    doc["engine_config"]["kv_transfer_config"]["kv_connector_extra_config"].update(extra)
    return codecs.decode(msgspec.json.encode(doc), EngineSnapshot, format="json")


def test_validate_runnable_checks_the_out_of_tree_policy(policy_module: str) -> None:
    snapshot = _snapshot_with({"eviction_policy": "MRU", "cache_policy_module_path": policy_module})
    validate_runnable(snapshot, translate_snapshot(snapshot))
    snapshot = _snapshot_with({"eviction_policy": "NotAPolicy", "cache_policy_module_path": policy_module})
    with pytest.raises(ConfigError, match="not a kvoffload CachePolicy subclass"):
        validate_runnable(snapshot, translate_snapshot(snapshot))
    snapshot = _snapshot_with({"eviction_policy": "MRU"})
    with pytest.raises(ConfigError, match=r"'MRU' is not a known cache policy .*cache_policy_module_path"):
        validate_runnable(snapshot, translate_snapshot(snapshot))
    snapshot = _snapshot_with({"eviction_policy": "MRU", "cache_policy_module_path": 3})
    with pytest.raises(ConfigError, match=r"\['cache_policy_module_path'\]=3 is not a module path"):
        validate_runnable(snapshot, translate_snapshot(snapshot))
