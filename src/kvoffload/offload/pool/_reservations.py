"""Host-memory reservations across processes: two pools allocated at once cannot both pass the memory check.

A pool checks its size against ``MemAvailable`` before allocating. Memory already faulted in by other pools is
gone from that figure, but memory another process has checked and not yet faulted in is not: two processes
creating pools at the same moment would each see the whole machine free. So every allocation first records
itself in a small ledger (one JSON file under ``/dev/shm``, updated under ``flock``), and a pool must fit in
``MemAvailable`` minus what the other live processes have reserved and not finished allocating. Entries go when
their allocation is done (the memory then shows in ``MemAvailable``) or when their process is gone. Where the
ledger cannot be used (no writable shm directory), the check falls back to ``MemAvailable`` alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from kvoffload._procs import pid_alive
from kvoffload.errors import HostMemoryError

__all__ = ["LEDGER_NAME", "reserve_host_memory", "reserved_by_others"]

LEDGER_NAME = "kvoffload-reservations.json"
"""The ledger's file name in the shm directory (its lock is the same file, locked with ``flock``); it exists only
while some process holds a reservation."""


@contextlib.contextmanager
def _locked_ledger(shm_dir: Path) -> Iterator[tuple[int, list[dict[str, int]]]]:
    """The ledger's live entries under an exclusive lock (entries of dead processes are dropped).

    The file exists only while a reservation does: whoever empties it unlinks it under the lock, so a process
    that locked a file since unlinked retries on the current one.
    """
    path = shm_dir / LEDGER_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)  # unlinked by its last user while we waited for the lock: take the new one
    try:
        raw = os.pread(fd, 1 << 20, 0)
        try:
            entries = [e for e in json.loads(raw) if pid_alive(int(e["pid"]))] if raw else []
        except (ValueError, TypeError, KeyError):
            entries = []  # a torn or foreign file: start over (entries are short-lived)
        yield fd, entries
    finally:
        os.close(fd)  # releases the lock


def _write(fd: int, entries: list[dict[str, int]], path: Path) -> None:
    if not entries:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # nothing reserved: leave no file behind
        return
    data = json.dumps(entries).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def reserved_by_others(shm_dir: str | os.PathLike[str] = "/dev/shm") -> int:
    """Bytes other live processes have reserved and not finished allocating (0 without a ledger)."""
    try:
        with _locked_ledger(Path(shm_dir)) as (fd, entries):
            if not entries:
                _write(fd, entries, Path(shm_dir) / LEDGER_NAME)
            return sum(e["bytes"] for e in entries if e["pid"] != os.getpid())
    except OSError:
        return 0


@contextlib.contextmanager
def reserve_host_memory(
    nbytes: int,
    available: Callable[[], int],
    refuse: Callable[[int], HostMemoryError],
    *,
    shm_dir: str | os.PathLike[str] = "/dev/shm",
) -> Iterator[None]:
    """Hold a reservation of ``nbytes`` while the body allocates and faults them in.

    Raises ``refuse(free)`` when ``nbytes`` exceeds ``available()`` minus the other processes' reservations.
    """
    directory = Path(shm_dir)
    token = {"pid": os.getpid(), "bytes": nbytes, "id": id(object())}
    try:
        with _locked_ledger(directory) as (fd, entries):
            others = sum(e["bytes"] for e in entries if e["pid"] != os.getpid())
            free = available() - others
            if nbytes > free:
                raise refuse(free)
            _write(fd, [*entries, token], directory / LEDGER_NAME)
    except OSError:
        free = available()  # no ledger here: the plain check
        if nbytes > free:
            raise refuse(free) from None
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError), _locked_ledger(directory) as (fd, entries):
            _write(fd, [e for e in entries if e != token], directory / LEDGER_NAME)
