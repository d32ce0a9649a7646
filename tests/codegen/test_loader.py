"""The schema loader rejects broken schemas with a SchemaError naming file, type and field."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from codegen import SchemaError, load_schema, load_schema_text
from codegen.typeref import TypeSyntaxError, parse_type

ROOT = Path(__file__).resolve().parents[2]

HEADER = '[schema]\nname = "t"\nversion = "1.1"\n'


def schema(body: str) -> str:
    return HEADER + textwrap.dedent(body)


def load_error(body: str) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        load_schema_text(schema(body), file="bad.toml")
    assert "bad.toml" in str(info.value)
    return info.value


def test_real_schema_loads() -> None:
    loaded = load_schema(ROOT / "schema" / "kvoffload.toml")
    assert loaded.version.count(".") == 1
    assert "EngineSnapshot" in loaded.structs
    assert loaded.unions["KVCacheSpec"].members[0] == "FullAttentionSpec"
    # Bases come before the structs that extend them.
    order = list(loaded.structs)
    assert order.index("AttentionSpec") < order.index("FullAttentionSpec") < order.index("MLAAttentionSpec")


def test_unknown_key_in_field_names_type_and_field() -> None:
    err = load_error(
        """
        [struct.A]
        fields = [ { name = "x", type = "int", dfault = 1 } ]
        """
    )
    assert err.type_name == "A" and err.field == "x"
    assert "dfault" in str(err)


def test_unknown_key_in_struct() -> None:
    err = load_error(
        """
        [struct.A]
        layuot = "array"
        """
    )
    assert err.type_name == "A" and "layuot" in str(err)


def test_unknown_type_reference() -> None:
    err = load_error(
        """
        [struct.A]
        fields = [ { name = "x", type = "list<Missing>" } ]
        """
    )
    assert err.field == "x" and "Missing" in str(err)


def test_duplicate_tag() -> None:
    err = load_error(
        """
        [union.U]
        tag_field = "type"
        [struct.A]
        union = "U"
        tag = "same"
        [struct.B]
        union = "U"
        tag = "same"
        """
    )
    assert err.type_name == "B" and "duplicate tag" in str(err)


def test_extends_cycle() -> None:
    err = load_error(
        """
        [struct.A]
        extends = "B"
        [struct.B]
        extends = "A"
        """
    )
    assert "cycle" in str(err) and "A" in str(err) and "B" in str(err)


def test_new_field_without_default() -> None:
    err = load_error(
        """
        [struct.A]
        fields = [ { name = "x", type = "int", since = "1.1" } ]
        """
    )
    assert err.field == "x" and "needs a default" in str(err)


def test_since_newer_than_schema() -> None:
    err = load_error(
        """
        [struct.A]
        fields = [ { name = "x", type = "int", default = 0, since = "2.0" } ]
        """
    )
    assert "newer than the schema version" in str(err)


@pytest.mark.parametrize(
    ("field", "fragment"),
    [
        ('{ name = "x", type = "int", default = "3" }', "does not fit type int"),
        ('{ name = "x", type = "bool", default = 1 }', "does not fit type bool"),
        ('{ name = "x", type = "list<int>", default = 1 }', "empty"),
        ('{ name = "x", type = "E", default = "nope" }', "one of"),
        ('{ name = "x", type = "str", ge = 1 }', "int and float fields only"),
        ('{ name = "class", type = "int" }', "not a public identifier"),
        ('{ name = "x", type = "map<int,str>" }', "map<str,T>"),
        ('{ name = "x", type = "array<float>" }', "int32 or int64"),
        ('{ name = "x", type = "int??" }', "optional of optional"),
    ],
)
def test_bad_field(field: str, fragment: str) -> None:
    err = load_error(
        f"""
        [enum.E]
        values = ["a"]
        [struct.A]
        fields = [ {field} ]
        """
    )
    assert fragment in str(err)
    assert err.type_name == "A"


def test_override_without_base_and_duplicate_without_override() -> None:
    err = load_error(
        """
        [struct.A]
        fields = [ { name = "x", type = "int", override = true } ]
        """
    )
    assert "no base struct" in str(err)
    err = load_error(
        """
        [struct.A]
        fields = [ { name = "x", type = "int" } ]
        [struct.B]
        extends = "A"
        fields = [ { name = "x", type = "int" } ]
        """
    )
    assert err.type_name == "B" and err.field == "x" and "override" in str(err)


def test_array_layout_requires_trailing_defaults() -> None:
    err = load_error(
        """
        [struct.A]
        layout = "array"
        kind = "message"
        fields = [ { name = "x", type = "int", default = 0 }, { name = "y", type = "int" } ]
        """
    )
    assert err.field == "y"


def test_message_rules() -> None:
    assert "only kind = 'message'" in str(
        load_error(
            """
            [struct.A]
            message_id = 3
            """
        )
    )
    err = load_error(
        """
        [struct.A]
        kind = "message"
        message_id = 3
        [struct.B]
        kind = "message"
        message_id = 3
        """
    )
    assert "also used by" in str(err)


def test_abstract_struct_is_not_a_field_type() -> None:
    err = load_error(
        """
        [struct.Base]
        abstract = true
        [struct.A]
        fields = [ { name = "x", type = "Base" } ]
        """
    )
    assert "abstract" in str(err)


def test_invalid_toml_and_bad_version() -> None:
    with pytest.raises(SchemaError, match="invalid TOML"):
        load_schema_text("[schema\n", file="x.toml")
    with pytest.raises(SchemaError, match=r"major\.minor"):
        load_schema_text('[schema]\nname = "t"\nversion = "1"\n', file="x.toml")


def test_enum_alias_must_target_a_value() -> None:
    err = load_error(
        """
        [enum.E]
        values = ["a"]
        aliases = { b = "c" }
        """
    )
    assert err.type_name == "E" and "unknown value" in str(err)


def test_union_member_layouts_and_empty_union() -> None:
    assert "no members" in str(
        load_error(
            """
            [union.U]
            tag_field = "type"
            """
        )
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("int", "int"),
        ("list<map<str,int?>>", "list<map<str,int?>>"),
        ("array<int64>?", "array<int64>?"),
        ("Foo", "Foo"),
    ],
)
def test_typeref_round_trip(text: str, expected: str) -> None:
    assert str(parse_type(text)) == expected


@pytest.mark.parametrize("text", ["", "list<int", "list<>", "set<int>", "a-b", "map<str>"])
def test_typeref_errors(text: str) -> None:
    with pytest.raises(TypeSyntaxError):
        parse_type(text)


def test_cli_reports_schema_error_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(schema('[struct.A]\nfields = [ { name = "x", type = "Nope" } ]\n'))
    proc = subprocess.run(
        [sys.executable, "-m", "codegen", "--check", "--schema", str(bad), "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert "type A" in proc.stderr and "field x" in proc.stderr
