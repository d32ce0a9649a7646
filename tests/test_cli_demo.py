"""`kvoffload demo` from the command line: a tiny verified run, option errors, and the memory guard."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.cli import main, parse_size

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
