"""Running one scenario of ``vllm_scenarios.py`` in a fresh process, as the real-engine tests do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")
ROOT = Path(__file__).resolve().parents[2]


def run_script(
    script: Path, *args: str | Path, multiprocess: bool = False, timeout: float = 600, **env_extra: str
) -> dict[str, Any]:
    """Run a real-engine ``script`` with ``args`` in a fresh process (offline; vLLM's in-process engine unless
    ``multiprocess``) and return the JSON of its last ``RESULT`` line; fails with its stderr if it has none."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING", **env_extra)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{script.name} {args[0] if args else ''} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def run_scenario(
    scenario: str, model: Path, out: Path, *, multiprocess: bool = False, timeout: float = 600, **env_extra: str
) -> dict[str, Any]:
    """Run ``scenario`` of ``vllm_scenarios.py`` on ``model`` (see :func:`run_script`); its RESULT."""
    return run_script(SCENARIOS, scenario, model, out, multiprocess=multiprocess, timeout=timeout, **env_extra)
