"""`kvoffload demo` from the command line: a tiny verified run, option errors, and the memory guard."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from kvoffload import ConfigError, codecs
from kvoffload._cli import main, parse_size
from kvoffload.demo import DemoOptions, default_snapshot, run_demo
from kvoffload.demo.workload import BlockPool
from tests.helpers import child_pids, process_gone, with_default_sigint

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
            workers = child_pids(proc.pid, b"spawn_main")
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
    assert all(process_gone(pid) for pid in workers)
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


# ------------------------------------------------------------------------------------------------------------
# issue 22: flags and snapshots that used to hang, exhaust memory or end in a traceback: refused up front
# ------------------------------------------------------------------------------------------------------------

_NINES = "9" * 400


def _one_error_line(err: str, fragment: str) -> None:
    assert "Traceback" not in err, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert fragment in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        # spun silently: the up-front workload check replayed every request
        (["--requests", str(2**70)], "--requests=1180591620717411303424 must be in [1, 10000]"),
        # grew memory until OOM: every conversation keeps its history
        (["--conversations", "1000000000"], "--conversations=1000000000 must be in [1, 10000]"),
        # OverflowError from time.sleep(inf), after the whole run
        (
            ["--metrics-port", "0", "--metrics-linger", "inf"],
            "--metrics-linger=inf must be a number of seconds in [0, ",
        ),
        # silently ignored
        (
            ["--metrics-port", "0", "--metrics-linger", "nan"],
            "--metrics-linger=nan must be a number of seconds in [0, ",
        ),
        (["--worker-timeout", "inf"], "--worker-timeout=inf must be a number of seconds in (0, 1000000000)"),
        (["--start-timeout", "0"], "--start-timeout=0.0 must be a number of seconds in (0, 1000000000)"),
        # ZMQ bound port 99999 modulo 65536 (34463), where nobody listens
        (
            ["--kv-events", "tcp://127.0.0.1:99999"],
            "--kv-events='tcp://127.0.0.1:99999': port '99999' must be from 1 to 65535 (or * for any free port)",
        ),
        (["--kv-events", "tcp://127.0.0.1:0"], "--kv-events='tcp://127.0.0.1:0': port '0' must be from 1 to 65535"),
        (["--kv-events", "tcp://127.0.0.1"], "--kv-events='tcp://127.0.0.1' needs a host and a port"),
    ],
    ids=[
        "requests-2**70",
        "conversations-1e9",
        "linger-inf",
        "linger-nan",
        "timeout-inf",
        "start-timeout-0",
        "port-99999",
        "port-0",
        "no-port",
    ],
)
def test_demo_flag_out_of_bounds_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    status = main(["demo", "--no-progress", *argv])
    out, err = capsys.readouterr()
    assert (status, out) == (2, "")
    _one_error_line(err, fragment)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        # OverflowError from int(float("9" * 400))
        (
            _NINES,
            "argument --cpu-bytes: '999999999999999999999999'... (400 characters) is more than 9223372036854775807",
        ),
        # used to become 0 bytes and then "must be specified"
        ("0.5", "argument --cpu-bytes: '0.5' is 0 bytes: it must be from 1 to 9223372036854775807 bytes"),
    ],
)
def test_cpu_bytes_out_of_bounds_is_one_usage_error(
    capsys: pytest.CaptureFixture[str], value: str, fragment: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--cpu-bytes", value, "--no-progress"])
    out, err = capsys.readouterr()
    assert (exit_info.value.code, out) == (2, "")
    _one_error_line(err, fragment)
    assert "parse_size" not in err


@pytest.mark.parametrize(
    ("text", "value"),
    [("0.1MiB", 104857), ("1." + "0" * 5000 + "1KiB", 1024), ("0" * 5000 + "1", 1), ("9223372036854775807", 2**63 - 1)],
)
def test_parse_size_is_exact(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_parse_size_is_bounded() -> None:
    with pytest.raises(ConfigError, match=r"^--cpu-bytes='9223372036854775808' is more than 9223372036854775807 "):
        parse_size(str(2**63))
    with pytest.raises(ConfigError, match=r"^--max-bytes='8388608TiB' is more than 9223372036854775807 "):
        parse_size("8388608TiB", "--max-bytes")


@pytest.mark.timeout(60)
def test_snapshot_with_2_40_blocks_is_refused_before_building_a_block_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It used to pass every check and be OOM-killed at 24 GB building the engine's block pool."""
    snapshot = default_snapshot(workers=2)
    kv = msgspec.structs.replace(snapshot.kv_cache_config, num_blocks=2**40)
    path = tmp_path / "huge.json"
    path.write_bytes(codecs.encode(msgspec.structs.replace(snapshot, kv_cache_config=kv), format="json"))
    for shrink in ([], ["--shrink"]):
        status = main(["demo", "--snapshot", str(path), "--no-progress", *shrink])
        out, err = capsys.readouterr()
        assert (status, out) == (2, ""), shrink
        _one_error_line(err, "beyond kv_cache_tensors[0].size=33554432 (num_blocks=1099511627776)")


@pytest.mark.timeout(60)
def test_run_demo_bounds_its_options() -> None:
    with pytest.raises(ConfigError, match=r"^requests=1180591620717411303424 must be in \[1, 10000\]$"):
        run_demo(default_snapshot(), DemoOptions(requests=2**70), progress=False)
    with pytest.raises(ConfigError, match=r"^conversations=1000000000 must be in \[1, 10000\]$"):
        run_demo(default_snapshot(), DemoOptions(conversations=10**9), progress=False)


@pytest.mark.timeout(10)
def test_block_pool_holds_only_the_blocks_in_use() -> None:
    huge = BlockPool(2**40)  # a list of 2**40 free ids would need 8 TiB
    assert huge.num_free == 2**40 and huge.allocate(3) == [0, 1, 2] and huge.num_free == 2**40 - 3
    # Never-used ids first, in order, then the released ones, first released first (as the id queue did).
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.release([2, 0])
    assert pool.allocate(5) is None and pool.num_free == 3
    assert pool.allocate(2) == [3, 2]
    pool.release([3])
    assert pool.allocate(2) == [0, 3] and pool.allocate(1) is None


@pytest.mark.slow
def test_kv_events_prints_the_bound_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        ["demo", "--requests", "2", "--conversations", "1", "--no-progress", "--kv-events", "tcp://127.0.0.1:*"]
    )
    out, err = capsys.readouterr()
    assert status == 0, err
    match = re.search(r"^publishing KV events at tcp://127\.0\.0\.1:(\d+)$", err, re.MULTILINE)
    assert match and 1 <= int(match.group(1)) <= 65535, err
    assert "kv events: " in out and "ok:" in out


def test_prompts_longer_than_the_step_budget_are_computed_over_several_steps_and_verify() -> None:
    # The simulated engine has vLLM's per-step token budget (chunked prefill): a recomputed prompt costs steps.
    small = run_demo(default_snapshot(), DemoOptions(requests=6, max_batched_tokens=64), progress=False)
    large = run_demo(default_snapshot(), DemoOptions(requests=6, max_batched_tokens=1 << 16), progress=False)
    assert small.ok and large.ok and small.blocks_verified > 0
    assert small.prompt_tokens == large.prompt_tokens
    # the 512-token system prompt alone needs at least 8 steps at 64 tokens a step
    assert small.steps > large.steps + 8
    with pytest.raises(ConfigError, match="max_batched_tokens"):
        run_demo(default_snapshot(), DemoOptions(max_batched_tokens=0), progress=False)
