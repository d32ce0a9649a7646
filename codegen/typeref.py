"""Parsing of field type expressions: `int`, `T?`, `list<T>`, `map<str,T>`, `array<int64>`, names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PRIMITIVES = frozenset({"bool", "int", "float", "str", "bytes", "json"})
ARRAY_ELEMENTS = frozenset({"int32", "int64"})

Kind = Literal["primitive", "named", "list", "map", "array", "optional"]


@dataclass(frozen=True)
class TypeRef:
    """A parsed type expression; `arg` is the element type of list/map/optional."""

    kind: Kind
    name: str = ""
    arg: TypeRef | None = None

    def __str__(self) -> str:
        if self.kind == "optional":
            return f"{self.inner}?"
        if self.kind == "list":
            return f"list<{self.inner}>"
        if self.kind == "map":
            return f"map<str,{self.inner}>"
        if self.kind == "array":
            return f"array<{self.name}>"
        return self.name

    @property
    def inner(self) -> TypeRef:
        """The element type of a list, map or optional."""
        if self.arg is None:
            raise ValueError(f"type {self} has no element type")
        return self.arg

    def names(self) -> list[str]:
        """Every user-defined type name this expression refers to."""
        if self.kind == "named":
            return [self.name]
        if self.arg is not None:
            return self.arg.names()
        return []


class TypeSyntaxError(ValueError):
    """A type expression does not parse."""


def parse_type(text: str) -> TypeRef:
    """Parse one type expression; raises TypeSyntaxError with the offending text."""
    src = text.replace(" ", "")
    if not src:
        raise TypeSyntaxError("empty type")
    if src.endswith("?"):
        inner = parse_type(src[:-1])
        if inner.kind == "optional":
            raise TypeSyntaxError(f"{text!r}: optional of optional")
        return TypeRef("optional", arg=inner)
    if src.endswith(">"):
        head, sep, rest = src.partition("<")
        if not sep:
            raise TypeSyntaxError(f"{text!r}: unbalanced '>'")
        body = rest[:-1]
        if head == "list":
            return TypeRef("list", arg=parse_type(body))
        if head == "map":
            key, comma, value = body.partition(",")
            if not comma or key != "str":
                raise TypeSyntaxError(f"{text!r}: maps are map<str,T>")
            return TypeRef("map", arg=parse_type(value))
        if head == "array":
            if body not in ARRAY_ELEMENTS:
                raise TypeSyntaxError(f"{text!r}: packed arrays hold int32 or int64")
            return TypeRef("array", name=body)
        raise TypeSyntaxError(f"{text!r}: unknown generic {head!r} (list, map, array)")
    if any(ch in src for ch in "<>,?"):
        raise TypeSyntaxError(f"{text!r}: malformed type")
    if src in PRIMITIVES:
        return TypeRef("primitive", name=src)
    if not src.isidentifier():
        raise TypeSyntaxError(f"{text!r}: not a type name")
    return TypeRef("named", name=src)
