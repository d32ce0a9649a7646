"""Worker hooks: a small hook defined here runs inside real worker processes at each documented point."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvoffload import ConfigError, StepPlan, TransferJob, WorkerError, WorkerReport
from kvoffload._packed import pack_int64
from kvoffload.demo import default_snapshot
from kvoffload.runtime.cluster import WorkerCluster
from kvoffload.runtime.hooks import WorkerContext, WorkerHook, load_hook
from tests.helpers import transfer_job

pytestmark = pytest.mark.slow

PROBE = f"{__name__}:ProbeHook"


class ProbeHook:
    """Writes a byte into a block's first page when asked, reads one back, and reports what it saw.

    Attachments of a step (text): ``write BLOCK VALUE``, ``read BLOCK`` or ``raise RANK``.
    """

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.commands: list[str] = []
        self.steps = 0

    def _page_offset(self, block: int) -> int:
        layer = self.context.layout.groups[0].layers[0]
        return layer.engine_offset + block * layer.block_stride

    def before_step(self, plan: StepPlan, attachments: Sequence[memoryview]) -> None:
        self.commands = [bytes(a).decode() for a in attachments]

    def after_step(self, plan: StepPlan, report: WorkerReport) -> Sequence[bytes]:
        self.steps += 1
        seen: dict[str, object] = {
            "rank": self.context.rank,
            "world_size": self.context.world_size,
            "step": plan.step,
            "tag": self.context.options["tag"],
            "kv_bytes": self.context.kv.numel() == self.context.layout.engine_bytes,
            "results": sorted([r.job_id, r.success] for r in report.results),
        }
        for command in self.commands:
            verb, *args = command.split()
            if verb == "raise" and int(args[0]) == self.context.rank:
                raise RuntimeError(f"probe asked to fail at step {plan.step}")
            if verb == "write":
                self.context.kv[self._page_offset(int(args[0]))] = int(args[1])
            if verb == "read":
                seen["read"] = int(self.context.kv[self._page_offset(int(args[0]))])
        return [json.dumps(seen).encode()]

    def finish(self, report: WorkerReport) -> Sequence[bytes]:
        return [json.dumps({"rank": self.context.rank, "steps": self.steps}).encode()]

    def close(self) -> None:
        # A slow close: the scheduler must not end a failed worker before its hook has closed.
        time.sleep(float(str(self.context.options.get("close_delay_s", 0))))
        (Path(str(self.context.options["dir"])) / f"closed-{self.context.rank}").touch()


def _plan(
    step: int, loads: Sequence[TransferJob] = (), stores: Sequence[TransferJob] = (), flush: Sequence[int] = ()
) -> StepPlan:
    return StepPlan(step=step, load_jobs=tuple(loads), store_jobs=tuple(stores), flush=pack_int64(flush))


def _replies(step: object) -> dict[int, dict[str, object]]:
    return {rank: json.loads(bytes(extras[0])) for rank, extras in step.attachments.items()}  # type: ignore[attr-defined]


def test_probe_is_a_worker_hook() -> None:
    hook: WorkerHook = ProbeHook.__new__(ProbeHook)
    assert isinstance(hook, WorkerHook)
    assert load_hook(PROBE) is ProbeHook
    assert load_hook(f"{__name__}.ProbeHook") is ProbeHook


def test_hook_runs_at_each_point_of_a_step_in_the_worker_processes(tmp_path: Path) -> None:
    snapshot = default_snapshot(workers=2, num_blocks=32, cpu_bytes=8 << 20)
    options = {"tag": "probe", "dir": str(tmp_path), "close_delay_s": 1.5}
    with WorkerCluster(snapshot, hook=PROBE, hook_options=options, step_timeout_s=60) as cluster:
        r = cluster.step(_plan(0), [b"write 3 171"])  # the forward pass writes block 3
        assert _replies(r) == {
            rank: {"rank": rank, "world_size": 2, "step": 0, "tag": "probe", "kv_bytes": True, "results": []}
            for rank in (0, 1)
        }
        cluster.step(_plan(1, stores=[transfer_job(0, [3], [5])]), [])
        # The store starts at step 2; the flush makes the load wait for it: after_step sees the loaded KV.
        r = cluster.step(_plan(2, loads=[transfer_job(1, [7], [5])], flush=[0]), [b"read 7"])
        assert {rank: (reply["results"], reply["read"]) for rank, reply in _replies(r).items()} == {
            0: ([[0, True], [1, True]], 171),
            1: ([[0, True], [1, True]], 171),
        }
        # A hook that raises ends its worker; the scheduler is told the exception.
        r = cluster.step(_plan(3), [b"raise 1"])
        assert r.newly_dead == (1,)
        assert r.errors[1] == "worker 1 failed at step 3: RuntimeError: probe asked to fail at step 3"
        final = cluster.close()
    assert {rank: json.loads(bytes(extras[0])) for rank, extras in final.attachments.items()} == {
        0: {"rank": 0, "steps": 4}
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["closed-0", "closed-1"]
    assert not mp.active_children()


def test_without_a_hook_replies_carry_no_attachments() -> None:
    with WorkerCluster(default_snapshot(workers=1, num_blocks=8, cpu_bytes=4 << 20), step_timeout_s=60) as cluster:
        r = cluster.step(_plan(0), [b"ignored"])
        assert [len(extras) for extras in r.attachments.values()] == [0]
        final = cluster.close()
    assert [len(extras) for extras in final.attachments.values()] == [0]


@pytest.mark.parametrize(
    ("hook", "options", "message"),
    [
        ("no_such_module_xyz:Hook", None, r"hook='no_such_module_xyz:Hook': cannot import module 'no_such_module_xyz'"),
        (f"{__name__}:Missing", None, r"has no attribute 'Missing'"),
        (f"{__name__}:PROBE", None, r"names a str, not a callable factory"),
        ("", None, r"hook='' must be an importable dotted path"),
        (PROBE, {"tag": object()}, r"hook_options=.* are not JSON-safe"),
    ],
)
def test_bad_hooks_are_refused_before_spawning(hook: str, options: dict[str, object] | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerCluster(default_snapshot(workers=1, num_blocks=8, cpu_bytes=4 << 20), hook=hook, hook_options=options)
    assert not mp.active_children()


def test_a_factory_that_builds_no_hook_fails_the_worker_with_the_cause() -> None:
    with pytest.raises(WorkerError, match=r"worker 0 failed at step 0: ConfigError: hook=.*without before_step"):
        WorkerCluster(default_snapshot(workers=1, num_blocks=8, cpu_bytes=4 << 20), hook=f"{__name__}:NotAHook").start()
    assert not mp.active_children()


class NotAHook:
    """A factory whose product lacks the hook methods."""

    def __init__(self, context: WorkerContext) -> None:
        self.context = context


@pytest.mark.timeout(120)  # without a bounded grace the step would wait out the hook's 600 s close
def test_a_failed_worker_whose_close_hangs_is_still_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grace a failed worker gets to close is bounded: a hook whose close never returns does not hang the step."""
    monkeypatch.setattr("kvoffload.runtime.cluster._FAILED_EXIT_GRACE_S", 0.5)
    snapshot = default_snapshot(workers=1, num_blocks=8, cpu_bytes=4 << 20)
    options = {"tag": "probe", "dir": str(tmp_path), "close_delay_s": 600}
    with WorkerCluster(snapshot, hook=PROBE, hook_options=options, step_timeout_s=60) as cluster:
        r = cluster.step(_plan(0), [b"raise 0"])
        assert r.newly_dead == (0,)
        assert r.errors[0] == "worker 0 failed at step 0: RuntimeError: probe asked to fail at step 0"
        cluster.close()
    assert list(tmp_path.iterdir()) == []
    assert not mp.active_children()
