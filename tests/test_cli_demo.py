"""`kvoffload demo` from the command line: a tiny verified run, option errors, and the memory guard."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvoffload._cli import main, parse_size
from tests.helpers import with_default_sigint

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_runs_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["demo", "--requests", "3", "--conversations", "2", "--no-progress", "--policy", "arc"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "reloaded blocks verified byte for byte" in out
    assert "mismatched blocks" in out and "ok:" in out


def test_real_size_snapshot_is_refused_before_spawning(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["demo", "--snapshot", str(ROOT / "examples" / "llama-3.1-8b-tp2.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith("error: HostMemoryError:") and "GiB of KV memory" in err


def test_demo_option_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "0"]) == 2
    assert "--requests=0" in capsys.readouterr().err
    assert main(["demo", "--workers", "3", "--no-progress"]) == 2
    assert "workers=3" in capsys.readouterr().err
    snapshot = str(ROOT / "examples" / "deepseek-v3-mla-tp8.json")
    assert main(["demo", "--snapshot", snapshot, "--workers", "2"]) == 2
    assert "world_size=8" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "value"), [("4096", 4096), ("256MiB", 256 << 20), ("1G", 10**9), ("1.5GiB", 3 << 29), ("64kb", 64000)]
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_workload_that_can_never_fit_is_refused_up_front(capsys: pytest.CaptureFixture[str]) -> None:
    # One conversation of 20 turns outgrows the 256-block engine pool: it used to livelock for 100,000 steps.
    status = main(["demo", "--conversations", "1", "--requests", "20", "--no-progress"])
    out, err = capsys.readouterr()
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("error: the workload cannot run")
    assert "num_blocks=256" in err and "285 engine blocks" in err


def test_worker_timeout_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--worker-timeout", "0", "--no-progress"]) == 2
    assert "--worker-timeout=0.0 must be" in capsys.readouterr().err


def _workers(pid: int) -> set[int]:
    """The spawned worker processes of ``pid`` (not multiprocessing's resource tracker)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.add(int(child))
            except OSError:
                continue
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C does, in the middle of a run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = "import sys; from kvoffload._cli import main; sys.exit(main())"
    argv = ["demo", "--requests", "5000", "--conversations", "2000", "--shared-pool", "--no-progress"]
    proc = subprocess.Popen(
        with_default_sigint([sys.executable, "-c", code, *argv]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            workers = _workers(proc.pid)
            time.sleep(0.05)
        assert len(workers) == 2, "the demo did not start its workers"
        time.sleep(2.0)  # let it get into its steps (what is asserted below holds at any moment)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err == "error: interrupted\n"
    assert all(_gone(pid) for pid in workers)
    assert not list(Path("/dev/shm").glob(f"kvoffload_*.pid{proc.pid}.mmap"))


@pytest.mark.slow
def test_shrink_runs_a_real_size_example_and_says_what_it_changed(capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = str(ROOT / "examples" / "mamba-hybrid.json")
    assert main(["demo", "--snapshot", snapshot, "--no-progress"]) == 1
    assert "kvoffload demo --shrink" in capsys.readouterr().err
    status = main(
        ["demo", "--snapshot", snapshot, "--shrink", "--requests", "3", "--conversations", "2", "--no-progress"]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    first = out.splitlines()[0]
    assert first.startswith(f"shrunk {snapshot} to fit this machine: num_blocks 16000 -> "), first
    assert "cpu pool 32 GiB -> " in first and "world_size 1, groups and layout kept" in first
    assert re.search(r"mismatched blocks\s*│\s*0\s*│", out) and "ok:" in out
