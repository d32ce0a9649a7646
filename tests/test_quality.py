"""Project gates that CI must enforce: mypy --strict on src and codegen, ruff lint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mypy_strict_src_and_codegen() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "src", "codegen"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_ruff_lint() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is a dev dependency"
    proc = subprocess.run(
        [ruff, "check", "src", "codegen", "tests", "benchmarks", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_ruff_format_including_generated_code() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is a dev dependency"
    proc = subprocess.run(
        [ruff, "format", "--check", "src", "codegen", "tests", "benchmarks", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
