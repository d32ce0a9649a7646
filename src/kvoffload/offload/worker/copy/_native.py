"""The optional native copy kernel (``csrc/kvcopy.c``, built by ``setup.py``), loaded with ctypes.

One call copies a whole share of a job and hashes its sub-blocks while they are in cache, without the GIL:
no Python runs between pages. Without the built library (no C compiler at install time) or with
``KVOFFLOAD_NATIVE_COPY=0`` in the environment, :data:`KERNEL` is None and the CPU backend uses its pure-Python
path, with the same results.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

import numpy as np

from kvoffload.errors import ConfigError

__all__ = ["KERNEL", "NativeKernel", "load_kernel", "load_kernels"]

_ABI_VERSION = 3
_BUILDS = (("_kvcopy_avx512", "kvcopy_cpu_has_avx512"), ("_kvcopy_avx2", "kvcopy_cpu_has_avx2"))
"""The wider builds, widest first, each with the baseline build's probe saying whether this CPU can run it."""
_I64P = ctypes.POINTER(ctypes.c_int64)
_U8P = ctypes.POINTER(ctypes.c_uint8)
_U64P = ctypes.POINTER(ctypes.c_uint64)
_I64 = ctypes.c_int64


def _ptr(array: np.ndarray, kind: type[ctypes._Pointer[ctypes.c_int64]]) -> ctypes._Pointer[ctypes.c_int64]:
    return array.ctypes.data_as(kind)


class NativeKernel:
    """The loaded library: :meth:`copy` and :meth:`copy_hash` over int64 arrays of absolute addresses."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._copy = lib.kvcopy_copy
        self._copy.argtypes = [_I64, _I64P, _I64P, _I64P]
        self._copy.restype = None
        self._copy_hash = lib.kvcopy_copy_hash
        self._copy_hash.argtypes = [_I64, _I64P, _I64P, _I64P, _I64P, _I64, _I64P, _I64P, _I64P, _I64, _U8P, _U64P]
        self._copy_hash.restype = ctypes.c_int
        self._xxh3 = lib.kvcopy_xxh3_64
        self._xxh3.argtypes = [ctypes.c_void_p, _I64]
        self._xxh3.restype = ctypes.c_uint64

    def copy(self, dst: np.ndarray, src: np.ndarray, length: np.ndarray) -> None:
        """``memmove`` each run: ``dst[i] <- src[i]``, ``length[i]`` bytes (int64 arrays of equal size)."""
        n = _same_size(dst, src, length)
        self._copy(n, _ptr(dst, _I64P), _ptr(src, _I64P), _ptr(length, _I64P))

    def copy_hash(
        self,
        runs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        slots: tuple[np.ndarray, np.ndarray, np.ndarray],
        stretch: int,
        base: int,
        digests: np.ndarray,
    ) -> None:
        """Copy ``runs`` (dst, src, length, host offset; sorted by host offset) and hash ``slots`` (first,
        size, digest index; sorted by first) of the host memory at address ``base`` into ``digests`` (uint64),
        each stretch of a slot right after the runs below its end were copied; see ``csrc/kvcopy.c``."""
        dst, src, length, host = runs
        first, size, index = slots
        n = _same_size(dst, src, length, host)
        k = _same_size(first, size, index)
        if digests.dtype != np.uint64 or not digests.flags.c_contiguous:
            raise ConfigError(f"digests must be contiguous uint64, got {digests.dtype}")
        if k and (int(index.min()) < 0 or int(index.max()) >= digests.size):
            raise ConfigError(f"slot digest indices outside [0, {digests.size})")
        status = self._copy_hash(
            n,
            _ptr(dst, _I64P),
            _ptr(src, _I64P),
            _ptr(length, _I64P),
            _ptr(host, _I64P),
            k,
            _ptr(first, _I64P),
            _ptr(size, _I64P),
            _ptr(index, _I64P),
            stretch,
            ctypes.cast(base, _U8P),
            digests.ctypes.data_as(_U64P),
        )
        if status != 0:
            raise ConfigError("runs or slots are not sorted by host offset, or stretch is not positive")

    def xxh3_64(self, address: int, size: int) -> int:
        """xxh3_64 of ``size`` bytes at ``address`` (the same digest as ``xxhash.xxh3_64_intdigest``)."""
        return int(self._xxh3(address, size))


def _same_size(*arrays: np.ndarray) -> int:
    sizes = {a.size for a in arrays}
    if len(sizes) != 1:
        raise ConfigError(f"arrays of different sizes {sorted(sizes)}")
    for a in arrays:
        if a.dtype != np.int64 or not a.flags.c_contiguous:
            raise ConfigError(f"expected contiguous int64 arrays, got {a.dtype}")
    return sizes.pop()


def _library(name: str) -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{name}{suffix}"
        if path.exists():
            return path
    return None


def load_kernels() -> list[NativeKernel]:
    """Every built kernel this CPU can run, widest first (AVX-512F, AVX2, baseline); empty when none was built
    or ``KVOFFLOAD_NATIVE_COPY=0``. The tests run each against the reference."""
    if os.environ.get("KVOFFLOAD_NATIVE_COPY", "1") == "0":
        return []
    base_path = _library("_kvcopy")
    if base_path is None:
        return []
    try:
        base = ctypes.CDLL(str(base_path))
        if int(base.kvcopy_abi_version()) != _ABI_VERSION:
            return []
        kernels = []
        for name, probe in _BUILDS:
            path = _library(name)
            if path is not None and int(getattr(base, probe)()):
                lib = ctypes.CDLL(str(path))
                if int(lib.kvcopy_abi_version()) == _ABI_VERSION:
                    kernels.append(NativeKernel(lib, path))
        return [*kernels, NativeKernel(base, base_path)]
    except (OSError, AttributeError):
        return []


def load_kernel() -> NativeKernel | None:
    """The widest built kernel this CPU can run (AVX-512F, else AVX2, else the baseline), or None (not built,
    or turned off)."""
    kernels = load_kernels()
    return kernels[0] if kernels else None


KERNEL: NativeKernel | None = load_kernel()
"""The kernel this process uses (None: the pure-Python path)."""
