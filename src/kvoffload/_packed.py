"""Packed integer arrays: the `array<int32|int64>` schema type.

On the wire a packed array is one msgpack `bin` value of little-endian integers, so a 128-block job costs
one memcpy instead of 128 Python ints. In generated structs the field is typed `Int32Bytes` / `Int64Bytes`:
`NewType`s of `bytes` that msgspec decodes natively (no per-array Python hook, which is what makes a step
plan round trip ~20x cheaper than pickle), while mypy keeps int32 and int64 payloads apart.

Build them with :func:`pack_int32` / :func:`pack_int64` (from ints or a tensor); read them through the typed
zero-copy views :class:`Int32Array` / :class:`Int64Array` (`Int64Array.from_buffer(job.block_ids)`), which
also give `tolist()` and a torch view. In JSON a packed array is base64, like any bytes.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar, Literal, NewType, Self, SupportsIndex, overload

from kvoffload.errors import ArgumentTypeError, ValueOverflowError, WireError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Buffer",
    "Int32Array",
    "Int32Bytes",
    "Int64Array",
    "Int64Bytes",
    "PackedIntArray",
    "json_schema_hook",
    "pack_int32",
    "pack_int64",
    "unpack_int32",
    "unpack_int64",
]

Int32Bytes = NewType("Int32Bytes", bytes)
"""Little-endian packed int32 values: the Python type of an `array<int32>` field."""

Int64Bytes = NewType("Int64Bytes", bytes)
"""Little-endian packed int64 values: the Python type of an `array<int64>` field."""

Buffer = bytes | bytearray | memoryview
"""Any contiguous bytes-like object kvoffload reads: wire frames, packed arrays, codec input, tier records."""

_LITTLE = sys.byteorder == "little"


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
        """Pack integers; raises ValueOverflowError/ArgumentTypeError (OverflowError/TypeError) naming the value."""
        if not isinstance(values, list | tuple | range):
            values = list(values)
        try:
            packed = array.array(self._code, values)
        except OverflowError:
            bad = next((v for v in values if not self._min <= v <= self._max), None)
            raise ValueOverflowError(
                f"{type(self).__name__}: value {bad} is outside [{self._min}, {self._max}]"
            ) from None
        except TypeError as exc:
            raise ArgumentTypeError(f"{type(self).__name__} holds integers only: {exc}") from None
        self._view = memoryview(packed)

    @classmethod
    def from_buffer(cls, buffer: Buffer) -> Self:
        """View little-endian wire bytes as an array (zero-copy on little-endian hosts)."""
        raw = memoryview(buffer).cast("B")
        if raw.nbytes % cls._itemsize:
            raise WireError(f"{cls.__name__}: buffer of {raw.nbytes} bytes is not a multiple of {cls._itemsize}")
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


def _pack(cls: type[PackedIntArray], values: Iterable[int] | torch.Tensor) -> bytes:
    torch_mod = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    if torch_mod is not None and isinstance(values, torch_mod.Tensor):
        return cls.from_tensor(values).tobytes()
    return cls(values).tobytes()


def pack_int32(values: Iterable[int] | torch.Tensor) -> Int32Bytes:
    """Pack ints (or a 1-D integer tensor) for an `array<int32>` field; OverflowError names a value out of range."""
    return Int32Bytes(_pack(Int32Array, values))


def pack_int64(values: Iterable[int] | torch.Tensor) -> Int64Bytes:
    """Pack ints (or a 1-D integer tensor) for an `array<int64>` field; OverflowError names a value out of range."""
    return Int64Bytes(_pack(Int64Array, values))


def unpack_int32(data: Buffer) -> list[int]:
    """The values of an `array<int32>` field as Python ints (WireError if the length is not a multiple of 4)."""
    return Int32Array.from_buffer(data).tolist()


def unpack_int64(data: Buffer) -> list[int]:
    """The values of an `array<int64>` field as Python ints (WireError if the length is not a multiple of 8)."""
    return Int64Array.from_buffer(data).tolist()


def json_schema_hook(tp: type) -> dict[str, object]:
    """msgspec schema_hook: `json` schema fields (Python `object`) accept any JSON value."""
    if tp is object:
        return {"description": "any JSON value"}
    raise NotImplementedError(f"no JSON schema for {tp!r}")
