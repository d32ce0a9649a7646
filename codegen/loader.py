"""Load a schema TOML file, validate it, and resolve it into the model the templates render."""

from __future__ import annotations

import hashlib
import json
import keyword
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from .errors import SchemaError
from .meta import DefaultValue, EnumDef, FieldDef, SchemaFile, SchemaHeader, StructDef, UnionDef
from .typeref import TypeRef, TypeSyntaxError, parse_type

_VERSION_RE = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")
_NUMERIC = frozenset({"int", "float"})
_SIZED = frozenset({"str", "bytes"})


def parse_version(text: str) -> tuple[int, int]:
    """Parse `major.minor`; raises ValueError naming the text."""
    match = _VERSION_RE.match(text)
    if match is None:
        raise ValueError(f"version {text!r} is not major.minor")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class Field:
    """A resolved struct field."""

    name: str
    type: TypeRef
    owner: str
    doc: str = ""
    default: DefaultValue | msgspec.UnsetType = msgspec.UNSET
    constraints: tuple[tuple[str, int | float], ...] = ()
    since: str | None = None
    override: bool = False
    removed: str | None = None
    line: int = 0

    @property
    def has_default(self) -> bool:
        """Whether the field may be omitted."""
        return self.default is not msgspec.UNSET


@dataclass(frozen=True)
class Struct:
    """A resolved struct; `fields` is the flattened list including inherited fields."""

    name: str
    doc: str
    abstract: bool
    extends: str | None
    union: str | None
    tag: str | None
    layout: str
    kind: str
    message_id: int | None
    root: bool
    since: str | None
    own_fields: tuple[Field, ...]
    fields: tuple[Field, ...]
    line: int = 0
    gc: bool = True

    @property
    def live_fields(self) -> tuple[Field, ...]:
        """Fields that are not tombstones."""
        return tuple(f for f in self.fields if f.removed is None)

    def declared_fields(self) -> list[tuple[str, Field]]:
        """(Python name, field) of the fields this struct's class declares, in wire order.

        Inherited fields come from the base class; a map-layout tombstone only reserves its name, while an
        array-layout tombstone keeps its position as ``removed_<name>``.
        """
        own_names = {f.name for f in self.own_fields}
        return [
            (f"removed_{f.name}" if f.removed is not None else f.name, f)
            for f in self.fields
            if f.name in own_names and not (f.removed is not None and self.layout == "map")
        ]


@dataclass(frozen=True)
class Enum:
    """A resolved string enum."""

    name: str
    doc: str
    values: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...]
    since: str | None
    line: int = 0


@dataclass(frozen=True)
class Union:
    """A resolved tagged union with its members in schema order."""

    name: str
    doc: str
    tag_field: str
    members: tuple[str, ...]
    since: str | None
    line: int = 0


@dataclass(frozen=True)
class Schema:
    """A validated schema, ready to render or compare."""

    file: str
    name: str
    version: str
    doc: str
    enums: dict[str, Enum]
    structs: dict[str, Struct]
    unions: dict[str, Union]
    fingerprint: str
    source: SchemaFile = field(repr=False)

    @property
    def major(self) -> int:
        """Major version number."""
        return parse_version(self.version)[0]

    @property
    def minor(self) -> int:
        """Minor version number."""
        return parse_version(self.version)[1]

    @property
    def messages(self) -> list[Struct]:
        """Top-level wire messages (structs with a message id), by id."""
        return sorted(
            (s for s in self.structs.values() if s.message_id is not None),
            key=lambda s: s.message_id or 0,
        )


class _Lines:
    """Finds the line of a table or a field in the raw TOML text, for error messages and reports."""

    def __init__(self, text: str) -> None:
        self._lines = text.splitlines()

    def table(self, kind: str, name: str) -> int:
        header = f"[{kind}.{name}]"
        for number, line in enumerate(self._lines, 1):
            if line.strip() == header:
                return number
        return 0

    def field(self, struct: str, name: str) -> int:
        start = self.table("struct", struct)
        pattern = re.compile(r'name\s*=\s*"' + re.escape(name) + '"')
        for number in range(start, len(self._lines)):
            line = self._lines[number]
            if number > start and line.lstrip().startswith("["):
                break
            if pattern.search(line):
                return number + 1
        return start


