"""The meta-schema: the shape of a schema TOML file, as msgspec Structs that reject unknown keys."""

from __future__ import annotations

from typing import Literal

import msgspec

DefaultValue = bool | int | float | str


class FieldDef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One field of a struct."""

    name: str
    type: str
    doc: str = ""
    default: DefaultValue | msgspec.UnsetType = msgspec.UNSET
    ge: int | float | None = None
    le: int | float | None = None
    gt: int | float | None = None
    lt: int | float | None = None
    min_length: int | None = None
    max_length: int | None = None
    since: str | None = None
    override: bool = False
    removed: str | None = None


class EnumDef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A string enum; `aliases` maps extra Python member names onto existing values."""

    values: list[str]
    doc: str = ""
    aliases: dict[str, str] = {}
    since: str | None = None


class StructDef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A struct: a config (named fields, unknown fields rejected) or a message (may be positional)."""

    doc: str = ""
    abstract: bool = False
    extends: str | None = None
    union: str | None = None
    tag: str | None = None
    layout: Literal["map", "array"] = "map"
    kind: Literal["config", "message"] = "config"
    message_id: int | None = None
    root: bool = False
    gc: bool = True
    """False: instances are not tracked by Python's cycle GC (msgspec `gc=False`; cheaper hot messages). Only
    for structs that cannot be part of a reference cycle. A Python-side option: not part of the fingerprint."""
    since: str | None = None
    fields: list[FieldDef] = []


class UnionDef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tagged union; members name it with `union = ...` and carry a `tag`."""

    tag_field: str
    doc: str = ""
    since: str | None = None


class SchemaHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[schema]` table."""

    name: str
    version: str
    doc: str = ""


class SchemaFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A whole schema file."""

    schema: SchemaHeader
    enum: dict[str, EnumDef] = {}
    struct: dict[str, StructDef] = {}
    union: dict[str, UnionDef] = {}
