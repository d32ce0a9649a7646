"""Project gates that CI must enforce: mypy --strict on src, codegen and testing, ruff lint and format."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("src", "codegen", "testing", "tests", "benchmarks", "examples", "setup.py")


def _run(*command: str) -> None:
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _ruff() -> str:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is a dev dependency"
    return ruff


@pytest.mark.slow
def test_mypy_strict_src_codegen_and_testing() -> None:
    _run(sys.executable, "-m", "mypy", "--strict", "src", "codegen", "testing")


@pytest.mark.slow
def test_ruff_lint() -> None:
    _run(_ruff(), "check", *CHECKED)


@pytest.mark.slow
def test_ruff_format_including_generated_code() -> None:
    _run(_ruff(), "format", "--check", *CHECKED)
