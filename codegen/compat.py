"""Breaking-change checker between two schema versions (`buf breaking` for this schema language).

`python -m codegen compat OLD.toml NEW.toml` prints one line per breaking change,

    RULE_ID Type.field: [CATEGORY] message (file:line)

and exits 1 when it finds any, 0 with a short OK line otherwise (2 when a schema does not load).
Categories: WIRE (a peer on the other version misreads or rejects the bytes) and API (the bytes still
work, but Python code written against the old version breaks). Compatibility is only defined within a
major version: a minor release may append fields that carry `since` and a default, add enum values,
add union members and add types; everything else is reported.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn

import msgspec

from .errors import SchemaError
from .loader import Enum, Field, Schema, Struct, Union, load_schema, parse_version

__all__ = ["RULES", "Finding", "Rule", "compare", "main"]

Category = Literal["WIRE", "API"]


@dataclass(frozen=True)
class Rule:
    """A breaking-change rule: a stable id, its category and what it guards against."""

    id: str
    category: Category
    summary: str


_RULE_LIST = (
    Rule("MAJOR_VERSION_CHANGED", "WIRE", "compatibility is only checked within one major version"),
    Rule("VERSION_NOT_INCREASED", "WIRE", "a changed schema must carry a newer version"),
    Rule("SCHEMA_NAME_CHANGED", "API", "the schema name is part of every generated module"),
    Rule("TYPE_REMOVED", "WIRE", "a type disappeared"),
    Rule("TYPE_KIND_CHANGED", "WIRE", "a type changed between enum, struct and union"),
    Rule("TYPE_ADDED_WITHOUT_SINCE", "API", "a new type must say in which version it appeared"),
    Rule("STRUCT_KIND_CHANGED", "WIRE", "config <-> message changes forbid_unknown_fields"),
    Rule("STRUCT_LAYOUT_CHANGED", "WIRE", "map <-> array changes the encoding"),
    Rule("STRUCT_MADE_ABSTRACT", "API", "an abstract struct can no longer be built or encoded"),
    Rule("ROOT_REMOVED", "API", "the struct's top-level codecs disappear"),
    Rule("MESSAGE_ID_CHANGED", "WIRE", "the envelope kind byte of a message changed"),
    Rule("MESSAGE_ID_REMOVED", "WIRE", "a message lost its envelope kind byte"),
    Rule("FIELD_REMOVED", "WIRE", "a field disappeared without a tombstone"),
    Rule("FIELD_TYPE_CHANGED", "WIRE", "a field changed type"),
    Rule("FIELD_POSITION_CHANGED", "WIRE", "an array-layout field moved, or a field was inserted before it"),
    Rule("FIELD_RENAMED", "API", "an array-layout field kept its position but changed name"),
    Rule("FIELD_ADDED_WITHOUT_DEFAULT", "WIRE", "a new field has no default, so old writers break"),
    Rule("FIELD_ADDED_WITHOUT_SINCE", "API", "a new field must carry a `since` newer than the old version"),
    Rule("FIELD_SINCE_CHANGED", "API", "the `since` of an existing field changed"),
    Rule("FIELD_REQUIRED_ADDED", "WIRE", "a field lost its default and became required"),
    Rule("FIELD_DEFAULT_CHANGED", "WIRE", "peers fill a missing field with different values"),
    Rule("FIELD_CONSTRAINT_TIGHTENED", "WIRE", "a value the old version accepts is now rejected"),
    Rule("ENUM_VALUE_REMOVED", "WIRE", "an enum value disappeared"),
    Rule("ENUM_VALUE_RENAMED", "WIRE", "an enum value changed its spelling"),
    Rule("ENUM_ALIAS_REMOVED", "API", "an enum alias member disappeared"),
    Rule("UNION_TAG_FIELD_CHANGED", "WIRE", "the tag field of a union changed"),
    Rule("UNION_TAG_CHANGED", "WIRE", "a union member changed its tag"),
    Rule("UNION_MEMBER_REMOVED", "WIRE", "a struct left its union"),
)
RULES: dict[str, Rule] = {rule.id: rule for rule in _RULE_LIST}
"""Every rule by id."""


@dataclass(frozen=True)
class Finding:
    """One breaking change: the rule, where (type, field, file, line) and what happened."""

    rule: str
    type_name: str
    field: str
    message: str
    file: str
    line: int

    @property
    def category(self) -> Category:
        """WIRE or API (from the rule)."""
        return RULES[self.rule].category

    def format(self) -> str:
        """`RULE_ID Type.field: [CATEGORY] message (file:line)`."""
        where = f"{self.type_name}.{self.field}" if self.field else self.type_name
        return f"{self.rule} {where}: [{self.category}] {self.message} ({self.file}:{self.line})"


def compare(old: Schema, new: Schema) -> list[Finding]:
    """Every breaking change from `old` to `new`, in a stable order (schema-level, then by type)."""
    return _Comparer(old, new).run()


class _Comparer:
    def __init__(self, old: Schema, new: Schema) -> None:
        self.old = old
        self.new = new
        self.findings: list[Finding] = []
        self.seen: set[tuple[str, str, str, str]] = set()

    # -- reporting -------------------------------------------------------------------------------------

    def report(self, rule: str, type_name: str, field: str, message: str, *, file: str, line: int) -> None:
        key = (rule, type_name, field, message)
        if key in self.seen:  # an inherited field is compared once per struct that carries it
            return
        self.seen.add(key)
        self.findings.append(Finding(rule, type_name, field, message, file, line))

    def at_new(self, rule: str, type_name: str, field: str, message: str, line: int) -> None:
        self.report(rule, type_name, field, message, file=self.new.file, line=line)

    def at_old(self, rule: str, type_name: str, field: str, message: str, line: int) -> None:
        self.report(rule, type_name, field, message, file=self.old.file, line=line)

    # -- schema level ----------------------------------------------------------------------------------

    def run(self) -> list[Finding]:
        old_version = parse_version(self.old.version)
        new_version = parse_version(self.new.version)
        version_line = _version_line(self.new.file)
        if old_version[0] != new_version[0]:
            self.at_new(
                "MAJOR_VERSION_CHANGED",
                "schema",
                "",
                f"major version {old_version[0]} -> {new_version[0]} ({self.old.version} -> "
                f"{self.new.version}); compatibility is only defined within one major version",
                version_line,
            )
            return self.findings
        if new_version < old_version:
            self.at_new(
                "VERSION_NOT_INCREASED",
                "schema",
                "",
                f"version {self.new.version} is older than {self.old.version}",
                version_line,
            )
        elif new_version == old_version and self.new.fingerprint != self.old.fingerprint:
            self.at_new(
                "VERSION_NOT_INCREASED",
                "schema",
                "",
                f"the schema changed (fingerprint {self.old.fingerprint} -> {self.new.fingerprint}) but "
                f"the version stayed {self.new.version}; released versions are frozen",
                version_line,
            )
        if self.old.name != self.new.name:
            self.at_new(
                "SCHEMA_NAME_CHANGED",
                "schema",
                "",
                f"schema name {self.old.name!r} -> {self.new.name!r}",
                version_line,
            )
        self.types()
        return self.findings

    def types(self) -> None:
        old_kinds = _kinds(self.old)
        new_kinds = _kinds(self.new)
        for name, kind in old_kinds.items():
            new_kind = new_kinds.get(name)
            if new_kind is None:
                self.at_old("TYPE_REMOVED", name, "", f"{kind} removed", _line(self.old, name))
            elif new_kind != kind:
                self.at_new("TYPE_KIND_CHANGED", name, "", f"{kind} became a {new_kind}", _line(self.new, name))
        for name in new_kinds:
            if name not in old_kinds:
                self.added_type(name)
        for name, e in self.old.enums.items():
            if name in self.new.enums:
                self.enum(e, self.new.enums[name])
        for name, s in self.old.structs.items():
            if name in self.new.structs:
                self.struct(s, self.new.structs[name])
        for name, u in self.old.unions.items():
            if name in self.new.unions:
                self.union(u, self.new.unions[name])

    def added_type(self, name: str) -> None:
        since = _since_of(self.new, name)
        line = _line(self.new, name)
        if since is None:
            self.at_new(
                "TYPE_ADDED_WITHOUT_SINCE",
                name,
                "",
                f"new type has no `since` (expected > {self.old.version})",
                line,
            )
        elif parse_version(since) <= parse_version(self.old.version):
            self.at_new(
                "TYPE_ADDED_WITHOUT_SINCE",
                name,
                "",
                f"new type says since {since!r}, but {self.old.version} does not have it",
                line,
            )

    # -- enums -----------------------------------------------------------------------------------------

    def enum(self, old: Enum, new: Enum) -> None:
        for index, value in enumerate(old.values):
            if value in new.values:
                continue
            replacement = new.values[index] if index < len(new.values) else None
            if replacement is not None and replacement not in old.values:
                self.at_new(
                    "ENUM_VALUE_RENAMED",
                    old.name,
                    value,
                    f"value {value!r} renamed to {replacement!r}; peers on {self.old.version} send {value!r}",
                    new.line,
                )
            else:
                self.at_new(
                    "ENUM_VALUE_REMOVED",
                    old.name,
                    value,
                    f"value {value!r} removed; peers on {self.old.version} may still send it",
                    new.line,
                )
        new_aliases = dict(new.aliases)
        for alias, target in old.aliases:
            if new_aliases.get(alias) != target:
                self.at_new("ENUM_ALIAS_REMOVED", old.name, alias, f"alias {alias!r} -> {target!r} removed", new.line)

    # -- unions ----------------------------------------------------------------------------------------

    def union(self, old: Union, new: Union) -> None:
        if old.tag_field != new.tag_field:
            self.at_new(
                "UNION_TAG_FIELD_CHANGED",
                old.name,
                "",
                f"tag field {old.tag_field!r} -> {new.tag_field!r}",
                new.line,
            )
        for member in old.members:
            if member not in new.members:
                moved = self.new.structs.get(member)
                line = moved.line if moved is not None else new.line
                self.at_new(
                    "UNION_MEMBER_REMOVED",
                    old.name,
                    "",
                    f"member {member!r} (tag {self.old.structs[member].tag!r}) removed from the union",
                    line,
                )

    # -- structs ---------------------------------------------------------------------------------------

    def struct(self, old: Struct, new: Struct) -> None:
        name = old.name
        if old.kind != new.kind:
            strict = "rejects" if new.kind == "config" else "accepts"
            self.at_new(
                "STRUCT_KIND_CHANGED",
                name,
                "",
                f"kind {old.kind!r} -> {new.kind!r}: it now {strict} unknown fields",
                new.line,
            )
        if old.layout != new.layout:
            self.at_new("STRUCT_LAYOUT_CHANGED", name, "", f"layout {old.layout!r} -> {new.layout!r}", new.line)
        if not old.abstract and new.abstract:
            self.at_new("STRUCT_MADE_ABSTRACT", name, "", "struct became abstract", new.line)
        if old.root and not new.root:
            self.at_new("ROOT_REMOVED", name, "", "no longer a root type (its codecs disappear)", new.line)
        if old.message_id is not None:
            if new.message_id is None:
                self.at_new("MESSAGE_ID_REMOVED", name, "", f"message_id {old.message_id} removed", new.line)
            elif new.message_id != old.message_id:
                self.at_new(
                    "MESSAGE_ID_CHANGED",
                    name,
                    "",
                    f"message_id {old.message_id} -> {new.message_id}",
                    new.line,
                )
        if old.union is not None and new.union == old.union and old.tag != new.tag:
            self.at_new(
                "UNION_TAG_CHANGED",
                name,
                "",
                f"tag {old.tag!r} -> {new.tag!r} in union {old.union}",
                new.line,
            )
        renamed: set[str] = set()
        if old.layout == "array" and new.layout == "array":
            renamed = self.positions(old, new)
        else:
            self.removed_fields(old, new)
        new_by_name = {f.name: f for f in new.fields}
        old_names = {f.name for f in old.fields}
        for f in old.fields:
            nf = new_by_name.get(f.name)
            if nf is not None:
                self.field(name, f, nf)
        for nf in new.fields:
            if nf.name not in old_names and nf.name not in renamed and nf.removed is None:
                self.added_field(name, nf)

    def removed_fields(self, old: Struct, new: Struct) -> None:
        new_names = {f.name for f in new.fields}
        for f in old.fields:
            if f.name in new_names:
                continue
            if f.removed is None:
                message = 'field removed without a tombstone (keep it with `removed = "X.Y"` and a default)'
            else:
                message = "tombstone dropped: the name could come back with another type"
            self.at_new("FIELD_REMOVED", f.owner, f.name, message, new.line)

    def positions(self, old: Struct, new: Struct) -> set[str]:
        """Array layout: every old field keeps its index; new fields only go at the end.

        Returns the new names of renamed fields (same position and type), which are not new fields.
        """
        new_index = {f.name: i for i, f in enumerate(new.fields)}
        old_names = {f.name for f in old.fields}
        renamed: set[str] = set()
        for i, f in enumerate(old.fields):
            j = new_index.get(f.name)
            if j is None:
                there = new.fields[i] if i < len(new.fields) else None
                if there is not None and there.name not in old_names and str(there.type) == str(f.type):
                    renamed.add(there.name)
                    self.at_new(
                        "FIELD_RENAMED",
                        new.name,
                        f.name,
                        f"position {i} renamed {f.name!r} -> {there.name!r} (same bytes, new Python name)",
                        there.line,
                    )
                else:
                    what = "removed without a tombstone" if f.removed is None else "tombstone dropped"
                    self.at_new(
                        "FIELD_REMOVED",
                        new.name,
                        f.name,
                        f'position {i} {what} (keep it with `removed = "X.Y"` and a default)',
                        new.line,
                    )
            elif j != i:
                self.at_new(
                    "FIELD_POSITION_CHANGED",
                    new.name,
                    f.name,
                    f"moved from position {i} to {j}; array-layout fields never move",
                    new.fields[j].line,
                )
        for j, nf in enumerate(new.fields[: len(old.fields)]):
            if nf.name not in old_names and nf.name not in renamed:
                self.at_new(
                    "FIELD_POSITION_CHANGED",
                    new.name,
                    nf.name,
                    f"new field inserted at position {j}, before existing fields; append at the end",
                    nf.line,
                )
        return renamed

    def field(self, struct: str, old: Field, new: Field) -> None:
        label = new.owner if new.owner == old.owner else struct
        if str(old.type) != str(new.type):
            self.at_new("FIELD_TYPE_CHANGED", label, new.name, f"type {old.type} -> {new.type}", new.line)
        if new.removed is not None:
            return  # a tombstone keeps only its type and position
        if old.since != new.since and old.removed is None:
            self.at_new("FIELD_SINCE_CHANGED", label, new.name, f"since {old.since!r} -> {new.since!r}", new.line)
        if old.has_default and not new.has_default:
            self.at_new(
                "FIELD_REQUIRED_ADDED",
                label,
                new.name,
                f"default {_show(old.default)} removed; messages from {self.old.version} may omit it",
                new.line,
            )
        elif old.has_default and new.has_default and not _same_default(old.default, new.default):
            self.at_new(
                "FIELD_DEFAULT_CHANGED",
                label,
                new.name,
                f"default {_show(old.default)} -> {_show(new.default)}",
                new.line,
            )
        for message in _tightened(old, new):
            self.at_new("FIELD_CONSTRAINT_TIGHTENED", label, new.name, message, new.line)

    def added_field(self, struct: str, new: Field) -> None:
        if not new.has_default:
            self.at_new(
                "FIELD_ADDED_WITHOUT_DEFAULT",
                new.owner,
                new.name,
                f"new field has no default; peers on {self.old.version} never send it",
                new.line,
            )
        if new.since is None:
            self.at_new(
                "FIELD_ADDED_WITHOUT_SINCE",
                new.owner,
                new.name,
                f"new field has no `since` (expected > {self.old.version})",
                new.line,
            )
        elif parse_version(new.since) <= parse_version(self.old.version):
            self.at_new(
                "FIELD_ADDED_WITHOUT_SINCE",
                new.owner,
                new.name,
                f"new field says since {new.since!r}, but {self.old.version} does not have it",
                new.line,
            )


# -- helpers ---------------------------------------------------------------------------------------------


def _kinds(schema: Schema) -> dict[str, str]:
    kinds: dict[str, str] = {}
    kinds.update((name, "enum") for name in schema.enums)
    kinds.update((name, "struct") for name in schema.structs)
    kinds.update((name, "union") for name in schema.unions)
    return kinds


def _line(schema: Schema, name: str) -> int:
    item: Enum | Struct | Union | None = schema.enums.get(name) or schema.structs.get(name) or schema.unions.get(name)
    return item.line if item is not None else 0


def _since_of(schema: Schema, name: str) -> str | None:
    item: Enum | Struct | Union | None = schema.enums.get(name) or schema.structs.get(name) or schema.unions.get(name)
    return item.since if item is not None else None


def _version_line(file: str) -> int:
    """Line of `version = ...` in the `[schema]` table (0 when the file cannot be read)."""
    try:
        lines = Path(file).read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0
    in_schema = False
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("["):
            in_schema = stripped == "[schema]"
        elif in_schema and re.match(r"version\s*=", stripped):
            return number
    return 0


def _show(value: object) -> str:
    return "(none)" if value is msgspec.UNSET else repr(value)


def _same_default(a: object, b: object) -> bool:
    """Equal defaults; `0` and `0.0` count as equal, `1` and `True` do not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _bounds(f: Field) -> tuple[float, float, int, float]:
    """(lowest accepted value, highest accepted value, min length, max length) of a field."""
    is_int = (f.type.inner if f.type.kind == "optional" else f.type).name == "int"
    step = 1.0 if is_int else 0.0
    low, high, min_len, max_len = -math.inf, math.inf, 0, math.inf
    for key, value in f.constraints:
        if key == "ge":
            low = max(low, float(value))
        elif key == "gt":
            low = max(low, float(value) + step if is_int else math.nextafter(float(value), math.inf))
        elif key == "le":
            high = min(high, float(value))
        elif key == "lt":
            high = min(high, float(value) - step if is_int else math.nextafter(float(value), -math.inf))
        elif key == "min_length":
            min_len = max(min_len, int(value))
        elif key == "max_length":
            max_len = min(max_len, float(value))
    return low, high, min_len, max_len


