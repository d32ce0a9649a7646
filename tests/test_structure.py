"""The house rules the layout promises: a torch-free scheduler side, package faces respected, small modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kvoffload"
MAX_LINES = 450

# Everything an engine's scheduler process runs, end to end: translate a snapshot, build the scheduler (with a
# tier config decoded but no tier opened), plan a step, encode it for the workers, read the stats and events.
_SCHEDULER_SIDE = """
import sys
from pathlib import Path
import kvoffload
from kvoffload import wire
from kvoffload.assembly import build_scheduler
from kvoffload.offload.keys import hash_token_blocks
from kvoffload.offload.manager.policies import available_policies
from kvoffload.offload.pool import plan_host_pool_from_config
from kvoffload.tiers import TieringConfig, namespace_for, tiering_config_from_extra
from kvoffload.translate import explain_offloading_config, load_snapshot, translate_snapshot

snapshot = load_snapshot(Path(sys.argv[1]))
config = translate_snapshot(snapshot)
explain_offloading_config(snapshot.engine_config, snapshot.kv_cache_config)
tiering = tiering_config_from_extra({"secondary_tiers": [{"type": "fs", "root_dir": "/nonexistent/kvo"}]})
assert isinstance(tiering, TieringConfig) and available_policies()
namespace_for(config)
assert plan_host_pool_from_config(config).num_chunks > 0
sched = build_scheduler(config, enable_events=True)
tokens = list(range(4096))
sched.add_request("r", hash_token_blocks(tokens, config.cache.tokens_per_hash), len(tokens))
assert sched.lookup("r", 0) == 0
block_ids = [list(range(4096 // g.tokens_per_block)) for g in config.groups]
sched.on_blocks_allocated("r", block_ids)
sched.on_tokens_computed("r", len(tokens))
plan = sched.build_step_plan()
assert plan.store_jobs
wire.encode(plan)
sched.stats()
sched.take_events()
sched.close()
print(sorted(m for m in ("torch", "valkey", "zmq") if m in sys.modules))
"""


def test_the_scheduler_side_imports_no_torch_valkey_or_zmq(tmp_path: Path) -> None:
    """An engine's scheduler process (translator, manager, policies, scheduler, wire, KV events, tier configs)
    never pays for torch, the Valkey client or pyzmq."""
    example = Path(__file__).resolve().parents[1] / "examples" / "llama-3.1-8b-tp2.json"
    out = subprocess.run(
        [sys.executable, "-c", _SCHEDULER_SIDE, str(example)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return found


def _owner_of_private(module: str) -> str | None:
    """The package that owns ``module`` if it is private (``a.b._c.d`` -> ``a.b``), else None."""
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def test_no_module_imports_another_packages_private_module() -> None:
    """``pkg._mod`` is imported only from inside ``pkg`` (its own modules and subpackages): every other
    importer goes through the package's face."""
    offenders = []
    for name, path in _modules():
        for line, target in _imported(ast.parse(path.read_text())):
            if not target.startswith("kvoffload"):
                continue
            owner = _owner_of_private(target)
            if owner is not None and name != owner and not name.startswith(owner + "."):
                offenders.append(f"{path.relative_to(SRC)}:{line} imports {target}")
    assert not offenders, "\n".join(offenders)


def test_no_hand_written_module_is_over_the_size_limit() -> None:
    too_long = [
        f"{path.relative_to(SRC)}: {n} lines"
        for _, path in _modules()
        if "_generated" not in path.parts and (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not too_long, too_long


@pytest.mark.parametrize("module", ["_cascade.py", "_backpressure.py"])
def test_tiering_reaches_into_nothing(module: str) -> None:
    """Tiering is composed into the scheduler: no getattr on its objects, no silenced type errors."""
    text = (PACKAGE / "tiers" / module).read_text()
    assert "getattr(" not in text
    assert "type: ignore" not in text
