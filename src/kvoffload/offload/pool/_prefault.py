"""Faulting a host pool's pages in on a background thread, so a large pool does not hold the engine's start.

A pool of tens of GiB takes seconds to fault in (zeroing every page); done in the constructor it held worker start
for all of it (vLLM PR #54578 reports 60 s and more). The pool is usable at once instead: an anonymous or shared
mapping reads as zeros and a page a copy touches first is faulted in by that copy, while a thread populates the
rest slice by slice (``MADV_POPULATE_WRITE`` through ctypes, which releases the GIL; on kernels before 5.14, which
lack it, pages fault in on first use). Populating never changes a page that is already there, so it is safe beside
copies (a read-modify-write touch of each page would not be: it could undo a copy's write).

Populating is CPU work (on a virtual machine a 2 GiB pool took 5 s of one core and slowed a matrix product running
beside it 2.4x), so it must not compete with the engine's forward passes: while the engine computes (:meth:`hold`
until :meth:`release`), the thread waits after its current slice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import threading
from collections.abc import Callable, Sequence

__all__ = ["BackgroundPrefault"]

_MADV_POPULATE_WRITE = 23
_SLICE = 8 << 20  # bytes per call: a stop or a hold waits for at most one slice


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class BackgroundPrefault:
    """Populates ``ranges`` (byte offsets into ``mapping``, whose first byte is at ``address``) on a daemon
    thread, then calls ``on_done`` (it releases the pool's memory reservation). ``stop()`` ends it early."""

    def __init__(
        self,
        mapping: mmap.mmap,
        address: int,
        ranges: Sequence[tuple[int, int]],
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        self._mapping = mapping  # held: the pages stay mapped while the thread runs
        self._address = address
        self._ranges = [(s, n) for s, n in ranges if n > 0]
        self._on_done = on_done
        self._stop = threading.Event()
        self._done = threading.Event()
        self._idle = threading.Event()  # clear while the engine computes: the thread waits
        self._idle.set()
        self.error: str | None = None
        """Why populating stopped early (None: it finished, or was stopped); pages then fault in on first use."""
        self._thread = threading.Thread(target=self._run, name="kvo-pool-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            madvise = _libc_madvise()
            for start, length in self._ranges:
                for at in range(start, start + length, _SLICE):
                    self._idle.wait()
                    if self._stop.is_set():
                        return
                    n = min(_SLICE, start + length - at)
                    if madvise is None or madvise(self._address + at, n, _MADV_POPULATE_WRITE) != 0:
                        code = ctypes.get_errno() if madvise is not None else errno.ENOSYS
                        if code not in (errno.EINVAL, errno.ENOSYS):
                            self.error = f"populating host pool pages failed: {errno.errorcode.get(code, code)}"
                        return  # no MADV_POPULATE_WRITE here: pages fault in on first use
        finally:
            try:
                self._on_done()
            finally:
                self._done.set()

    @property
    def done(self) -> bool:
        """True once every page is populated (or populating stopped)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until populating ended; False if ``timeout`` passed first."""
        return self._done.wait(timeout)

    def hold(self) -> None:
        """The engine computes: populate no further slice until :meth:`release`."""
        self._idle.clear()

    def release(self) -> None:
        """The engine's forward pass ended: go on populating."""
        self._idle.set()

    def stop(self) -> None:
        """Stop populating (at the next slice) and wait for the thread."""
        self._stop.set()
        self._idle.set()
        self._thread.join()
