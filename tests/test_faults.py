"""kvoffload.faults: off by default, a plan from the environment or a file that can change between rounds, and
bad plans refused with the field and value named."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.faults import FAULTS_ENV, FaultPlan, Faults, active_faults


def test_no_plan_means_no_faults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert active_faults() is None
    monkeypatch.setenv(FAULTS_ENV, f"@{tmp_path / 'absent.json'}")
    assert active_faults() is None, "a plan file that does not exist turns nothing on"


def test_a_plan_file_is_read_again_when_it_changes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    monkeypatch.setenv(FAULTS_ENV, f"@{plan}")
    plan.write_text('{"host_load": 1.0}')
    first = active_faults()
    assert first is not None and first.plan.host_load == 1.0 and first.fail_host_load()
    assert active_faults() is first, "the same version of the file is the same instance"
    time.sleep(0.01)
    plan.write_text('{"host_load": 0.0, "seed": 3}')
    os.utime(plan, ns=(time.time_ns(), time.time_ns() + 10_000_000))
    second = active_faults()
    assert second is not None and second is not first and not second.fail_host_load()
    plan.unlink()
    assert active_faults() is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"tier_record": 1.5}', "tier_record must be a probability in [0, 1], got 1.5"),
        ('{"host_load": -0.1}', "host_load must be a probability in [0, 1], got -0.1"),
        ('{"signal_name": "SIGNOPE"}', "signal_name 'SIGNOPE' is not a signal name"),
        ('{"tier_recordz": 0.1}', "tier_recordz"),
        ("not json", "is not a JSON fault plan"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_field_and_value(
    monkeypatch: pytest.MonkeyPatch, text: str, message: str
) -> None:
    monkeypatch.setenv(FAULTS_ENV, text)
    with pytest.raises(ConfigError, match=FAULTS_ENV) as info:
        active_faults()
    assert message in str(info.value)


def test_damaged_reads_scribble_their_rows_and_every_fault_is_logged(tmp_path: Path) -> None:
    log = tmp_path / "faults.log"
    faults = Faults(FaultPlan(tier_record=1.0, tier_delete=1.0, log=str(log)))
    rows = [memoryview(bytearray(b"\xaa" * 128)) for _ in range(3)]
    picked = faults.damaged_records(rows, [True, False, True])
    assert picked == [0, 2], "only records that were read can be damaged"
    assert bytes(rows[0][:64]) == bytes(range(64)) and bytes(rows[1]) == b"\xaa" * 128
    assert faults.before_tier_load(5) == [0, 2, 4]
    assert faults.injected == {"tier_record": 2, "tier_delete": 3}
    assert log.read_text().splitlines() == ["tier_record 2", "tier_delete 3"]
