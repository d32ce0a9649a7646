"""Host memory for offloaded KV chunks: the :class:`HostPool` allocation, private or in shared memory.

The pool is ONE ``uint8`` torch tensor of chunk rows, sized by a :class:`~kvoffload.offload.pool.HostPoolPlan`.
The optional shared-memory backing follows vLLM 0.33's shared offload region: one file under ``/dev/shm`` that
every rank maps, so a replicated offload (``replicated_layout``) keeps one copy of the cache for all ranks.
With CUDA the rows are page-locked in the background (:mod:`._pinning`): exactly the rows this process maps.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import time
import weakref
from pathlib import Path
from typing import Literal

import torch

from kvoffload._ints import round_up
from kvoffload.errors import ConfigError, HostMemoryError, InvalidStateError, WorkerError
from kvoffload.offload.pool._files import available_host_memory_bytes, shared_pool_path
from kvoffload.offload.pool._integrity import IntegrityTable
from kvoffload.offload.pool._pinning import HostRegistration, pin_bytes
from kvoffload.offload.pool._plan import PAGE_SIZE, HostPoolPlan, table_entries
from kvoffload.offload.pool._prefault import BackgroundPrefault
from kvoffload.offload.pool._reservations import reserve_host_memory

__all__ = ["HostPool"]

_JOIN_POLL_S = 0.005


def _check_fits(what: str, requested: int, available: int, plan: HostPoolPlan, row_bytes: int) -> None:
    if requested > available:
        raise HostMemoryError(
            f"host pool needs {requested} bytes (num_chunks={plan.num_chunks} x row_bytes={row_bytes}) but "
            f"only {available} bytes of {what} are available; lower cpu_bytes_to_use "
            f"(={plan.cpu_bytes_to_use}, the total across all {plan.world_size} workers)"
        )


class _Resources:
    """What a pool must release: kept apart from :class:`HostPool` so ``weakref.finalize`` can run it."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.path: Path | None = None
        self.owns_file = False  # created the file and has not removed it yet
        self.created = False
        self.registration: HostRegistration | None = None
        self.prefault: BackgroundPrefault | None = None

    def unlink(self) -> None:
        if self.owns_file and self.path is not None:
            self.owns_file = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def release(self) -> None:
        if self.prefault is not None:
            self.prefault.stop()
        if self.registration is not None:
            self.registration.close()  # waits for a registration still running, then unregisters
            self.registration = None
        self.unlink()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


