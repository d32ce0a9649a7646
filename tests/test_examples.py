"""The integration example in examples/ runs as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_integration_example_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "integration.py")], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "B loaded 112 tokens; finished loads: ('B',)" in proc.stdout
