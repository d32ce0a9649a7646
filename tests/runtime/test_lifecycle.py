"""Process lifecycle of the runtime (issue 22): workers die with their scheduler, close is bounded.

Real processes and signals: a scheduler process (``lifecycle_scenario``) is SIGKILLed while its workers are busy
at a known point, and its workers must be gone within a deadline; ``close`` returns within its bound whatever a
worker does.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvoffload.demo import default_snapshot
from kvoffload.runtime.cluster import WorkerCluster
from tests.helpers import child_pids, process_gone, wait_for
from tests.runtime.lifecycle_scenario import SLEEPY

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("where", "thread"),
    [("start", "main"), ("step", "main"), ("step", "other")],
    ids=["during-start-up", "during-a-step", "during-a-step-spawned-off-the-main-thread"],
)
def test_workers_die_within_a_second_of_a_killed_scheduler(tmp_path: Path, where: str, thread: str) -> None:
    """SIGKILL of the scheduler while its workers sleep in their hook (building it, or in a step): they used to
    finish what they were doing first (22 s when the scheduler died during start-up). A cluster started off the
    main thread has no parent-death signal (it follows the spawning thread); the workers' parent watch acts."""
    log = (tmp_path / "scenario.log").open("wb")
    scenario = [sys.executable, "-m", "tests.runtime.lifecycle_scenario", where, thread, str(tmp_path)]
    proc = subprocess.Popen(scenario, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pids: set[int] = set()
    try:
        markers = lambda: sorted(tmp_path.glob(f"rank*.{where}"))  # noqa: E731
        assert wait_for(lambda: len(markers()) == 2, 90), (tmp_path / "scenario.log").read_text()
        pids = {int(path.read_text()) for path in markers()}
        assert pids == child_pids(proc.pid, b"spawn_main")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
        assert wait_for(lambda: all(process_gone(pid) for pid in pids), 1.5), (
            f"workers still alive {time.monotonic() - killed:.1f}s after the scheduler was killed: "
            f"{[pid for pid in pids if not process_gone(pid)]}"
        )
    finally:
        log.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the workers share the scenario's process group
        proc.wait(10)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_close_is_bounded_when_a_worker_does_not_finish() -> None:
    """A worker still busy in its final drain (its hook's finish) is killed at the close bound (10 s by
    default); close used to wait 30 s for it, then more to end it. The other worker's report comes back."""
    snapshot = default_snapshot(workers=2, num_blocks=32, cpu_bytes=8 * MiB)
    cluster = WorkerCluster(snapshot, hook=SLEEPY, hook_options={"sleep_at": "finish", "ranks": [1]})
    cluster.start()
    pids = set(cluster.pids.values())
    started = time.monotonic()
    try:
        final = cluster.close()
    finally:
        elapsed = time.monotonic() - started
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert elapsed < 13.0, f"close took {elapsed:.1f}s"
    assert [report.rank for report in final.reports] == [0]
    assert final.newly_dead == (1,)
    assert final.errors[1] == "worker 1 did not finish within 10s of close (close_timeout_s): killed"
    assert wait_for(lambda: all(process_gone(pid) for pid in pids), 2.0)
    assert not mp.active_children()