class HostPool:
    """The host-side KV pool: ``num_chunks`` rows of ``uint8``, optionally pinned and/or shared.

    Private pool (``engine_id=None``): a tensor of shape ``(num_chunks, plan.slot_bytes)`` holding only this
    worker's slot (its share of the total budget). Shared pool (``engine_id`` given): a file
    ``/dev/shm/kvoffload_{engine_id}.mmap`` of ``num_chunks * plan.row_bytes`` bytes mapped by every rank;
    the first rank to create it (``O_CREAT|O_EXCL``) sizes it, the others wait up to ``join_timeout_s`` for
    that and map it. The creator removes the file on :meth:`close`, on exit, or earlier via :meth:`unlink`
    once every rank has mapped it.

    ``pin_memory`` (``"auto"``: when CUDA is available) page-locks the rows with ``cudaHostRegister`` on a
    background thread, so construction does not wait for it: :attr:`is_pinned` says whether it is done,
    :meth:`wait_pinned` waits. It registers :attr:`pin_bytes`, exactly this process's mapping of the rows: a
    private pool is an anonymous mapping of its rows (no power-of-two pinned allocation), a shared pool's
    ranks each register their own mapping of the one file (its memory is allocated once, not per rank).

    Beside the rows the pool holds its :attr:`integrity` table (key tag, checksum and state per chunk,
    slot and sub-block); a shared pool keeps it at the end of the shared file so every rank sees it.
    """

    def __init__(
        self,
        plan: HostPoolPlan,
        *,
        engine_id: str | None = None,
        pin_memory: bool | Literal["auto"] = "auto",
        check_memory: bool = True,
        join_timeout_s: float = 30.0,
        shm_dir: str | os.PathLike[str] = "/dev/shm",
    ) -> None:
        if pin_memory not in (True, False, "auto"):
            raise ConfigError(f"pin_memory={pin_memory!r} must be True, False or 'auto'")
        cuda = torch.cuda.is_available()
        if pin_memory is True and not cuda:
            raise ConfigError("pin_memory=True needs CUDA, but torch.cuda.is_available() is False")
        want_pin = cuda if pin_memory == "auto" else bool(pin_memory)
        self._plan = plan
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release)
        self._closed = False
        self._pin_bytes = pin_bytes(plan, shared=engine_id is not None)
        if want_pin:
            torch.cuda.init()  # type: ignore[no-untyped-call]  # here, before the registration thread
        if engine_id is None:
            self._row_bytes = plan.slot_bytes
            self._slot_offset = 0
            requested = plan.num_chunks * self._row_bytes
            shape = (plan.num_chunks, self._row_bytes)
            reservation = contextlib.ExitStack()
            reservation.enter_context(self._reserved(requested, check_memory, shm_dir))
            if requested == 0:
                reservation.close()
                self._rows = torch.zeros(shape, dtype=torch.uint8)
            else:
                # exactly the rows, page-aligned, reading as zeros: the registration (CUDA) or a background
                # thread faults them in, not the constructor (a pool of tens of GiB would hold the start)
                mapping = mmap.mmap(-1, requested, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                self._rows = torch.frombuffer(mapping, dtype=torch.uint8, count=requested).view(shape)
                if want_pin:
                    reservation.close()
                    self._pin(self._rows)
                else:
                    self._res.prefault = BackgroundPrefault(
                        mapping, self._rows.data_ptr(), [(0, requested)], on_done=reservation.close
                    )
            meta = torch.zeros(table_entries(plan.num_chunks, 1, plan.blocks_per_chunk) * 3, dtype=torch.int64)
            self._integrity = IntegrityTable(
                meta, num_chunks=plan.num_chunks, slots=1, slot=0, blocks_per_chunk=plan.blocks_per_chunk
            )
        else:
            self._row_bytes = plan.row_bytes
            self._slot_offset = plan.slot_offset
            self._res.path = shared_pool_path(engine_id, shm_dir)
            self._rows, meta = self._map_shared(self._res.path, check_memory, join_timeout_s)
            if want_pin and self._rows.numel() > 0:
                self._pin(self._rows)
            self._integrity = IntegrityTable(
                meta,
                num_chunks=plan.num_chunks,
                slots=plan.copies,
                slot=0 if plan.replicated else plan.rank,
                blocks_per_chunk=plan.blocks_per_chunk,
            )

    # -- construction helpers -------------------------------------------------------------------------

    def _map_shared(self, path: Path, check_memory: bool, join_timeout_s: float) -> tuple[torch.Tensor, torch.Tensor]:
        res, plan = self._res, self._plan
        rows_total = plan.total_bytes
        entries = table_entries(plan.num_chunks, plan.copies, plan.blocks_per_chunk)
        if rows_total == 0:
            rows = torch.zeros((plan.num_chunks, self._row_bytes), dtype=torch.uint8)
            return rows, torch.zeros(entries * 3, dtype=torch.int64)
        total = plan.shared_file_bytes
        deadline = time.monotonic() + join_timeout_s
        while True:
            try:
                res.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                res.owns_file = res.created = True
                break
            except FileExistsError:
                try:
                    res.fd = os.open(path, os.O_RDWR)
                    break
                except FileNotFoundError:  # the creator gave up between our two opens: try to create again
                    if time.monotonic() > deadline:
                        raise WorkerError(f"timed out creating or joining shared host pool {path}") from None
                    time.sleep(_JOIN_POLL_S)
        try:
            if res.owns_file:
                if check_memory:
                    st = os.statvfs(path.parent)
                    _check_fits(
                        f"free space in {path.parent}",
                        total,
                        st.f_bavail * st.f_frsize,
                        plan,
                        self._row_bytes,
                    )
                reservation = contextlib.ExitStack()
                reservation.enter_context(self._reserved(total, check_memory, path.parent))
                try:
                    os.ftruncate(res.fd, total)
                    mapping = mmap.mmap(res.fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                except BaseException:
                    reservation.close()
                    raise
            else:
                reservation = contextlib.ExitStack()
                self._wait_for_creator(res.fd, path, total, deadline, join_timeout_s)
                mapping = mmap.mmap(res.fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # A fresh shared mapping has no pages: the first write to each takes a fault (allocating and zeroing
            # it in the creator, mapping it in every other rank), which made stores ~5x slower than into a
            # faulted-in pool; a background thread faults this rank's ranges in without holding the start.
            address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
            res.prefault = BackgroundPrefault(mapping, address, self._own_ranges(total), on_done=reservation.close)
        except BaseException:
            res.release()
            raise
        # The tensor (and every view of it) holds the mmap object: the region is unmapped when the last
        # view dies, never under a live view (so a copy engine may outlive close()). Rows are page-rounded,
        # so the integrity table after them is 8-byte aligned.
        rows = torch.frombuffer(mapping, dtype=torch.uint8, count=rows_total).view(plan.num_chunks, self._row_bytes)
        meta = torch.frombuffer(mapping, dtype=torch.int64, count=entries * 3, offset=rows_total)
        return rows, meta

    def _own_ranges(self, total: int) -> list[tuple[int, int]]:
        """Page-rounded byte ranges of the shared file this rank reads and writes: its slot of every row (the
        whole rows when it is the only slot or the offload is replicated) and the integrity table."""
        plan = self._plan
        rows_total = plan.total_bytes
        if plan.copies == 1 or plan.replicated:
            return [(0, total)]
        first = self._slot_offset // PAGE_SIZE * PAGE_SIZE
        last = round_up(self._slot_offset + plan.slot_bytes, PAGE_SIZE)
        ranges = [(row * self._row_bytes + first, last - first) for row in range(plan.num_chunks)]
        ranges.append((rows_total, total - rows_total))
        return ranges

    @staticmethod
    def _wait_for_creator(fd: int, path: Path, total: int, deadline: float, join_timeout_s: float) -> None:
        while True:
            st = os.fstat(fd)
            if st.st_nlink == 0:
                raise WorkerError(f"the creator of shared host pool {path} removed it before sizing it")
            if st.st_size == total:
                return
            if st.st_size > total:
                raise WorkerError(
                    f"shared host pool {path} has {st.st_size} bytes but this rank's plan needs {total}: "
                    "ranks disagree on the host pool plan (or a stale file was left behind)"
                )
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"timed out after {join_timeout_s}s waiting for the creator to size shared host pool "
                    f"{path} (size {st.st_size}, expected {total})"
                ) from TimeoutError(errno.ETIMEDOUT, str(path))
            time.sleep(_JOIN_POLL_S)

    def _reserved(
        self, nbytes: int, check_memory: bool, shm_dir: str | os.PathLike[str]
    ) -> contextlib.AbstractContextManager[None]:
        """While the body allocates ``nbytes``: reserved in the machine-wide ledger (:mod:`._reservations`), so
        pools allocated at the same moment by other processes cannot all pass the memory check."""
        if not check_memory:
            return contextlib.nullcontext()
        plan, row_bytes = self._plan, self._row_bytes

        def refuse(free: int) -> HostMemoryError:
            try:
                # free: MemAvailable less what other processes are allocating right now
                _check_fits("host memory", nbytes, free, plan, row_bytes)
            except HostMemoryError as exc:
                return exc
            return HostMemoryError(f"host pool of {nbytes} bytes does not fit in {free} bytes")

        return reserve_host_memory(nbytes, available_host_memory_bytes, refuse, shm_dir=shm_dir)

    def _pin(self, rows: torch.Tensor) -> None:
        """Start registering the rows (all of this process's mapping of them) in the background."""
        if rows.numel() != self._pin_bytes:
            raise InvalidStateError(f"host pool: {rows.numel()} row bytes mapped, {self._pin_bytes} to register")
        self._res.registration = HostRegistration(rows.data_ptr(), rows.numel(), rows)

    # -- views and properties -------------------------------------------------------------------------

    def _live(self) -> torch.Tensor:
        if self._closed:
            raise InvalidStateError("the host pool is closed")
        return self._rows

    @property
    def plan(self) -> HostPoolPlan:
        """The sizing this pool was built from."""
        return self._plan

    @property
    def rows(self) -> torch.Tensor:
        """All chunk rows, ``(num_chunks, row_bytes)`` ``uint8``."""
        return self._live()

    @property
    def integrity(self) -> IntegrityTable:
        """Key tags, checksums and states of the stored sub-blocks (see :mod:`kvoffload.offload.pool._integrity`)."""
        return self._integrity

    @property
    def num_chunks(self) -> int:
        """Number of chunk rows."""
        return self._plan.num_chunks

    @property
    def row_bytes(self) -> int:
        """Width of a row of :attr:`rows`: ``plan.row_bytes`` if shared, ``plan.slot_bytes`` if private."""
        return self._row_bytes

    @property
    def slot_offset(self) -> int:
        """Where this rank's slot starts inside a row of :attr:`rows`."""
        return self._slot_offset

    @property
    def is_shared(self) -> bool:
        """Whether the pool lives in a shared-memory file."""
        return self._res.path is not None

    @property
    def is_creator(self) -> bool:
        """Whether this process created (and will remove) the shared-memory file."""
        return self._res.created

    @property
    def path(self) -> Path | None:
        """The shared-memory file, or None for a private pool."""
        return self._res.path

    @property
    def is_prefaulted(self) -> bool:
        """Whether the background thread has faulted every page of this process's rows in (or gave up: see
        :meth:`wait_prefaulted`); until then the pool is usable, first touches fault pages in on demand."""
        prefault = self._res.prefault
        return prefault is None or prefault.done

    def hold_prefault(self) -> None:
        """The engine's forward pass starts: the background prefault pauses after its current slice, so it never
        competes with the engine for CPU (call :meth:`release_prefault` when the pass ends)."""
        prefault = self._res.prefault
        if prefault is not None:
            prefault.hold()

    def release_prefault(self) -> None:
        """The engine's forward pass ended: the background prefault goes on."""
        prefault = self._res.prefault
        if prefault is not None:
            prefault.release()

    def wait_prefaulted(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the background prefault; False if it is still running."""
        prefault = self._res.prefault
        return prefault is None or prefault.wait(timeout)

    @property
    def is_pinned(self) -> bool:
        """Whether the rows are page-locked now (the background registration has succeeded)."""
        registration = self._res.registration
        return registration is not None and registration.pinned

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the background registration; whether the rows are pinned
        (False at once when the pool is not pinned at all, or the driver refused)."""
        registration = self._res.registration
        return registration is not None and registration.wait(timeout)

    @property
    def pin_bytes(self) -> int:
        """Bytes this process page-locks with CUDA (or would): exactly its mapping of the rows."""
        return self._pin_bytes

    @property
    def pin_error(self) -> str | None:
        """Why the registration failed, if it did."""
        registration = self._res.registration
        return None if registration is None else registration.error

    @property
    def writes(self) -> bool:
        """Whether stores from this rank must write: always for a private pool, ``plan.writes`` if shared."""
        return self._plan.writes or not self.is_shared

    def slot_rows(self, rank: int | None = None) -> torch.Tensor:
        """``(num_chunks, slot_bytes)`` view of ``rank``'s slot (default: this rank's)."""
        rows = self._live()
        plan = self._plan
        if rank is None or rank == plan.rank:
            start = self._slot_offset
        elif self.is_shared:
            start = plan.slot_offset_of(rank)
        else:
            raise ConfigError(f"rank={rank}: a private pool holds only rank {plan.rank}'s slot")
        return rows[:, start : start + plan.slot_bytes]

    def rows_int64(self) -> torch.Tensor:
        """:attr:`rows` viewed as ``int64`` (fast for torch index ops); needs ``row_bytes % 8 == 0``."""
        return _as_int64(self._live(), "row_bytes", self._row_bytes)

    def slot_rows_int64(self, rank: int | None = None) -> torch.Tensor:
        """:meth:`slot_rows` viewed as ``int64``; needs ``slot_bytes % 8 == 0``."""
        return _as_int64(self.slot_rows(rank), "slot_bytes", self._plan.slot_bytes)

    # -- lifetime -------------------------------------------------------------------------------------

    def unlink(self) -> None:
        """Remove the shared file now (creator only) while keeping the mapping; no-op otherwise."""
        self._res.unlink()

    def close(self) -> None:
        """Release the pool: unpin, close the file and remove it if this process created it.

        Close the :class:`~kvoffload.offload.worker.copy.CopyEngine` using the pool first. Shared memory is
        unmapped once the last tensor view of it is gone, never under a live view.
        """
        if self._closed:
            return
        self._closed = True
        self._rows = torch.empty((0, 0), dtype=torch.uint8)
        self._finalizer()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_int64(view: torch.Tensor, field: str, width: int) -> torch.Tensor:
    if width % 8:
        raise ConfigError(f"{field}={width} is not a multiple of 8, so the pool has no int64 view")
    return view.view(torch.int64)
