"""The demo engine handles a failed load as vLLM does, and its checks catch a load into blocks a request gave up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.demo import DemoOptions, default_snapshot, run_demo
from kvoffload.demo import runner as demo_runner
from kvoffload.demo.engine import DemoEngine
from kvoffload.demo.snapshots import MiB
from kvoffload.demo.workload import Request
from kvoffload.faults import FAULTS_ENV

OPTIONS = DemoOptions(
    requests=24,
    conversations=3,
    system_prompt_tokens=128,
    turn_tokens=(16, 64),
    decode_tokens=4,
    memcpy_probe_bytes=0,
)


def _faulty_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Half the host-to-engine load jobs fail without copying, in every worker process."""
    log = tmp_path / "faults.log"
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"seed": 7, "host_load": 0.5, "log": str(log)}))
    return log


def test_a_failed_load_frees_the_blocks_and_admits_the_request_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log = _faulty_loads(monkeypatch, tmp_path)
    result = run_demo(default_snapshot(workers=2, num_blocks=64, cpu_bytes=8 * MiB), OPTIONS, progress=False)
    assert log.read_text().count("host_load") > 0
    assert result.failed_jobs > 0 and result.load_restarts > 0
    assert result.mismatched_blocks == [] and result.blocks_verified > 0
    assert result.requests == OPTIONS.requests and not result.dead_workers


class _KeepsStaleBlocks(DemoEngine):
    """The bug vLLM's connector had: after a failed load the engine frees the request's blocks and allocates anew,
    but the offload scheduler keeps tracking the request under its old id, with the block ids it held before."""

    def _restart(self, req: Request) -> None:
        self.result.load_restarts += 1
        del self.running[req.sid]
        self.pool.release([b for blocks in req.blocks for b in blocks])
        req.blocks, req.loaded, req.num_computed = [], 0, 0
        self.waiting.appendleft(req)


def test_the_checks_catch_loads_into_blocks_the_request_gave_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The same run with the bug planted: the engine's own blocks are checked, so the stale loads show."""
    _faulty_loads(monkeypatch, tmp_path)
    monkeypatch.setattr(demo_runner, "DemoEngine", _KeepsStaleBlocks)
    result = run_demo(default_snapshot(workers=2, num_blocks=64, cpu_bytes=8 * MiB), OPTIONS, progress=False)
    assert result.load_restarts > 0
    assert result.mismatched_blocks, "a load into blocks the request no longer holds went unnoticed"