def fingerprint_of(source: SchemaFile) -> str:
    """Hash of the canonical schema without `doc` and `gc`: neither changes the wire."""

    def strip(value: object) -> object:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "doc"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    data = msgspec.to_builtins(source)
    for struct in data.get("struct", {}).values():
        struct.pop("gc", None)  # a Python-side tracking option: it never changes the wire
    canonical = json.dumps(strip(data), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def load_schema(path: str | Path) -> Schema:
    """Read, validate and resolve a schema file; every problem raises SchemaError naming file and type."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SchemaError(f"cannot read schema: {exc.strerror}", file=str(path)) from None
    return load_schema_text(text, file=str(path))


def load_schema_text(text: str, *, file: str = "<schema>") -> Schema:
    """Validate and resolve schema TOML text (see `load_schema`)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SchemaError(f"invalid TOML: {exc}", file=file) from None
    source = _convert(raw, file)
    return _Resolver(source, file, _Lines(text)).resolve()


def _convert(raw: dict[str, object], file: str) -> SchemaFile:
    """Convert the TOML document entry by entry, so an error can name the type and field it is in."""
    kinds: dict[str, type[EnumDef] | type[StructDef] | type[UnionDef]] = {
        "enum": EnumDef,
        "struct": StructDef,
        "union": UnionDef,
    }
    unknown = sorted(set(raw) - {"schema", *kinds})
    if unknown:
        raise SchemaError(f"unknown top-level table {unknown[0]!r} (schema, enum, struct, union)", file=file)
    try:
        header = msgspec.convert(raw.get("schema"), SchemaHeader)
    except msgspec.ValidationError as exc:
        raise SchemaError(f"[schema]: {exc}", file=file) from None
    tables: dict[str, dict[str, EnumDef | StructDef | UnionDef]] = {}
    for kind, cls in kinds.items():
        entries = raw.get(kind, {})
        if not isinstance(entries, dict):
            raise SchemaError(f"`{kind}` must be a table of tables", file=file)
        tables[kind] = {}
        for name, entry in entries.items():
            try:
                tables[kind][name] = msgspec.convert(entry, cls)
            except msgspec.ValidationError as exc:
                raise _explain_validation(str(exc), entry, file, name) from None
    return SchemaFile(
        schema=header,
        enum={k: v for k, v in tables["enum"].items() if isinstance(v, EnumDef)},
        struct={k: v for k, v in tables["struct"].items() if isinstance(v, StructDef)},
        union={k: v for k, v in tables["union"].items() if isinstance(v, UnionDef)},
    )


def _explain_validation(message: str, entry: object, file: str, type_name: str) -> SchemaError:
    """Name the field a msgspec error points at (`$.fields[2]` -> that field's `name`)."""
    field_name = ""
    match = re.search(r"`\$\.fields\[(\d+)\]", message)
    if match is not None:
        index = int(match.group(1))
        fields = entry.get("fields") if isinstance(entry, dict) else None
        item = fields[index] if isinstance(fields, list) and index < len(fields) else None
        field_name = str(item.get("name", f"#{index}")) if isinstance(item, dict) else f"#{index}"
    return SchemaError(message, file=file, type_name=type_name, field=field_name)


class _Resolver:
    def __init__(self, source: SchemaFile, file: str, lines: _Lines) -> None:
        self.source = source
        self.file = file
        self.lines = lines
        self.version = self._version(source.schema.version, "", "")

    def error(self, message: str, type_name: str = "", field_name: str = "") -> SchemaError:
        return SchemaError(message, file=self.file, type_name=type_name, field=field_name)

    def _version(self, text: str, type_name: str, field_name: str) -> tuple[int, int]:
        try:
            return parse_version(text)
        except ValueError as exc:
            raise self.error(str(exc), type_name, field_name) from None

    def _since(self, text: str | None, type_name: str, field_name: str = "") -> tuple[int, int] | None:
        if text is None:
            return None
        version = self._version(text, type_name, field_name)
        if version > self.version:
            raise self.error(
                f"since {text!r} is newer than the schema version {self.source.schema.version!r}",
                type_name,
                field_name,
            )
        return version

    def resolve(self) -> Schema:
        src = self.source
        if not src.schema.name.isidentifier():
            raise self.error(f"schema name {src.schema.name!r} is not an identifier")
        seen: dict[str, str] = {}
        for kind, names in (("enum", src.enum), ("struct", src.struct), ("union", src.union)):
            for name in names:
                if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
                    raise self.error(f"{kind} name {name!r} is not a public identifier", name)
                if name in seen:
                    raise self.error(f"name {name!r} is defined as both {seen[name]} and {kind}", name)
                seen[name] = kind
        enums = {name: self._enum(name, e) for name, e in src.enum.items()}
        order = self._struct_order()
        structs: dict[str, Struct] = {}
        for name in order:
            structs[name] = self._struct(name, src.struct[name], structs, seen)
        unions = {name: self._union(name, u, structs) for name, u in src.union.items()}
        self._check_messages(structs)
        return Schema(
            file=self.file,
            name=src.schema.name,
            version=src.schema.version,
            doc=src.schema.doc,
            enums=enums,
            structs=structs,
            unions=unions,
            fingerprint=fingerprint_of(src),
            source=src,
        )

    def _enum(self, name: str, e: EnumDef) -> Enum:
        self._since(e.since, name)
        if not e.values:
            raise self.error("enum has no values", name)
        members: set[str] = set()
        for value in e.values:
            if not value or value in members:
                raise self.error(f"enum value {value!r} is empty or repeated", name)
            member = _member_name(value)
            if not member.isidentifier():
                raise self.error(f"enum value {value!r} does not make a member name", name)
            members.add(value)
        if len({_member_name(v) for v in e.values}) != len(e.values):
            raise self.error("two enum values map to the same member name", name)
        for alias, target in e.aliases.items():
            if target not in members:
                raise self.error(f"alias {alias!r} points to unknown value {target!r}", name)
            if _member_name(alias) in {_member_name(v) for v in e.values}:
                raise self.error(f"alias {alias!r} collides with a member", name)
        return Enum(
            name=name,
            doc=e.doc,
            values=tuple(e.values),
            aliases=tuple(e.aliases.items()),
            since=e.since,
            line=self.lines.table("enum", name),
        )

    def _struct_order(self) -> list[str]:
        """Schema order, with every base before the structs that extend it; detects cycles."""
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(name: str, chain: list[str]) -> None:
            if state.get(name) == 2:
                return
            if state.get(name) == 1:
                cycle = " -> ".join([*chain[chain.index(name) :], name])
                raise self.error(f"extends cycle: {cycle}", name)
            state[name] = 1
            base = self.source.struct[name].extends
            if base is not None:
                if base not in self.source.struct:
                    raise self.error(f"extends unknown struct {base!r}", name)
                visit(base, [*chain, name])
            state[name] = 2
            order.append(name)

        for name in self.source.struct:
            visit(name, [])
        return order

    def _struct(self, name: str, s: StructDef, done: dict[str, Struct], kinds: dict[str, str]) -> Struct:
        since = self._since(s.since, name)
        base = done[s.extends] if s.extends is not None else None
        if base is not None:
            if base.layout != s.layout:
                raise self.error(f"layout {s.layout!r} differs from base {base.name!r} ({base.layout!r})", name)
            if base.kind != s.kind:
                raise self.error(f"kind {s.kind!r} differs from base {base.name!r} ({base.kind!r})", name)
        if s.abstract and (s.union or s.tag or s.message_id is not None or s.root):
            raise self.error("an abstract struct cannot be a union member, a message or a root", name)
        if (s.union is None) != (s.tag is None):
            raise self.error("`union` and `tag` go together", name)
        if s.union is not None and s.union not in self.source.union:
            raise self.error(f"member of unknown union {s.union!r}", name)
        if s.message_id is not None:
            if s.kind != "message":
                raise self.error("only kind = 'message' structs carry a message_id", name)
            if not 1 <= s.message_id <= 255:
                raise self.error(f"message_id {s.message_id} is outside 1..255", name)
        inherited = list(base.fields) if base is not None else []
        positions = {f.name: i for i, f in enumerate(inherited)}
        own: list[Field] = []
        for fd in s.fields:
            resolved = self._field(name, fd, since, kinds)
            if fd.name in positions:
                if not fd.override:
                    raise self.error("duplicate field (set override = true to redefine a base field)", name, fd.name)
                inherited[positions[fd.name]] = resolved
            else:
                if fd.override:
                    raise self.error("override = true but no base struct defines this field", name, fd.name)
                positions[fd.name] = len(inherited)
                inherited.append(resolved)
            own.append(resolved)
        if s.layout == "array":
            defaulted = False
            for f in inherited:
                if f.has_default:
                    defaulted = True
                elif defaulted:
                    raise self.error(
                        "in an array layout every field after a defaulted field needs a default", name, f.name
                    )
        return Struct(
            name=name,
            doc=s.doc,
            abstract=s.abstract,
            extends=s.extends,
            union=s.union,
            tag=s.tag,
            layout=s.layout,
            kind=s.kind,
            message_id=s.message_id,
            root=s.root,
            since=s.since,
            own_fields=tuple(own),
            fields=tuple(inherited),
            line=self.lines.table("struct", name),
            gc=s.gc,
        )

    def _field(self, owner: str, fd: FieldDef, owner_since: tuple[int, int] | None, kinds: dict[str, str]) -> Field:
        name = fd.name
        if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
            raise self.error(f"field name {name!r} is not a public identifier", owner, name)
        try:
            tref = parse_type(fd.type)
        except TypeSyntaxError as exc:
            raise self.error(f"bad type: {exc}", owner, name) from None
        for ref in tref.names():
            kind = kinds.get(ref)
            if kind is None:
                raise self.error(f"unknown type {ref!r}", owner, name)
            if kind == "struct" and self.source.struct[ref].abstract:
                raise self.error(f"abstract struct {ref!r} cannot be a field type; use its union", owner, name)
        since = self._since(fd.since, owner, name)
        if fd.removed is not None:
            self._since(fd.removed, owner, name)
        base_version = owner_since or (1, 0)
        if since is not None and since < base_version:
            raise self.error(f"since {fd.since!r} is older than its struct", owner, name)
        if since is not None and since > base_version and fd.default is msgspec.UNSET:
            raise self.error(f"field added in {fd.since} needs a default", owner, name)
        if fd.removed is not None and fd.default is msgspec.UNSET:
            raise self.error("a tombstone needs a default", owner, name)
        if fd.default is not msgspec.UNSET:
            self._check_default(owner, name, tref, fd.default)
        constraints: list[tuple[str, int | float]] = []
        base = tref.inner if tref.kind == "optional" else tref
        for key in ("ge", "le", "gt", "lt"):
            value = getattr(fd, key)
            if value is None:
                continue
            if not (base.kind == "primitive" and base.name in _NUMERIC):
                raise self.error(f"`{key}` applies to int and float fields only", owner, name)
            constraints.append((key, value))
        for key in ("min_length", "max_length"):
            value = getattr(fd, key)
            if value is None:
                continue
            if not (base.kind in ("list", "map") or (base.kind == "primitive" and base.name in _SIZED)):
                raise self.error(f"`{key}` applies to str, bytes, list and map fields only", owner, name)
            constraints.append((key, value))
        return Field(
            name=name,
            type=tref,
            owner=owner,
            doc=fd.doc,
            default=fd.default,
            constraints=tuple(constraints),
            since=fd.since,
            override=fd.override,
            removed=fd.removed,
            line=self.lines.field(owner, name),
        )

    def _check_default(self, owner: str, name: str, tref: TypeRef, value: DefaultValue) -> None:
        def bad(expected: str) -> SchemaError:
            return self.error(f"default {value!r} does not fit type {tref} ({expected})", owner, name)

        if tref.kind == "optional":
            if value == "none":
                return
            tref = tref.inner
        if tref.kind in ("list", "map", "array"):
            if value != "empty":
                raise bad('use "empty"')
            return
        if tref.kind == "named":
            if tref.name in self.source.enum:
                if not isinstance(value, str) or value not in self.source.enum[tref.name].values:
                    raise bad(f"one of {self.source.enum[tref.name].values}")
                return
            raise bad('structs and unions default only to "none" when optional')
        prim = tref.name
        ok = (
            (prim == "bool" and isinstance(value, bool))
            or (prim == "int" and isinstance(value, int) and not isinstance(value, bool))
            or (prim == "float" and isinstance(value, int | float) and not isinstance(value, bool))
            or (prim == "str" and isinstance(value, str))
        )
        if not ok:
            raise bad(f"a {prim} literal")

    def _union(self, name: str, u: UnionDef, structs: dict[str, Struct]) -> Union:
        self._since(u.since, name)
        if not u.tag_field.isidentifier():
            raise self.error(f"tag_field {u.tag_field!r} is not an identifier", name)
        members = [s for s in structs.values() if s.union == name]
        # Keep schema order rather than topological order.
        rank = {n: i for i, n in enumerate(self.source.struct)}
        members.sort(key=lambda s: rank[s.name])
        if not members:
            raise self.error("union has no members (set `union` and `tag` on its structs)", name)
        tags: dict[str, str] = {}
        for member in members:
            tag = member.tag or ""
            if tag in tags:
                raise self.error(f"duplicate tag {tag!r} (also on {tags[tag]!r})", member.name)
            tags[tag] = member.name
            if member.layout != members[0].layout:
                raise self.error("all members of a union share one layout", member.name)
            if any(f.name == u.tag_field for f in member.fields):
                raise self.error(f"field name clashes with the union's tag_field {u.tag_field!r}", member.name)
        return Union(
            name=name,
            doc=u.doc,
            tag_field=u.tag_field,
            members=tuple(m.name for m in members),
            since=u.since,
            line=self.lines.table("union", name),
        )

    def _check_messages(self, structs: dict[str, Struct]) -> None:
        ids: dict[int, str] = {}
        for s in structs.values():
            if s.message_id is None:
                continue
            if s.message_id in ids:
                raise self.error(f"message_id {s.message_id} is also used by {ids[s.message_id]!r}", s.name)
            ids[s.message_id] = s.name


def _member_name(value: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", value).upper()


member_name = _member_name
