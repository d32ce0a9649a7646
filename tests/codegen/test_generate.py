"""Generation is deterministic, committed output is current, and --check catches stale output."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codegen import load_schema, render
from codegen.cli import generate

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "schema" / "kvoffload.toml"
GENERATED = ROOT / "src" / "kvoffload" / "_generated"


def test_check_passes_on_committed_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "codegen", "--check"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_generation_is_byte_identical_twice(tmp_path: Path) -> None:
    first = render(load_schema(SCHEMA))
    second = render(load_schema(SCHEMA))
    assert first == second
    assert generate(SCHEMA, tmp_path / "a", check=False) == 0
    assert generate(SCHEMA, tmp_path / "b", check=False) == 0
    for name in first:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_text() == (GENERATED / name).read_text()


def test_check_catches_unregenerated_schema_edit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "generated"
    shutil.copytree(GENERATED, out, ignore=shutil.ignore_patterns("__pycache__"))
    edited = tmp_path / "schema.toml"
    edited.write_text(
        SCHEMA.read_text().replace(
            '{ name = "non_causal", type = "bool", default = false, doc = "Non-causal attention." },',
            '{ name = "non_causal", type = "bool", default = false, doc = "Non-causal attention." },\n'
            '  { name = "extra_flag", type = "bool", default = false, doc = "New." },',
        )
    )
    assert generate(edited, out, check=True) == 1
    err = capsys.readouterr().err
    assert "types.py" in err and "stale" in err
    # A doc-only edit changes the text but not the fingerprint.
    doc_only = tmp_path / "doc.toml"
    doc_only.write_text(SCHEMA.read_text().replace("Non-causal attention.", "Non-causal attention!"))
    assert load_schema(doc_only).fingerprint == load_schema(SCHEMA).fingerprint
    assert load_schema(edited).fingerprint != load_schema(SCHEMA).fingerprint


def test_check_flags_stray_files(tmp_path: Path) -> None:
    out = tmp_path / "generated"
    shutil.copytree(GENERATED, out, ignore=shutil.ignore_patterns("__pycache__"))
    (out / "stray.py").write_text("x = 1\n")
    assert generate(SCHEMA, out, check=True) == 1


def test_generated_code_has_no_type_ignore_and_a_header() -> None:
    for path in GENERATED.glob("*.py"):
        text = path.read_text()
        assert "type: ignore" not in text, path
        assert text.startswith('"""@generated'), path
        assert max(len(line) for line in text.splitlines()) <= 120, path


def test_gc_option_renders_and_leaves_the_fingerprint_alone(tmp_path: Path) -> None:
    schema = load_schema(SCHEMA)
    assert not schema.structs["StepPlan"].gc and schema.structs["EngineSnapshot"].gc
    without = tmp_path / "no_gc.toml"
    without.write_text(SCHEMA.read_text().replace("gc = false\n", ""))
    assert load_schema(without).fingerprint == schema.fingerprint
    from kvoffload import StepPlan

    assert StepPlan.__struct_config__.gc is False
