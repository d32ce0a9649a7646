"""`kvoffload demo --tier ...`: a second run on the same directory starts with hits from disk; Valkey too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvoffload._cli import main
from kvoffload.demo.report import format_bytes


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
    records, held = _value(first, "tier 0 (fs): holds (records, bytes)").split(" / ")
    files = list((tmp_path / "kv").rglob("*.bin"))
    assert int(records) == len(files) > 0, "every record the workers' disk tier holds, as the disk has them"
    assert held == format_bytes(sum(f.stat().st_size for f in files))
    assert main(args) == 0
    second = capsys.readouterr().out
    # three fresh conversations: without the disk nothing could hit; with it, the system prompt and turns do
    assert int(_value(second, "tier 0 (fs): prompt tokens promoted")) > 0
    assert _value(second, "prefix-hit rate (requests)") == "100.0%"
    assert _value(second, "mismatched blocks") == "0" and "ok:" in second
    _assert_vs_raw(first, "tier 0 (fs)")


def _assert_vs_raw(out: str, tier: str) -> None:
    """The tier and its raw baseline were both measured on the run's records (shares, not dashes)."""
    figures = _value(out, f"{tier}: tier / raw GB/s, same records")
    assert re.fullmatch(r"[0-9.]+ / [0-9.]+ w, [0-9.]+ / [0-9.]+ r", figures), figures
    shares = _value(out, f"{tier}: write / read vs raw")
    assert re.fullmatch(r"[0-9]+% / [0-9]+%", shares), shares
    assert all(int(p.rstrip("%")) > 0 for p in shares.split(" / "))
    in_run = _value(out, f"{tier}: write / read GB/s in the run")
    assert re.fullmatch(r"[0-9.]+ / [-0-9.]+", in_run), in_run  # the first run reads nothing back ("-")


@pytest.mark.slow
def test_demo_with_embedded_valkey(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "3", "--conversations", "2", "--no-progress", "--tier", "valkey"]) == 0
    out = capsys.readouterr().out
    assert int(_value(out, "tier 0 (valkey): chunks cascaded / dropped / failed").split(" / ")[0]) > 0
    assert "ok:" in out
    _assert_vs_raw(out, "tier 0 (valkey)")


def test_bad_tier_option_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tier", "s3://bucket", "--no-progress"]) == 2
    assert "--tier='s3://bucket'" in capsys.readouterr().err


@pytest.mark.slow
def test_damaged_disk_records_are_tier_misses_not_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second run over records with a flipped byte: the promotions reading them fail, the loads chained to them
    recompute and are counted as misses, and the run verifies and exits 0 (it exited 1: "1 failed jobs")."""
    args = ["demo", "--requests", "3", "--conversations", "3", "--no-progress", "--tier", f"disk:{tmp_path / 'kv'}"]
    assert main(args) == 0
    capsys.readouterr()
    records = sorted((tmp_path / "kv").rglob("*.bin"))
    assert records
    for record in records[::3]:
        data = bytearray(record.read_bytes())
        data[len(data) // 2] ^= 0x40
        record.write_bytes(bytes(data))
    assert main(args) == 0
    out = capsys.readouterr().out
    assert _value(out, "mismatched blocks") == "0" and "ok:" in out
    assert _value(out, "failed jobs / dead workers") == "0 / 0"
    assert int(_value(out, "loads missed on a tier (recomputed)")) > 0, out
    # as vLLM does, each request whose load missed was freed and admitted again
    assert int(_value(out, "requests admitted again after a failed load")) > 0, out
