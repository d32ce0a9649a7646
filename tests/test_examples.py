"""The examples/ directory: the integration example runs as documented; every snapshot runs in the demo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.demo import DemoOptions, run_demo, shrink_snapshot
from kvoffload.translate import load_snapshot, translate_snapshot

ROOT = Path(__file__).resolve().parent.parent


def test_integration_example_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "integration.py")], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "B loaded 112 tokens; finished loads: ('B',)" in proc.stdout


# -- every example snapshot runs in the demo, shrunk to fit this machine, with every reload verified --------

EXAMPLES = sorted((ROOT / "examples").glob("*.json"))

# A small workload: a system prompt of two MLA chunks (256 tokens each) and one 400-token Mamba chunk, two
# conversations, so the second turn of a conversation finds its prefix in the host pool.
SMALL = DemoOptions(
    requests=3,
    conversations=2,
    system_prompt_tokens=512,
    turn_tokens=(32, 64),
    decode_tokens=4,
    memcpy_probe_bytes=1 << 20,
)


def test_the_example_snapshots_are_the_documented_ones() -> None:
    assert [p.name for p in EXAMPLES] == [
        "deepseek-v3-mla-tp8.json",
        "gemma-swa-hybrid.json",
        "llama-3.1-8b-tp2.json",
        "mamba-hybrid.json",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_in_the_demo_shrunk_and_verified(path: Path) -> None:
    original = load_snapshot(path)
    shrunk = shrink_snapshot(original, SMALL)
    assert shrunk.changes and shrunk.changes[0].startswith(f"num_blocks {original.kv_cache_config.num_blocks} -> ")
    before, after = translate_snapshot(original), translate_snapshot(shrunk.snapshot)
    assert after.groups == before.groups and after.replicated_layout == before.replicated_layout
    assert after.parallel == before.parallel
    result = run_demo(shrunk.snapshot, SMALL, progress=False)
    assert result.ok, result
    assert result.blocks_verified > 0 and result.mismatched_blocks == []
    assert result.requests_with_hit > 0 and result.tokens_loaded > 0
    assert result.failed_jobs == 0 and result.dead_workers == []
