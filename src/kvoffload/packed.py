"""Packed integer arrays: the `array<int32|int64>` schema type.

On the msgpack wire a packed array is one `bin` value of little-endian integers, so a 128-block job
costs one memcpy instead of 128 Python ints; in JSON it is a plain list of integers. In Python it is an
immutable sequence backed by a buffer: `memoryview` gives a typed view and `to_tensor` wraps it for torch
without copying when the buffer is writable.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar, Literal, Self, SupportsIndex, overload

if TYPE_CHECKING:
    import torch

__all__ = [
    "Int32Array",
    "Int64Array",
    "PackedIntArray",
    "json_dec_hook",
    "json_enc_hook",
    "json_schema_hook",
    "msgpack_dec_hook",
    "msgpack_enc_hook",
]

_LITTLE = sys.byteorder == "little"
BufferLike = bytes | bytearray | memoryview


class PackedIntArray:
    """Base of the fixed-width packed integer arrays; immutable, hashable, comparable."""

    __slots__ = ("_view",)
    _code: ClassVar[Literal["i", "q"]]
    _itemsize: ClassVar[int]
    _torch_dtype: ClassVar[str]
    _min: ClassVar[int]
    _max: ClassVar[int]

    _view: memoryview[int]

    def __init__(self, values: Iterable[int] = ()) -> None:
        """Pack integers; raises OverflowError/TypeError naming the value that does not fit."""
        if not isinstance(values, list | tuple | range):
            values = list(values)
        try:
            packed = array.array(self._code, values)
        except OverflowError:
            bad = next((v for v in values if not self._min <= v <= self._max), None)
            raise OverflowError(
                f"{type(self).__name__}: value {bad} is outside [{self._min}, {self._max}]"
            ) from None
        except TypeError as exc:
            raise TypeError(f"{type(self).__name__} holds integers only: {exc}") from None
        self._view = memoryview(packed)

    @classmethod
    def from_buffer(cls, buffer: BufferLike) -> Self:
        """View little-endian wire bytes as an array (zero-copy on little-endian hosts)."""
        raw = memoryview(buffer).cast("B")
        if raw.nbytes % cls._itemsize:
            raise ValueError(
                f"{cls.__name__}: buffer of {raw.nbytes} bytes is not a multiple of {cls._itemsize}"
            )
        self = cls.__new__(cls)
        if _LITTLE:
            self._view = raw.cast(cls._code)
        else:
            swapped = array.array(cls._code, raw.tobytes())
            swapped.byteswap()
            self._view = memoryview(swapped)
        return self

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Self:
        """Copy a 1-D integer tensor (any device) into a new array."""
        import torch

        flat = tensor.detach().reshape(-1)
        out = bytearray(flat.numel() * cls._itemsize)
        if out:
            torch.frombuffer(out, dtype=getattr(torch, cls._torch_dtype)).copy_(flat)
        return cls.from_buffer(out)

    def to_tensor(self) -> torch.Tensor:
        """A torch view of the array (zero-copy when the buffer is writable, else one copy)."""
        import torch

        dtype = getattr(torch, self._torch_dtype)
        if len(self) == 0:
            return torch.empty(0, dtype=dtype)
        view = self._view if not self._view.readonly else memoryview(bytearray(self._view.cast("B")))
        return torch.frombuffer(view, dtype=dtype)

    @property
    def memoryview(self) -> memoryview:
        """Typed read-only memoryview (format 'i' or 'q')."""
        return self._view.toreadonly()

    @property
    def nbytes(self) -> int:
        """Payload size in bytes."""
        return self._view.nbytes

    def tobytes(self) -> bytes:
        """Little-endian wire bytes."""
        if _LITTLE:
            return self._view.tobytes()
        swapped = array.array(self._code, self._view.tobytes())
        swapped.byteswap()
        return swapped.tobytes()

    def tolist(self) -> list[int]:
        """The values as Python ints."""
        return self._view.tolist()

    def __len__(self) -> int:
        return len(self._view)

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Self: ...
    def __getitem__(self, index: SupportsIndex | slice) -> int | Self:
        if isinstance(index, slice):
            out = type(self).__new__(type(self))
            out._view = self._view[index]
            return out
        value: int = self._view[index]
        return value

    def __iter__(self) -> Iterator[int]:
        return iter(self._view.tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedIntArray) or type(other) is not type(self):
            return NotImplemented
        return self._view == other._view

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._view.tobytes()))

    def __repr__(self) -> str:
        values = self._view.tolist()
        shown = ", ".join(map(str, values[:8])) + (", ..." if len(values) > 8 else "")
        return f"{type(self).__name__}([{shown}])"

    def __reduce__(self) -> tuple[type[Self], tuple[list[int]]]:
        return (type(self), (self.tolist(),))


class Int32Array(PackedIntArray):
    """Packed signed 32-bit integers (`array<int32>`)."""

    __slots__ = ()
    _code = "i"
    _itemsize = 4
    _torch_dtype = "int32"
    _min = -(2**31)
    _max = 2**31 - 1


class Int64Array(PackedIntArray):
    """Packed signed 64-bit integers (`array<int64>`)."""

    __slots__ = ()
    _code = "q"
    _itemsize = 8
    _torch_dtype = "int64"
    _min = -(2**63)
    _max = 2**63 - 1


for _cls in (Int32Array, Int64Array):
    if array.array(_cls._code).itemsize != _cls._itemsize:  # pragma: no cover - exotic platforms
        raise ImportError(f"array code {_cls._code!r} is not {_cls._itemsize} bytes on this platform")


def msgpack_enc_hook(obj: object) -> object:
    """msgspec enc_hook: packed arrays become one msgpack bin value."""
    if isinstance(obj, PackedIntArray):
        # On little-endian hosts the typed view's buffer already is the wire bytes; msgspec writes it as is.
        return obj._view if _LITTLE else obj.tobytes()
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


def json_enc_hook(obj: object) -> object:
    """msgspec enc_hook: packed arrays become JSON lists of integers."""
    if isinstance(obj, PackedIntArray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


_WIRE_CODES: dict[type, Literal["i", "q"]] = {Int32Array: "i", Int64Array: "q"} if _LITTLE else {}
"""Exact array types whose wire bytes can be viewed as is (the decode fast path, per array on the wire)."""


def msgpack_dec_hook(tp: type, obj: object) -> object:
    """msgspec dec_hook: build a packed array from a msgpack bin value."""
    code = _WIRE_CODES.get(tp)
    if code is not None and type(obj) is bytes:
        # Fast path of `from_buffer` (msgspec hands over a fresh bytes object): one view, no checks to repeat.
        packed: PackedIntArray = object.__new__(tp)
        try:
            packed._view = memoryview(obj).cast(code)
        except TypeError:
            raise ValueError(
                f"{tp.__name__}: buffer of {len(obj)} bytes is not a multiple of {packed._itemsize}"
            ) from None
        return packed
    if tp is object:
        return obj  # `json` schema fields: any decoded value
    if isinstance(tp, type) and issubclass(tp, PackedIntArray):
        if isinstance(obj, bytes | bytearray | memoryview):
            return tp.from_buffer(obj)
        raise TypeError(f"Expected `bytes` for {tp.__name__}, got `{type(obj).__name__}`")
    raise NotImplementedError(f"cannot decode type {tp!r}")


def json_dec_hook(tp: type, obj: object) -> object:
    """msgspec dec_hook: build a packed array from a JSON list of integers."""
    if tp is object:
        return obj  # `json` schema fields: any decoded value
    if isinstance(tp, type) and issubclass(tp, PackedIntArray):
        if isinstance(obj, list) and all(type(v) is int for v in obj):
            return tp(obj)
        raise TypeError(f"Expected `array of int` for {tp.__name__}")
    raise NotImplementedError(f"cannot decode type {tp!r}")


def json_schema_hook(tp: type) -> dict[str, object]:
    """msgspec schema_hook: packed arrays are JSON arrays of integers in range; `json` is anything."""
    if tp is object:
        return {"description": "any JSON value"}
    if isinstance(tp, type) and issubclass(tp, PackedIntArray):
        return {"type": "array", "items": {"type": "integer", "minimum": tp._min, "maximum": tp._max}}
    raise NotImplementedError(f"no JSON schema for {tp!r}")
