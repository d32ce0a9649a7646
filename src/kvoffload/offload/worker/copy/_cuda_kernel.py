"""The optional zero-copy kernel (Triton): one launch copies every tile of a job between engine memory and
the registered host pool, which the device reads or writes directly over the bus (no staging, no DMA calls).

It is what makes small pages fast (vLLM's copy kernel, SGLang HiCache's and LMCache's gather kernels): one
launch instead of one ``cudaMemcpyAsync`` per page. The host pool must be registered (``cudaHostRegister``
with the mapped flag, :class:`~kvoffload.offload.pool.HostPool` does it in the background): Triton turns the
host address of the pool into its device address and refuses an unregistered one. Without Triton the
module's :func:`load_kernel` returns None and the backend gathers through staging instead.

``load_kernel(interpret=True)`` runs the same kernel in Triton's interpreter on CPU tensors (the tests).
"""

# mypy: disable-error-code="no-untyped-def,import-untyped"

from __future__ import annotations

import threading
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the backend falls back to the gather
    triton = None

__all__ = ["TileKernel", "load_kernel"]

_WARPS = 8


def _copy_tiles(dst, src, table, num_tiles, TILE: tl.constexpr):
    """Program ``p`` copies ``table[2T + p]`` elements from ``src + table[p]`` to ``dst + table[T + p]``."""
    p = tl.program_id(0).to(tl.int64)
    s = tl.load(table + p)
    d = tl.load(table + num_tiles + p)
    n = tl.load(table + 2 * num_tiles + p)
    offsets = tl.arange(0, TILE)
    mask = offsets < n
    tl.store(dst + d + offsets, tl.load(src + s + offsets, mask=mask), mask=mask)


class TileKernel:
    """A compiled (or interpreted) :func:`_copy_tiles`; launches on the current torch stream.

    Launches are serialized by a lock (both directions' lanes launch; a launch only enqueues, so the lock is
    held for microseconds): Triton's first call compiles, and its interpreter patches ``triton.language``
    while it runs, neither of which is safe to do from two threads at once.
    """

    def __init__(self, interpret: bool = False) -> None:
        if triton is None:
            raise ImportError("Triton is not installed")
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            self._fn: Any = InterpretedFunction(_copy_tiles)
        else:
            self._fn = triton.jit(_copy_tiles)
        self.interpret = interpret
        self._lock = threading.Lock()

    def __call__(
        self, dst: torch.Tensor, src: torch.Tensor, table: torch.Tensor, num_tiles: int, tile_elements: int
    ) -> None:
        """Copy ``num_tiles`` tiles described by ``table`` (int64, on the device) from ``src`` to ``dst``
        (tensors of one element type; either may be a registered host tensor)."""
        if num_tiles:
            with self._lock:
                self._fn[(num_tiles,)](dst, src, table, num_tiles, TILE=tile_elements, num_warps=_WARPS)


def load_kernel(interpret: bool = False) -> TileKernel | None:
    """The kernel, or None where Triton is not installed."""
    try:
        return TileKernel(interpret)
    except ImportError:
        return None