def _tightened(old: Field, new: Field) -> Iterable[str]:
    if str(old.type) != str(new.type):
        return  # reported as a type change
    (old_low, old_high, old_min, old_max) = _bounds(old)
    (new_low, new_high, new_min, new_max) = _bounds(new)
    old_c, new_c = _constraint_text(old), _constraint_text(new)
    if new_low > old_low:
        yield f"lower bound tightened ({old_c} -> {new_c})"
    if new_high < old_high:
        yield f"upper bound tightened ({old_c} -> {new_c})"
    if new_min > old_min:
        yield f"min_length tightened ({old_c} -> {new_c})"
    if new_max < old_max:
        yield f"max_length tightened ({old_c} -> {new_c})"


def _constraint_text(f: Field) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in f.constraints) or "none"


# -- command line ----------------------------------------------------------------------------------------


class _UsageError(Exception):
    """A bad command line (argparse would otherwise exit the interpreter)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.format_usage()}{self.prog}: error: {message}")


def main(argv: Sequence[str]) -> int:
    """`python -m codegen compat OLD.toml NEW.toml`: 1 when NEW breaks OLD, 0 when compatible, 2 on errors."""
    parser = _Parser(
        prog="python -m codegen compat",
        description="Report breaking changes from OLD to NEW (rule ids, categories WIRE/API, file:line).",
    )
    parser.add_argument("old", type=Path, help="the released schema (e.g. schema/history/1.1.toml)")
    parser.add_argument("new", type=Path, help="the candidate schema (e.g. schema/kvoffload.toml)")
    try:
        ns = parser.parse_args(list(argv))
    except _UsageError as exc:
        print(exc)
        return 2
    try:
        old = load_schema(ns.old)
        new = load_schema(ns.new)
    except SchemaError as exc:
        print(f"error: {exc}")
        return 2
    findings = compare(old, new)
    for finding in findings:
        print(finding.format())
    if findings:
        wire = sum(1 for f in findings if f.category == "WIRE")
        print(
            f"{len(findings)} breaking change(s) from {old.version} to {new.version} "
            f"({wire} WIRE, {len(findings) - wire} API)"
        )
        return 1
    print(f"OK: {new.file} ({new.version}) is compatible with {old.file} ({old.version})")
    return 0
