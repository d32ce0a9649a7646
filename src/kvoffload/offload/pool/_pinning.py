"""Page-locking a host pool for asynchronous device copies: ``cudaHostRegister`` on a background thread.

Registering hundreds of GB takes tens of seconds (the driver faults in and locks every page), so a pool is
registered on a thread of its own and never blocks engine start; copies issued meanwhile are pageable
(CUDA performs them synchronously, correct but slower) and the zero-copy kernel waits for the registration.

What is registered, exactly once per mapping: the bytes of the pool's rows as this process maps them
(:func:`pin_bytes`): no rounding up (a private pool is an anonymous mapping of exactly its rows, not a
power-of-two pinned allocation), no integrity table, and never multiplied by the number of ranks: a shared
pool's memory is one file allocated once; each rank's process registers its own mapping of it (a mapping
is registered by the process that uses it), and locking already locked pages allocates nothing. A process
never registers a range twice (:class:`HostRegistration` keeps a per-process book).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.pool._plan import HostPoolPlan

__all__ = ["HostRegistration", "cuda_register", "cuda_unregister", "live_registrations", "pin_bytes"]

_PORTABLE_AND_MAPPED = 0x01 | 0x02
"""``cudaHostRegisterPortable | cudaHostRegisterMapped``: pinned for every context, and mapped into the
device's address space (the zero-copy kernel reads and writes it there)."""

_book: dict[int, int] = {}
_book_lock = threading.Lock()


def pin_bytes(plan: HostPoolPlan, *, shared: bool) -> int:
    """Bytes one process registers for its pool: its mapping's rows, exactly (``num_chunks * slot_bytes`` for
    a private pool, the shared file's ``total_bytes`` of rows for a shared one, whatever the rank)."""
    return plan.total_bytes if shared else plan.num_chunks * plan.slot_bytes


def live_registrations() -> dict[int, int]:
    """This process's registered ranges, ``{address: bytes}`` (for tests and tools)."""
    with _book_lock:
        return dict(_book)


def cuda_register(address: int, size: int) -> str | None:
    """``cudaHostRegister`` (portable, mapped); None on success, else the driver's error."""
    import torch

    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = cudart.cudaHostRegister(address, size, _PORTABLE_AND_MAPPED)  # releases the GIL
    return None if int(err) == 0 else f"cudaHostRegister: {cudart.cudaGetErrorString(err)} ({int(err)})"


def cuda_unregister(address: int) -> None:
    """``cudaHostUnregister``."""
    import torch

    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    cudart.cudaHostUnregister(address)


class HostRegistration:
    """Registers ``size`` bytes at ``address`` on a background thread; :meth:`close` unregisters them.

    ``owner`` (the tensor or mapping behind the address) is held until the range is unregistered, so the
    memory is never unmapped while registered. ``register``/``unregister`` default to the CUDA runtime's.
    Raises :class:`InvalidStateError` if this process has a live registration overlapping the range.
    """

    def __init__(
        self,
        address: int,
        size: int,
        owner: object,
        *,
        register: Callable[[int, int], str | None] = cuda_register,
        unregister: Callable[[int], None] = cuda_unregister,
    ) -> None:
        if size <= 0:
            raise ConfigError(f"size={size}: a registration needs bytes")
        with _book_lock:
            for start, length in _book.items():
                if start < address + size and address < start + length:
                    raise InvalidStateError(
                        f"host range [{address:#x}, +{size}) overlaps a live registration [{start:#x}, +{length})"
                    )
            _book[address] = size
        self.address = address
        self.size = size
        self._owner: object | None = owner
        self._register = register
        self._unregister = unregister
        self._done = threading.Event()
        self._closed = False
        self.error: str | None = None
        """Why the registration failed (None: it succeeded or is still running)."""
        self.seconds: float | None = None
        """How long the registration took, once done."""
        self._ok = False
        self._thread = threading.Thread(target=self._run, name="kvoffload-pin", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self.error = self._register(self.address, self.size)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self._ok = self.error is None
        self.seconds = time.perf_counter() - start
        self._done.set()

    @property
    def done(self) -> bool:
        """Whether the registration has finished (successfully or not)."""
        return self._done.is_set()

    @property
    def pinned(self) -> bool:
        """Whether the range is registered now."""
        return self._done.is_set() and self._ok and not self._closed

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the registration; whether the range is registered."""
        self._done.wait(timeout)
        return self.pinned

    def close(self) -> None:
        """Wait for the registration to finish, unregister the range (once) and release the owner."""
        if self._closed:
            return
        self._thread.join()
        self._closed = True
        try:
            if self._ok:
                with contextlib.suppress(Exception):
                    self._unregister(self.address)
        finally:
            with _book_lock:
                _book.pop(self.address, None)
            self._owner = None
