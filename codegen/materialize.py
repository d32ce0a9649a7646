"""Build msgspec Struct classes at run time from any schema file.

Tests use this to get "readers generated from the history schemas": the classes carry the same msgspec
options as the generated code (frozen, kw_only, array_like for `layout = "array"`, forbid_unknown_fields
for configs, tagged unions, constraints as `msgspec.Meta`, packed arrays as Int32Bytes/Int64Bytes), so a
message that a materialized 1.2 reader decodes is exactly what a process running schema 1.2 would see.
"""

from __future__ import annotations

import enum
import functools
import itertools
import operator
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, cast

import msgspec

from kvoffload._packed import Buffer, Int32Bytes, Int64Bytes

from .loader import Enum, Field, Schema, Struct, load_schema, member_name
from .render import annotation

__all__ = ["MaterializedSchema", "materialize"]

_COUNTER = itertools.count()


@dataclass(frozen=True)
class MaterializedSchema:
    """The run-time classes of one schema: enums, structs, union aliases and the message table."""

    schema: Schema
    module: types.ModuleType = field(repr=False)
    enums: Mapping[str, type[enum.StrEnum]]
    structs: Mapping[str, type[msgspec.Struct]]
    unions: Mapping[str, object]
    messages: Mapping[int, type[msgspec.Struct]]

    def struct(self, name: str) -> type[msgspec.Struct]:
        """The class of struct `name`; KeyError names the schema version when it does not exist."""
        try:
            return self.structs[name]
        except KeyError:
            raise KeyError(f"schema {self.schema.version} has no struct {name!r}") from None

    def msgpack_decoder(self, name: str) -> msgspec.msgpack.Decoder[msgspec.Struct]:
        """A typed msgpack decoder of struct `name` (packed arrays decode from bin)."""
        return _msgpack_decoder(self.struct(name))

    def json_decoder(self, name: str) -> msgspec.json.Decoder[msgspec.Struct]:
        """A typed JSON decoder of struct `name` (packed arrays decode from lists of integers)."""
        return msgspec.json.Decoder(self.struct(name))

    def decode_message(self, message_id: int, body: Buffer) -> msgspec.Struct:
        """Decode a message body (msgpack, without the envelope) as this schema's message `message_id`."""
        cls = self.messages.get(message_id)
        if cls is None:
            raise KeyError(f"schema {self.schema.version} has no message with id {message_id}")
        return _msgpack_decoder(cls).decode(body)


@functools.lru_cache(maxsize=256)
def _msgpack_decoder(cls: type[msgspec.Struct]) -> msgspec.msgpack.Decoder[msgspec.Struct]:
    return msgspec.msgpack.Decoder(cls)


def materialize(schema: Schema | str | Path) -> MaterializedSchema:
    """Build the classes of `schema` (a loaded Schema or a path to a schema TOML file).

    Every call creates fresh classes in a fresh synthetic module, so several versions of the same schema
    can live side by side in one process.
    """
    if not isinstance(schema, Schema):
        schema = load_schema(schema)
    module_name = f"codegen._materialized.{schema.name}_{schema.version.replace('.', '_')}_{next(_COUNTER)}"
    module = types.ModuleType(module_name, f"Classes materialized from schema {schema.name} {schema.version}.")
    namespace = module.__dict__
    namespace.update({"msgspec": msgspec, "Annotated": Annotated, "Int32Bytes": Int32Bytes, "Int64Bytes": Int64Bytes})
    # Annotations stay strings (as in the generated code) and resolve lazily through this module, which is
    # what lets a union refer to a struct that refers back to the union.
    sys.modules[module_name] = module

    enums = {name: _enum(e, module_name) for name, e in schema.enums.items()}
    namespace.update(enums)
    structs: dict[str, type[msgspec.Struct]] = {}
    for name, s in schema.structs.items():  # the loader orders bases before the structs extending them
        structs[name] = _struct(s, schema, structs, enums, module_name)
    namespace.update(structs)
    unions: dict[str, object] = {
        name: functools.reduce(operator.or_, [structs[m] for m in u.members]) for name, u in schema.unions.items()
    }
    namespace.update(unions)
    messages = {s.message_id: structs[s.name] for s in schema.messages if s.message_id is not None}
    return MaterializedSchema(
        schema=schema, module=module, enums=enums, structs=structs, unions=unions, messages=messages
    )


def _enum(e: Enum, module_name: str) -> type[enum.StrEnum]:
    members = [(member_name(v), v) for v in e.values]
    # A repeated value makes the later name an alias of the earlier member, as in the generated enums.
    members += [(member_name(alias), target) for alias, target in e.aliases]
    # The functional API, which mypy only accepts with a literal name.
    factory = cast(Callable[..., type[enum.StrEnum]], enum.StrEnum)
    cls = factory(e.name, members, module=module_name)
    cls.__doc__ = e.doc or e.name
    return cls


def _struct(
    s: Struct,
    schema: Schema,
    done: Mapping[str, type[msgspec.Struct]],
    enums: Mapping[str, type[enum.StrEnum]],
    module_name: str,
) -> type[msgspec.Struct]:
    specs: list[tuple[str, str] | tuple[str, str, object]] = []
    for name, f in s.declared_fields():
        if f.has_default:
            specs.append((name, annotation(f), _default(f, enums)))
        else:
            specs.append((name, annotation(f)))
    bases = (done[s.extends],) if s.extends is not None else None
    tag_field = schema.unions[s.union].tag_field if s.union is not None else None
    cls = msgspec.defstruct(
        s.name,
        specs,
        bases=bases,
        module=module_name,
        frozen=True,
        kw_only=True,
        forbid_unknown_fields=s.kind == "config",
        array_like=s.layout == "array",
        gc=s.gc,
        tag_field=tag_field,
        tag=s.tag,
        namespace={"MESSAGE_ID": s.message_id} if s.message_id is not None else None,
    )
    cls.__doc__ = s.doc or s.name
    return cls


def _default(f: Field, enums: Mapping[str, type[enum.StrEnum]]) -> object:
    """The run-time default of a field, mirroring `render.default_expr`."""
    value = f.default
    tref = f.type
    if tref.kind == "optional":
        if value == "none":
            return None
        tref = tref.inner
    if tref.kind == "list":
        return ()
    if tref.kind == "map":
        return msgspec.field(default_factory=dict)
    if tref.kind == "array":
        return (Int32Bytes if tref.name == "int32" else Int64Bytes)(b"")
    if tref.kind == "named" and tref.name in enums:
        return enums[tref.name](str(value))
    if tref.kind == "primitive" and tref.name == "float" and isinstance(value, int | float):
        return float(value)
    return value
