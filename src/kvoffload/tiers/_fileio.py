"""IO helpers of the tiers: page-aligned staging buffers, copies that release the GIL, full file reads."""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np

from kvoffload._ints import round_up

__all__ = ["Staging", "copy_bytes", "read_direct", "read_full", "skip_written"]

_PAGE = mmap.PAGESIZE


class Staging(threading.local):
    """A page-aligned buffer per thread for O_DIRECT (anonymous mmaps are page-aligned)."""

    buf: mmap.mmap | None = None

    def get(self, size: int) -> mmap.mmap:
        if self.buf is None or len(self.buf) < size:
            if self.buf is not None:
                self.buf.close()
            self.buf = mmap.mmap(-1, round_up(size, _PAGE))
        return self.buf


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` without holding the GIL (numpy releases it for the copy; a memoryview copy does not,
    and the tier's threads would take turns)."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def skip_written(parts: list[memoryview], n: int) -> list[memoryview]:
    """The buffers left after ``n`` bytes of ``parts`` were transferred."""
    out: list[memoryview] = []
    for part in parts:
        if n >= len(part):
            n -= len(part)
            continue
        out.append(part[n:])
        n = 0
    return out


def read_direct(fd: int, view: memoryview) -> int:
    """O_DIRECT read from offset 0: continue only at page-aligned offsets (a short read means end of file)."""
    total = 0
    while total < len(view):
        n = os.preadv(fd, [view[total:]], total)
        if n <= 0:
            break
        total += n
        if total % _PAGE:
            break
    return total


def read_full(fd: int, parts: list[memoryview]) -> int:
    """Read into ``parts`` until they are full or the file ends; returns the bytes read."""
    total = 0
    while parts:
        n = os.preadv(fd, parts, total)
        if n <= 0:
            break
        total += n
        parts = skip_written(parts, n)
    return total
