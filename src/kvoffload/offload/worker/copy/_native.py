"""The optional native copy kernel (``csrc/kvcopy.c``, built by ``setup.py``), loaded with ctypes.

One call (:meth:`NativeKernel.job`, or :meth:`NativeKernel.job_blocks` for a job given as blocks) runs a whole
job without the GIL: it orders the runs and sub-blocks by host offset, shares the job with the helper threads of
a :class:`NativePool`, hashes every sub-block while its bytes pass through the copy loop and seals or verifies
it in the pool's integrity table. The kernel's engine (``csrc/kvcopy_engine.c``, :mod:`._cpu_native`) queues
such jobs to C threads of its own. Without the built library (no C compiler at install time) or with
``KVOFFLOAD_NATIVE_COPY=0`` in the environment, :data:`KERNEL` is None and the CPU backend uses its pure-Python
path, with the same results.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvoffload._placement import TransferLayout
from kvoffload.errors import ConfigError

__all__ = [
    "FUSED",
    "KERNEL",
    "KERNEL_ENV",
    "SEAL",
    "STATS",
    "STREAM",
    "VERIFY",
    "NativeKernel",
    "NativeLayout",
    "NativePool",
    "TableUpdate",
    "kernel_name",
    "load_kernel",
    "load_kernels",
    "measure_kernel",
    "pick_kernel",
]

_ABI_VERSION = 4
_BUILDS = (("_kvcopy_avx512", "kvcopy_cpu_has_avx512"), ("_kvcopy_avx2", "kvcopy_cpu_has_avx2"))
"""The wider builds, widest first, each with the baseline build's probe saying whether this CPU can run it."""
_I64P = ctypes.POINTER(ctypes.c_int64)
_U8P = ctypes.POINTER(ctypes.c_uint8)
_U64P = ctypes.POINTER(ctypes.c_uint64)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p

FUSED = 1
"""Job flag: hash in the copy loop (without it: copy, then hash from memory, the loop for overlapping runs)."""
STREAM = 2
"""Job flag: non-temporal stores (builds with vector registers; for jobs much larger than the cache)."""
SEAL = 4
"""Job flag: seal the slots in the integrity table once the copies are done (a store)."""
VERIFY = 8
"""Job flag: verify the slots against the integrity table once the copies are done (a load)."""


@dataclass(frozen=True)
class TableUpdate:
    """What :meth:`NativeKernel.job` does with the pool's integrity table after the copies: slot ``j``'s entry
    ``entries[j]`` (rows of int64 ``(tag, checksum, state)`` at ``address``) is sealed with ``tags[j]``, the
    slot's digest (with digests) and ``state`` (``SEAL``), or verified against them (``VERIFY``: ``bad[j]`` is
    set when the state is below ``state`` or the tag or digest differs)."""

    address: int
    entries: np.ndarray  # int64
    tags: np.ndarray  # int64
    state: int
    bad: np.ndarray | None = None  # uint8, for VERIFY


_STAT_NAMES = """
enter_ns planned_ns caller_done_ns exit_ns granules mode stream participants
caller_fused caller_plain caller_memhash caller_busy_ns caller_granules caller_takes
helper_fused helper_plain helper_memhash helper_busy_ns helper_granules helper_takes helper_first_ns helper_last_ns
"""
STATS = tuple(_STAT_NAMES.split())
"""What :meth:`NativeKernel.job` writes into ``stats`` (int64 each; ``*_ns``: CLOCK_MONOTONIC, the clock of
``time.perf_counter_ns`` on Linux). ``mode``: 0 nothing hashed, 1 hashed in the copy loop, 2 copied then hashed
(a store with overlapping runs); ``fused``/``plain``/``memhash``: bytes copied while hashed, copied alone,
hashed from memory; ``granules``/``takes``: pieces of the job and how many times a thread took some."""


