"""`kvoffload demo --tier ...`: a second run on the same directory starts with hits from disk; Valkey too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvoffload._cli import main


def _value(out: str, label: str) -> str:
    match = re.search(rf"{re.escape(label)}\s*│\s*([^│]+?)\s*│", out)
    assert match is not None, f"no row {label!r} in:\n{out}"
    return match.group(1)


@pytest.mark.slow
def test_disk_demo_twice_second_run_hits_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--requests", "3", "--conversations", "3", "--no-progress", "--tier", f"disk:{tmp_path / 'kv'}"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert _value(first, "tier 0 (fs): prompt tokens promoted") == "0"
    assert int(_value(first, "tier 0 (fs): chunks cascaded / dropped / failed").split(" / ")[0]) > 0
    assert main(args) == 0
    second = capsys.readouterr().out
    # three fresh conversations: without the disk nothing could hit; with it, the system prompt and turns do
    assert int(_value(second, "tier 0 (fs): prompt tokens promoted")) > 0
    assert _value(second, "prefix-hit rate (requests)") == "100.0%"
    assert _value(second, "mismatched blocks") == "0" and "ok:" in second


@pytest.mark.slow
def test_demo_with_embedded_valkey(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "3", "--conversations", "2", "--no-progress", "--tier", "valkey"]) == 0
    out = capsys.readouterr().out
    assert int(_value(out, "tier 0 (valkey): chunks cascaded / dropped / failed").split(" / ")[0]) > 0
    assert "ok:" in out


def test_bad_tier_option_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tier", "s3://bucket", "--no-progress"]) == 2
    assert "--tier='s3://bucket'" in capsys.readouterr().err
