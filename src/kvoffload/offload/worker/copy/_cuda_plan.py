"""How the CUDA backend moves one job's runs, decided on the host with numpy (no device, runs on CPU).

A job's runs (engine offset, host offset, length) are sorted by host offset and merged where both sides
continue, then each run goes one of three ways:

* **DMA**: a run of at least :attr:`Policy.dma_min_bytes` is one ``cudaMemcpyAsync`` between engine memory
  and the pinned host pool (the copy engines move it; a call costs a few µs, so DMA wins for long runs:
  vLLM measured DMA ahead of a copy kernel at 2 MB blocks and behind it at small ones).
* **gather**: shorter runs whose host side forms long stretches (layer-major engines: a block's pages of
  every layer sit side by side in its host slot) are gathered on the device into a staging buffer with one
  index per *row* (``row_bytes``: the gcd of the runs' engine offsets and lengths, a page when pages are
  page-aligned), then each host stretch is one DMA; a load runs it backwards (DMA, then a scatter).
* **tiles**: shorter runs whose host stretches are short too go through the zero-copy kernel
  (:mod:`._cuda_kernel`: the device reads or writes the registered host pool directly, one program per tile
  of at most :attr:`Policy.tile_bytes`), when it loaded and the pool is registered; else through the gather.

The rule, with ``T = dma_min_bytes``: a run of ``>= T`` bytes is a DMA; the other runs use the gather when
their host stretches average ``>= T`` bytes (their DMAs are as long as a DMA run) or there is no kernel, the
kernel otherwise. ``T`` is :data:`DMA_MIN_BYTES`; ``benchmarks/gpu/check.sh`` measures every way at 32 KB,
256 KB and 2 MB pages so that the default can follow the measurement. :class:`Policy` can force one way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvoffload.errors import ConfigError
from kvoffload.offload.worker.copy._runs import merge_runs

__all__ = [
    "DMA_MIN_BYTES",
    "TILE_BYTES",
    "Gather",
    "JobPlan",
    "Policy",
    "Runs",
    "Tiles",
    "element_bytes",
    "host_stretches",
    "plan_job",
    "row_bytes",
    "row_index",
    "sort_runs",
]

DMA_MIN_BYTES = 1 << 20
"""Runs (and average host stretches) of at least this many bytes are DMA copies; shorter ones are gathered
or copied by the kernel. Between vLLM's anchors (DMA ahead at 2 MB, a kernel ahead at small blocks)."""

TILE_BYTES = 32 << 10
"""Bytes one program of the zero-copy kernel moves at most (a power of two times the element size)."""

Mode = Literal["auto", "dma", "gather", "kernel"]
_MODES = ("auto", "dma", "gather", "kernel")


@dataclass(frozen=True)
class Policy:
    """How jobs choose their way: ``auto`` (the rule above) or one way for every run (benchmarks, tests)."""

    mode: Mode = "auto"
    dma_min_bytes: int = DMA_MIN_BYTES
    tile_bytes: int = TILE_BYTES

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ConfigError(f"mode={self.mode!r} must be one of {_MODES}")
        if self.dma_min_bytes < 1:
            raise ConfigError(f"dma_min_bytes={self.dma_min_bytes} must be >= 1")
        if self.tile_bytes < 8 or self.tile_bytes & (self.tile_bytes - 1):
            raise ConfigError(f"tile_bytes={self.tile_bytes} must be a power of two >= 8")


@dataclass(frozen=True)
class Runs:
    """Byte runs sorted by host offset: ``length[i]`` bytes between engine ``engine[i]`` and host ``host[i]``."""

    engine: np.ndarray
    host: np.ndarray
    length: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.length.sum())

    def __len__(self) -> int:
        return int(self.length.size)


@dataclass(frozen=True)
class Gather:
    """Runs moved through a device staging buffer of ``num_bytes`` (the runs back to back in host order).

    Staging row ``k`` (``row_bytes`` wide, viewed as ``element_bytes`` elements) is engine row ``rows[k]``;
    host stretch ``i`` is ``stretch_length[i]`` bytes at host ``stretch_host[i]`` and staging
    ``stretch_staging[i]``: one gather (store) or scatter (load) and one DMA per stretch.
    """

    row_bytes: int
    element_bytes: int
    rows: np.ndarray
    stretch_host: np.ndarray
    stretch_staging: np.ndarray
    stretch_length: np.ndarray
    num_bytes: int


@dataclass(frozen=True)
class Tiles:
    """Runs copied by the zero-copy kernel: tile ``i`` moves ``length[i]`` elements (``element_bytes`` each,
    at most ``tile_elements``) from element ``src[i]`` of the source to element ``dst[i]`` of the destination
    (engine → host for a store, host → engine for a load)."""

    element_bytes: int
    tile_elements: int
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def table(self) -> np.ndarray:
        """The kernel's argument: ``src``, ``dst`` and ``length`` back to back (int64, ``3 * len``)."""
        return np.concatenate([self.src, self.dst, self.length])

    def __len__(self) -> int:
        return int(self.length.size)