@dataclass(frozen=True)
class NativeLayout:
    """A transfer layout's segments as :meth:`NativeKernel.job_blocks` takes them (built once per engine): rows
    of ``(engine offset, engine block stride, length, offset in the sub-block)``, group ``g``'s from
    ``seg_start[g]`` to ``seg_start[g + 1]`` in sub-block order, and each group's sub-block bytes."""

    seg_start: np.ndarray
    segs: np.ndarray
    group_bytes: np.ndarray
    addresses: tuple[int, int, int]  # of the three arrays (they never move)

    @classmethod
    def of(cls, layout: TransferLayout) -> NativeLayout:
        tables = [g.segment_table[np.argsort(g.segment_table[:, 3], kind="stable")] for g in layout.groups]
        counts = [0] + [t.shape[0] for t in tables]
        segs = np.ascontiguousarray(np.concatenate(tables) if tables else np.zeros((0, 4)), dtype=np.int64)
        seg_start = np.cumsum(counts, dtype=np.int64)
        group_bytes = np.array([g.bytes_per_block for g in layout.groups], dtype=np.int64)
        addresses = (seg_start.ctypes.data, segs.ctypes.data, group_bytes.ctypes.data)
        return cls(seg_start, segs, group_bytes, addresses)


def _ptr(array: np.ndarray, kind: type[ctypes._Pointer[ctypes.c_int64]]) -> ctypes._Pointer[ctypes.c_int64]:
    return array.ctypes.data_as(kind)


class NativeKernel:
    """The loaded library: :meth:`job`, :meth:`copy` and :meth:`copy_hash` over int64 arrays."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.lib = lib
        self.vector_width = int(lib.kvcopy_vector_width())
        """2: AVX-512F, 1: AVX2 (hash in registers, can stream), 0: the portable loop."""
        if int(lib.kvcopy_stat_count()) != len(STATS):
            raise OSError(f"{path.name}: {lib.kvcopy_stat_count()} job stats, expected {len(STATS)}")
        self._copy = lib.kvcopy_copy
        self._copy.argtypes = [_I64, _I64P, _I64P, _I64P]
        self._copy.restype = None
        self._copy_hash = lib.kvcopy_copy_hash
        self._copy_hash.argtypes = [_I64, _I64P, _I64P, _I64P, _I64P, _I64, _I64P, _I64P, _I64P, _I64, _U8P, _U64P]
        self._copy_hash.restype = ctypes.c_int
        self._job = lib.kvcopy_job
        self._job.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64]
        self._job.argtypes += [_PTR, _PTR, _PTR, _I64, _PTR, _PTR]
        self._job.restype = ctypes.c_int64
        self._job_blocks = lib.kvcopy_job_blocks
        self._job_blocks.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR]
        self._job_blocks.argtypes += [_I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR]
        self._job_blocks.restype = ctypes.c_int64
        self._pool_new = lib.kvcopy_pool_new
        self._pool_new.argtypes = [ctypes.c_int]
        self._pool_new.restype = _PTR
        self._pool_free = lib.kvcopy_pool_free
        self._pool_free.argtypes = [_PTR]
        self._pool_free.restype = None
        self._pool_helpers = lib.kvcopy_pool_helpers
        self._pool_helpers.argtypes = [_PTR]
        self._pool_helpers.restype = ctypes.c_int
        self._xxh3 = lib.kvcopy_xxh3_64
        self._xxh3.argtypes = [ctypes.c_void_p, _I64]
        self._xxh3.restype = ctypes.c_uint64

    def job(
        self,
        pool: NativePool | None,
        runs: tuple[np.ndarray, np.ndarray, np.ndarray],
        slots: tuple[np.ndarray, np.ndarray] | None,
        *,
        is_store: bool,
        kv_base: int,
        host_base: int,
        digests: np.ndarray | None,
        flags: int = FUSED,
        granule: int = 0,
        table: TableUpdate | None = None,
        stats: np.ndarray | None = None,
    ) -> int:
        """Copy a job's ``runs`` (engine offset, host offset, length; any order) between the memory at
        ``kv_base`` and at ``host_base`` (engine -> host for a store) and, with ``digests`` (uint64, one per
        slot), write the xxh3_64 of each of ``slots`` (host offset, size; any order) into it, as the bytes pass
        through the copy loop; then seal or verify the slots in ``table`` (flags ``SEAL`` / ``VERIFY``).
        ``pool`` lends helper threads to a job of more than ``granule`` bytes (0: this thread alone); ``stats``
        (int64, ``len(STATS)``) receives the job's timings. Returns how many slots failed verification. One
        call, without the GIL from start to end; see ``csrc/kvcopy.c``."""
        engine, host, length = runs
        n = _same_size(engine, host, length)
        first, size = slots if slots is not None else (None, None)
        k = _same_size(first, size) if first is not None and size is not None else 0
        if digests is not None and slots is None:
            raise ConfigError("digests without slots")
        tail = _checked_tail(k, digests, flags, granule, table, stats)
        args = (n, _address(engine), _address(host), _address(length), k, _address(first), _address(size))
        return _status(self._job(_handle(pool), *args, int(is_store), kv_base, host_base, *tail))

    def job_blocks(
        self,
        pool: NativePool | None,
        layout: NativeLayout,
        blocks: tuple[np.ndarray, np.ndarray, np.ndarray],
        *,
        is_store: bool,
        kv_base: int,
        host_base: int,
        digests: np.ndarray | None,
        flags: int = FUSED,
        granule: int = 0,
        table: TableUpdate | None = None,
        stats: np.ndarray | None = None,
    ) -> int:
        """:meth:`job` for a job given as ``blocks`` (group, engine block id, host byte of the sub-block; int64
        each): block ``i`` moves along its group's segments of ``layout`` and slot ``i`` is its sub-block (the
        kernel builds the runs, in host order; a store naming a sub-block twice keeps the later block's bytes).
        The ids must be in range (the engine checked them). Returns how many slots failed verification."""
        groups, engine, host = blocks
        k = _same_size(groups, engine, host)
        tail = _checked_tail(k, digests, flags, granule, table, stats)
        args = (k, _address(groups), _address(engine), _address(host), layout.group_bytes.size, *layout.addresses)
        return _status(self._job_blocks(_handle(pool), *args, int(is_store), kv_base, host_base, *tail))

    def pool(self, helpers: int) -> NativePool | None:
        """A pool of ``helpers`` threads for :meth:`job`, or None when ``helpers < 1`` or none could start."""
        if helpers < 1:
            return None
        try:
            return NativePool(self, helpers)
        except OSError:
            return None  # no threads to be had: jobs run on the calling thread

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
        each stretch of a slot from memory right after the runs below its end were copied (one thread; what
        :meth:`job` does for a store whose runs overlap); see ``csrc/kvcopy.c``."""
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


