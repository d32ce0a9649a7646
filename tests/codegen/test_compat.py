"""`python -m codegen compat`: every rule fires on a minimal OLD/NEW pair; the real history passes."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from codegen.compat import RULES, Finding, compare, main
from codegen.loader import Schema, load_schema

ROOT = Path(__file__).resolve().parents[2]
CURRENT = ROOT / "schema" / "kvoffload.toml"
HISTORY = sorted((ROOT / "schema" / "history").glob("*.toml"))

BASE = """\
[schema]
name = "t"
version = "1.1"

[enum.Color]
values = ["red", "green"]
aliases = { crimson = "red" }

[struct.Cfg]
fields = [
  { name = "a", type = "int", ge = 0 },
  { name = "b", type = "str", default = "x" },
  { name = "c", type = "list<int>", max_length = 4, default = "empty" },
  { name = "d", type = "bool", default = false, since = "1.1" },
]

[struct.Msg]
kind = "message"
layout = "array"
message_id = 1
fields = [
  { name = "x", type = "int" },
  { name = "y", type = "str" },
  { name = "z", type = "int", default = 0 },
]

[union.U]
tag_field = "type"

[struct.A]
kind = "message"
union = "U"
tag = "a"
fields = [{ name = "v", type = "int", default = 0 }]

[struct.B]
kind = "message"
union = "U"
tag = "b"
fields = [{ name = "w", type = "int", default = 0 }]

[struct.Extra]
fields = [{ name = "q", type = "int", default = 0 }]