@dataclass(frozen=True)
class JobPlan:
    """One job's ways: DMA runs, the gathered runs and the kernel's tiles (each may be empty / None)."""

    dma: Runs
    gather: Gather | None
    tiles: Tiles | None
    num_bytes: int


def sort_runs(engine: np.ndarray, host: np.ndarray, length: np.ndarray) -> Runs:
    """The runs in host order, merged where the engine and the host side both continue."""
    order = np.argsort(host, kind="stable")
    (e, h), n = merge_runs((engine[order], host[order]), length[order])
    return Runs(e, h, n)


def host_stretches(host: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host-contiguous stretches of runs in host order: ``(host start, staging start, length)``, where the
    staging buffer holds the runs back to back."""
    staging = np.cumsum(length) - length
    (h, s), n = merge_runs((host, staging), length)
    return h, s, n


def _gcd(*values: np.ndarray | int) -> int:
    g = 0
    for v in values:
        g = math.gcd(g, int(np.gcd.reduce(v)) if isinstance(v, np.ndarray) and v.size else int(v))
    return g


def element_bytes(*values: np.ndarray | int) -> int:
    """The widest element (8, 4, 2 or 1 bytes) that divides every value (offsets, lengths, addresses)."""
    g = _gcd(*values)
    return next(e for e in (8, 4, 2, 1) if g % e == 0)


def row_bytes(engine: np.ndarray, length: np.ndarray) -> int:
    """Width of the rows a gather indexes: the gcd of the runs' engine offsets and lengths, so every run is
    whole rows of the engine memory viewed as ``(-1, row_bytes)``."""
    return _gcd(engine, length)


def row_index(engine: np.ndarray, length: np.ndarray, width: int) -> np.ndarray:
    """Engine row of every row of the runs, run after run (``engine[i] / width`` and the rows after it)."""
    counts = length // width
    before = np.cumsum(counts) - counts
    total = int(counts.sum())
    index: np.ndarray = np.repeat(engine // width - before, counts) + np.arange(total, dtype=np.int64)
    return index


def _tiles(src: np.ndarray, dst: np.ndarray, length: np.ndarray, element: int, tile_bytes: int) -> Tiles:
    """Runs in bytes cut into tiles of at most ``tile_bytes``, in elements of ``element`` bytes."""
    tile = tile_bytes // element
    src, dst, length = src // element, dst // element, length // element
    pieces = (length + tile - 1) // tile
    owner = np.repeat(np.arange(length.size), pieces)
    skip = (np.arange(owner.size) - (np.cumsum(pieces) - pieces)[owner]) * tile
    return Tiles(element, tile, src[owner] + skip, dst[owner] + skip, np.minimum(length[owner] - skip, tile))


def _gather(runs: Runs, kv_ptr: int) -> Gather:
    width = row_bytes(runs.engine, runs.length)
    sh, ss, sn = host_stretches(runs.host, runs.length)
    return Gather(
        row_bytes=width,
        element_bytes=element_bytes(width, kv_ptr),
        rows=row_index(runs.engine, runs.length, width),
        stretch_host=sh,
        stretch_staging=ss,
        stretch_length=sn,
        num_bytes=runs.num_bytes,
    )


def plan_job(
    engine: np.ndarray,
    host: np.ndarray,
    length: np.ndarray,
    *,
    is_store: bool,
    policy: Policy,
    kernel: bool,
    kv_ptr: int = 0,
    host_ptr: int = 0,
) -> JobPlan:
    """Split a job's runs into DMA runs, a gather and kernel tiles by ``policy`` (module docstring).

    ``kernel``: whether the zero-copy kernel can run now (loaded, and the pool registered); ``kv_ptr`` and
    ``host_ptr``: the addresses of engine byte 0 and host byte 0 (they bound the element size).
    """
    runs = sort_runs(engine, host, length)
    total = runs.num_bytes
    if policy.mode == "kernel" and not kernel:
        raise ConfigError("mode='kernel' needs the zero-copy kernel (Triton) and a registered host pool")
    if policy.mode == "dma":
        direct = np.ones(len(runs), dtype=bool)
    elif policy.mode == "auto":
        direct = runs.length >= policy.dma_min_bytes
    else:
        direct = np.zeros(len(runs), dtype=bool)
    dma = Runs(runs.engine[direct], runs.host[direct], runs.length[direct])
    rest = ~direct
    small = Runs(runs.engine[rest], runs.host[rest], runs.length[rest])
    if not len(small):
        return JobPlan(dma, None, None, total)
    use_kernel = policy.mode == "kernel"
    if policy.mode == "auto" and kernel:
        stretches = host_stretches(small.host, small.length)[2].size
        use_kernel = small.num_bytes < policy.dma_min_bytes * stretches
    if not use_kernel:
        return JobPlan(dma, _gather(small, kv_ptr), None, total)
    element = element_bytes(small.engine, small.host, small.length, kv_ptr, host_ptr)
    src, dst = (small.engine, small.host) if is_store else (small.host, small.engine)
    return JobPlan(dma, None, _tiles(src, dst, small.length, element, policy.tile_bytes), total)