class NativePool:
    """Helper threads of the native kernel (C threads, they never take the GIL), for the jobs of one backend.

    Jobs of several threads may share a pool; :meth:`close` (or garbage collection) stops the threads and must
    not run while a job does."""

    def __init__(self, kernel: NativeKernel, helpers: int) -> None:
        handle = kernel._pool_new(helpers)
        if not handle:
            raise OSError(f"could not start {helpers} copy helper threads")
        self.handle: int | None = handle
        self.helpers = int(kernel._pool_helpers(handle))
        self._finalizer = weakref.finalize(self, kernel._pool_free, handle)
        self._finalizer.atexit = False  # at exit a daemon thread may still be in a job: leave the threads be

    def close(self) -> None:
        """Stop and join the helper threads (idempotent)."""
        self.handle = None
        self._finalizer()


def _handle(pool: NativePool | None) -> int | None:
    return pool.handle if pool is not None else None


def _address(array: np.ndarray | None) -> int | None:
    return int(array.ctypes.data) if array is not None else None


def _checked_tail(
    k: int, digests: np.ndarray | None, flags: int, granule: int, table: TableUpdate | None, stats: np.ndarray | None
) -> tuple[int | None, ...]:
    """The job arguments after the bases (digests ... stats), checked against ``k`` slots."""
    if digests is not None and (digests.dtype != np.uint64 or not digests.flags.c_contiguous or digests.size != k):
        raise ConfigError(f"digests must be {k} contiguous uint64 (one per slot)")
    if stats is not None and (stats.dtype != np.int64 or not stats.flags.c_contiguous or stats.size < len(STATS)):
        raise ConfigError(f"stats must be {len(STATS)} contiguous int64")
    if table is None:
        return (_address(digests), flags, granule, None, None, None, 0, None, _address(stats))
    bad = table.bad
    if _same_size(table.entries, table.tags) != k or (flags & VERIFY and (bad is None or bad.dtype != np.uint8)):
        raise ConfigError(f"the table update needs {k} entries and tags (and uint8 bad flags to verify)")
    if bad is not None and (bad.size != k or not bad.flags.c_contiguous):
        raise ConfigError(f"bad flags must be {k} contiguous uint8")
    entries, tags, state = _address(table.entries), _address(table.tags), table.state
    return (_address(digests), flags, granule, table.address, entries, tags, state, _address(bad), _address(stats))


