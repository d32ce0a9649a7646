"""Busy processes for a loaded host: they run inside the block, and none is left running however the run ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvoffload import ConfigError
from kvoffload._cli import main
from kvoffload.demo.contend import contended
from tests.helpers import child_pids, process_gone


def test_busy_processes_run_inside_the_block_and_are_gone_after_it() -> None:
    with contended(2) as pids:
        assert len(pids) == 2 and not any(process_gone(p) for p in pids)
    assert all(process_gone(p) for p in pids)
    with pytest.raises(RuntimeError), contended(1) as pids:
        raise RuntimeError("the run failed")
    assert all(process_gone(p) for p in pids)


def test_busy_processes_end_when_the_process_that_started_them_is_killed() -> None:
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from kvoffload.demo.contend import contended\nimport time\n"
            "with contended(1) as pids:\n    print(pids[0], flush=True)\n    time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert starter.stdout is not None
    pid = int(starter.stdout.readline())
    assert not process_gone(pid)
    starter.kill()  # no finally runs: the busy process notices its parent is gone
    starter.wait()
    deadline = time.monotonic() + 30
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(pid), "a busy process outlived the run that started it"


def test_contend_must_be_a_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="--contend must be an integer >= 0, got -1"), contended(-1):
        pass
    assert main(["demo", "--contend", "-1", "--no-progress"]) == 2
    assert "--contend=-1" in capsys.readouterr().err


def test_the_demo_runs_beside_busy_processes_and_leaves_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "3", "--conversations", "2", "--no-progress", "--contend", "2"]) == 0
    assert "ok:" in capsys.readouterr().out
    assert not child_pids(os.getpid(), b"1103515245"), "a busy process was left running"