[struct.Root]
root = true
fields = [{ name = "cfg", type = "Cfg" }, { name = "u", type = "U?", default = "none" }]
"""

NEXT = BASE.replace('version = "1.1"', 'version = "1.2"')


def edit(old: str, new: str, text: str = NEXT) -> str:
    if old not in text:
        raise AssertionError(f"{old!r} not in the base schema")
    return text.replace(old, new, 1)


def load(tmp_path: Path, name: str, text: str) -> Schema:
    path = tmp_path / name
    path.write_text(text)
    return load_schema(path)


def findings(tmp_path: Path, new_text: str, old_text: str = BASE) -> list[Finding]:
    return compare(load(tmp_path, "old.toml", old_text), load(tmp_path, "new.toml", new_text))


A_LINE = '  { name = "a", type = "int", ge = 0 },'
B_LINE = '  { name = "b", type = "str", default = "x" },'
C_LINE = '  { name = "c", type = "list<int>", max_length = 4, default = "empty" },'
D_LINE = '  { name = "d", type = "bool", default = false, since = "1.1" },'
X_LINE = '  { name = "x", type = "int" },'
Y_LINE = '  { name = "y", type = "str" },'
Z_LINE = '  { name = "z", type = "int", default = 0 },'

# rule id -> (new schema text, expected "Type.field" of the first finding)
CASES: dict[str, tuple[str, str]] = {
    "MAJOR_VERSION_CHANGED": (BASE.replace('version = "1.1"', 'version = "2.0"'), "schema"),
    "VERSION_NOT_INCREASED": (edit('"red", "green"]', '"red", "green", "blue"]', BASE), "schema"),
    "SCHEMA_NAME_CHANGED": (edit('name = "t"', 'name = "t2"'), "schema"),
    "TYPE_REMOVED": (
        edit('[struct.Extra]\nfields = [{ name = "q", type = "int", default = 0 }]\n', ""),
        "Extra",
    ),
    "TYPE_KIND_CHANGED": (
        edit(
            '[struct.Extra]\nfields = [{ name = "q", type = "int", default = 0 }]',
            '[enum.Extra]\nvalues = ["q"]',
        ),
        "Extra",
    ),
    "TYPE_ADDED_WITHOUT_SINCE": (NEXT + '\n[enum.Size]\nvalues = ["s"]\n', "Size"),
    "STRUCT_KIND_CHANGED": (edit("[struct.Cfg]\n", '[struct.Cfg]\nkind = "message"\n'), "Cfg"),
    "STRUCT_LAYOUT_CHANGED": (edit("[struct.Cfg]\n", '[struct.Cfg]\nlayout = "array"\n'), "Cfg"),
    "STRUCT_MADE_ABSTRACT": (edit("[struct.Extra]\n", "[struct.Extra]\nabstract = true\n"), "Extra"),
    "ROOT_REMOVED": (edit("root = true\n", ""), "Root"),
    "MESSAGE_ID_CHANGED": (edit("message_id = 1", "message_id = 2"), "Msg"),
    "MESSAGE_ID_REMOVED": (edit("message_id = 1\n", ""), "Msg"),
    "FIELD_REMOVED": (edit(B_LINE + "\n", ""), "Cfg.b"),
    "FIELD_TYPE_CHANGED": (edit(A_LINE, '  { name = "a", type = "str" },'), "Cfg.a"),
    "FIELD_POSITION_CHANGED": (edit(X_LINE + "\n" + Y_LINE, Y_LINE + "\n" + X_LINE), "Msg.x"),
    "FIELD_RENAMED": (edit(Y_LINE, '  { name = "why", type = "str" },'), "Msg.y"),
    "FIELD_ADDED_WITHOUT_SINCE": (
        edit(D_LINE, D_LINE + '\n  { name = "e", type = "int", default = 1 },'),
        "Cfg.e",
    ),
    "FIELD_SINCE_CHANGED": (edit(D_LINE, D_LINE.replace('"1.1"', '"1.2"')), "Cfg.d"),
    "FIELD_REQUIRED_ADDED": (edit(B_LINE, '  { name = "b", type = "str" },'), "Cfg.b"),
    "FIELD_DEFAULT_CHANGED": (edit(B_LINE, B_LINE.replace('"x"', '"y"')), "Cfg.b"),
    "FIELD_CONSTRAINT_TIGHTENED": (edit(A_LINE, A_LINE.replace("ge = 0", "ge = 1")), "Cfg.a"),
    "ENUM_VALUE_REMOVED": (edit('values = ["red", "green"]', 'values = ["red"]'), "Color.green"),
    "ENUM_VALUE_RENAMED": (edit('values = ["red", "green"]', 'values = ["red", "verde"]'), "Color.green"),
    "ENUM_ALIAS_REMOVED": (edit('aliases = { crimson = "red" }\n', ""), "Color.crimson"),
    "UNION_TAG_FIELD_CHANGED": (edit('tag_field = "type"', 'tag_field = "kind"'), "U"),
    "UNION_TAG_CHANGED": (edit('tag = "a"', 'tag = "aa"'), "A"),
    "UNION_MEMBER_REMOVED": (edit('union = "U"\ntag = "b"\n', ""), "U"),
}


def test_every_rule_has_a_case() -> None:
    assert set(CASES) | {"FIELD_ADDED_WITHOUT_DEFAULT"} == set(RULES)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_fires_alone(tmp_path: Path, rule: str) -> None:
    new_text, where = CASES[rule]
    found = findings(tmp_path, new_text)
    assert {f.rule for f in found} == {rule}, [f.format() for f in found]
    first = found[0]
    assert (f"{first.type_name}.{first.field}" if first.field else first.type_name) == where
    assert first.category == RULES[rule].category
    assert first.format().startswith(f"{rule} {where}: [{first.category}] ")
    assert first.line > 0


def test_field_added_without_default_or_since(tmp_path: Path) -> None:
    # The loader already refuses `since` without a default, so a bare new field breaks both rules.
    found = findings(tmp_path, edit(D_LINE, D_LINE + '\n  { name = "e", type = "int" },'))
    assert sorted(f.rule for f in found) == ["FIELD_ADDED_WITHOUT_DEFAULT", "FIELD_ADDED_WITHOUT_SINCE"]
    assert {f.category for f in found} == {"WIRE", "API"}


def test_since_not_newer_than_old_version(tmp_path: Path) -> None:
    found = findings(tmp_path, edit(D_LINE, D_LINE + '\n  { name = "e", type = "int", default = 1, since = "1.1" },'))
    assert [f.rule for f in found] == ["FIELD_ADDED_WITHOUT_SINCE"]
    assert "since '1.1', but 1.1 does not have it" in found[0].message


def test_version_decrease(tmp_path: Path) -> None:
    found = findings(tmp_path, BASE, old_text=NEXT)
    assert [f.rule for f in found] == ["VERSION_NOT_INCREASED"]
    assert "1.1 is older than 1.2" in found[0].message


def test_array_field_inserted_before_existing_ones(tmp_path: Path) -> None:
    new = edit(Z_LINE, '  { name = "n", type = "int", default = 0, since = "1.2" },\n' + Z_LINE)
    found = findings(tmp_path, new)
    assert {(f.rule, f.field) for f in found} == {
        ("FIELD_POSITION_CHANGED", "n"),
        ("FIELD_POSITION_CHANGED", "z"),
    }


def test_array_field_removed_without_tombstone(tmp_path: Path) -> None:
    found = findings(tmp_path, edit(Z_LINE + "\n", ""))
    assert [(f.rule, f.field) for f in found] == [("FIELD_REMOVED", "z")]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (C_LINE, C_LINE.replace("max_length = 4", "max_length = 2")),
        (C_LINE, C_LINE.replace("max_length = 4", "max_length = 4, min_length = 1")),
        (A_LINE, A_LINE.replace("ge = 0", "ge = 0, le = 10")),
        (A_LINE, A_LINE.replace("ge = 0", "gt = 0")),
    ],
)
def test_constraint_tightening_variants(tmp_path: Path, old: str, new: str) -> None:
    assert [f.rule for f in findings(tmp_path, edit(old, new))] == ["FIELD_CONSTRAINT_TIGHTENED"]


@pytest.mark.parametrize(
    "change",
    [
        lambda t: edit(A_LINE, '  { name = "a", type = "int" },', t),  # constraint loosened
        lambda t: edit(A_LINE, A_LINE.replace("ge = 0", "gt = -1"), t),  # same bound for ints
        lambda t: edit(C_LINE, C_LINE.replace("max_length = 4", "max_length = 8"), t),
        lambda t: edit('"red", "green"]', '"red", "green", "blue"]', t),  # enum value added
        lambda t: edit(D_LINE, D_LINE + '\n  { name = "e", type = "int", default = 1, since = "1.2" },', t),
        lambda t: edit(Z_LINE, Z_LINE + '\n  { name = "n", type = "int", default = 0, since = "1.2" },', t),
        lambda t: edit(B_LINE, '  { name = "b", type = "str", default = "x", removed = "1.2" },', t),  # tombstone
        lambda t: edit(Y_LINE, '  { name = "y", type = "str", default = "", removed = "1.2" },', t).replace(
            X_LINE, '  { name = "x", type = "int", default = 0 },'
        ),  # array-layout tombstone keeps the position
        lambda t: t + '\n[struct.C]\nsince = "1.2"\nkind = "message"\nunion = "U"\ntag = "c"\nfields = []\n',
        lambda t: t + '\n[enum.Size]\nsince = "1.2"\nvalues = ["s"]\n',
        lambda t: edit("[struct.Msg]\n", '[struct.Msg]\ndoc = "Docs never break anything."\n', t),
    ],
)
def test_compatible_changes_pass(tmp_path: Path, change: Callable[[str], str]) -> None:
    found = findings(tmp_path, change(NEXT))
    assert found == [], [f.format() for f in found]


def test_identical_schema_passes(tmp_path: Path) -> None:
    assert findings(tmp_path, BASE) == []


def test_locations_point_at_the_new_file_and_line(tmp_path: Path) -> None:
    new_text = edit(A_LINE, '  { name = "a", type = "str" },')
    (finding,) = findings(tmp_path, new_text)
    line = new_text.splitlines().index('  { name = "a", type = "str" },') + 1
    assert finding.file.endswith("new.toml") and finding.line == line
    assert finding.format().endswith(f"new.toml:{line})")
    (removed,) = findings(tmp_path, edit('[struct.Extra]\nfields = [{ name = "q", type = "int", default = 0 }]\n', ""))
    assert removed.file.endswith("old.toml") and removed.line == BASE.splitlines().index("[struct.Extra]") + 1


# -- the real history ----------------------------------------------------------------------------------


def test_history_holds_every_released_version() -> None:
    assert [p.stem for p in HISTORY] == ["1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7", "1.8", "1.9"]


@pytest.mark.parametrize("path", HISTORY, ids=lambda p: p.stem)
def test_current_schema_is_compatible_with_history(path: Path) -> None:
    old, new = load_schema(path), load_schema(CURRENT)
    if old.major == new.major:
        assert compare(old, new) == []


def test_history_chain_is_compatible() -> None:
    schemas = [load_schema(p) for p in HISTORY]
    for old, new in itertools.pairwise(schemas):
        assert compare(old, new) == [], f"{old.version} -> {new.version}"


def test_history_versions_match_file_names() -> None:
    for path in HISTORY:
        assert load_schema(path).version == path.stem


# -- command line --------------------------------------------------------------------------------------


def test_main_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(HISTORY[0]), str(CURRENT)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and "compatible" in out


def test_main_reports_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "old.toml").write_text(BASE)
    (tmp_path / "new.toml").write_text(edit(B_LINE + "\n", "", edit(A_LINE, '  { name = "a", type = "str" },')))
    assert main([str(tmp_path / "old.toml"), str(tmp_path / "new.toml")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FIELD_REMOVED Cfg.b: [WIRE] field removed without a tombstone")
    assert lines[1].startswith("FIELD_TYPE_CHANGED Cfg.a: [WIRE] type int -> str (")
    assert lines[-1] == "2 breaking change(s) from 1.1 to 1.2 (2 WIRE, 0 API)"


def test_main_exits_2_on_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().out
    (tmp_path / "bad.toml").write_text("[schema]\nname = 't'\n")
    assert main([str(tmp_path / "bad.toml"), str(CURRENT)]) == 2
    assert "error:" in capsys.readouterr().out


def test_cli_subprocess_exit_codes(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "codegen", "compat", "schema/history/1.1.toml", "schema/kvoffload.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    backwards = subprocess.run(
        [sys.executable, "-m", "codegen", "compat", "schema/kvoffload.toml", "schema/history/1.0.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert backwards.returncode == 1
    assert "TYPE_REMOVED StepPlan: [WIRE] struct removed (schema/kvoffload.toml:" in backwards.stdout