def _status(status: int) -> int:
    if status < 0:
        raise ConfigError("negative run or slot offsets or lengths" if status == -1 else "out of memory")
    return int(status)


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


KERNEL_ENV = "KVOFFLOAD_COPY_KERNEL"
"""Names the kernel to use (``avx512``, ``avx2`` or ``baseline``) instead of the measured pick."""
_NAMES = {"_kvcopy_avx512": "avx512", "_kvcopy_avx2": "avx2", "_kvcopy": "baseline"}
_PROBE_BYTES, _PROBE_RUN, _PROBE_REPEATS = 1 << 20, 64 << 10, 5


def kernel_name(kernel: NativeKernel) -> str:
    """``avx512``, ``avx2`` or ``baseline``: which build ``kernel`` is."""
    return _NAMES[kernel.path.name.split(".")[0]]


def measure_kernel(kernel: NativeKernel, nbytes: int = _PROBE_BYTES, repeats: int = _PROBE_REPEATS) -> float:
    """Seconds (best of ``repeats``) ``kernel`` takes to copy ``nbytes`` in 64 KiB runs while hashing them, on
    one thread: what a checksummed store costs per byte, measured on this CPU."""
    src = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    starts = np.arange(0, nbytes, _PROBE_RUN, dtype=np.int64)
    lengths = np.minimum(_PROBE_RUN, nbytes - starts).astype(np.int64)
    runs = (starts + dst.ctypes.data, starts + src.ctypes.data, lengths, starts.copy())
    slots = (starts.copy(), lengths.copy(), np.arange(len(starts), dtype=np.int64))
    digests = np.empty(len(starts), dtype=np.uint64)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernel.copy_hash(runs, slots, _PROBE_RUN, dst.ctypes.data, digests)
        best = min(best, time.perf_counter() - start)
    return best


def pick_kernel(kernels: list[NativeKernel], seconds: list[float]) -> NativeKernel:
    """The kernel that measured fastest; on a tie the narrower build (it keeps the CPU's clocks up)."""
    if not kernels or len(kernels) != len(seconds):
        raise ConfigError(f"pick_kernel needs one time per kernel, got {len(seconds)} for {len(kernels)}")
    fastest = min(seconds)
    return [k for k, s in zip(kernels, seconds, strict=True) if s <= fastest * 1.02][-1]


def load_kernel() -> NativeKernel | None:
    """The kernel this process copies with: the built one this CPU runs fastest, by a short measurement (a
    millisecond or so per build: the widest build is not the fastest on every CPU), or the one
    :data:`KERNEL_ENV` names; None when none was built or native copies are turned off."""
    kernels = load_kernels()
    wanted = os.environ.get(KERNEL_ENV, "").strip().lower()
    if wanted:
        named = [k for k in kernels if kernel_name(k) == wanted]
        if not named:
            have = ", ".join(kernel_name(k) for k in kernels) or "none"
            raise ConfigError(f"{KERNEL_ENV}={wanted!r} is not a kernel built for this CPU (built: {have})")
        return named[0]
    if len(kernels) < 2:
        return kernels[0] if kernels else None
    return pick_kernel(kernels, [measure_kernel(k) for k in kernels])


KERNEL: NativeKernel | None = load_kernel()
"""The kernel this process uses (None: the pure-Python path)."""
