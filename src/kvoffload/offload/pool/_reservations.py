"""Host-memory reservations across processes: two pools allocated at once cannot both pass the memory check.

A pool checks its size against ``MemAvailable`` before allocating. Memory already faulted in by other pools is
gone from that figure, but memory another process has checked and not yet faulted in is not: two processes
creating pools at the same moment would each see the whole machine free. So every allocation first records
itself in a small ledger (one JSON file under ``/dev/shm``, updated under ``flock``), and a pool must fit in
``MemAvailable`` minus what the other live processes have reserved and not finished allocating. Entries go when
their allocation is done (the memory then shows in ``MemAvailable``) or when their process is gone.

Where the ledger cannot be used, the check falls back to ``MemAvailable`` alone (the pool creation proceeds
without the cross-process reservation): silently when the shm directory is missing, with one WARNING naming the
path and the reason when the ledger is unsafe (a symbolic link, not a regular file, not ours, linked elsewhere,
mode wider than 0600 — it is then neither read nor written), cannot be opened, or stays locked by another
process for longer than ``lock_timeout_s``. A ledger that is ours but does not decode as a list of valid entries
(torn, foreign, hand-edited) is truncated in place under the lock, with one WARNING, and starts over empty.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import msgspec

from kvoffload._procs import pid_alive
from kvoffload.errors import ConfigError, HostMemoryError

__all__ = ["LEDGER_NAME", "LOCK_TIMEOUT_S", "reserve_host_memory", "reserved_by_others"]

LEDGER_NAME = "kvoffload-reservations.json"
"""The ledger's file name in the shm directory (its lock is the same file, locked with ``flock``); it exists only
while some process holds a reservation."""

LOCK_TIMEOUT_S = 5.0
"""How long a reservation waits for another process's lock on the ledger before going on without it (its holders
keep it for a read and a write, so only a stuck or hostile process holds it this long)."""

_LOCK_POLL_S = 0.01
_MAX_LEDGER_BYTES = 1 << 20
_MAX_BYTES = 2**63 - 1

_log = logging.getLogger(__name__)
_ids = itertools.count(1)


class _Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One reservation: ``bytes`` checked and not yet faulted in by process ``pid`` (``id`` tells a process's
    concurrent reservations apart)."""

    pid: Annotated[int, msgspec.Meta(gt=0, le=2**31 - 1)]
    bytes: Annotated[int, msgspec.Meta(ge=0, le=_MAX_BYTES)]
    id: Annotated[int, msgspec.Meta(ge=0, le=_MAX_BYTES)]


_decoder = msgspec.json.Decoder(list[_Entry])


class _LedgerUnusable(OSError):
    """The ledger cannot be used safely right now (already logged): the plain memory check applies."""


def _unusable(path: Path, why: str) -> _LedgerUnusable:
    _log.warning("host-memory reservations ledger %s is not used: %s", path, why)
    return _LedgerUnusable(f"{path}: {why}")


def _unsafe(st: os.stat_result) -> str | None:
    """Why the opened ledger must not be trusted or written (``None`` when it is a private file of ours)."""
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file (mode {stat.filemode(st.st_mode)})"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    if stat.S_IMODE(st.st_mode) & ~0o600:
        return f"mode {stat.S_IMODE(st.st_mode):04o} is wider than 0600"
    if st.st_nlink != 1:
        return f"it has {st.st_nlink} hard links"
    return None


def _lock(fd: int, path: Path, deadline: float, timeout_s: float) -> None:
    """Take the exclusive ``flock`` on ``fd``, polling until ``deadline`` so a stuck holder cannot hang us."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise _unusable(path, f"still locked by another process after {timeout_s}s") from None
            time.sleep(_LOCK_POLL_S)


@contextlib.contextmanager
def _locked_ledger(shm_dir: Path, timeout_s: float) -> Iterator[tuple[int, list[_Entry]]]:
    """The ledger's live entries under an exclusive lock (entries of dead processes are dropped).

    The file exists only while a reservation does: whoever empties it unlinks it under the lock, so a process
    that locked a file since unlinked retries on the current one. Raises ``OSError`` where the ledger cannot be
    used (:class:`_LedgerUnusable`, already logged, when it is unsafe or stays locked).
    """
    path = shm_dir / LEDGER_NAME
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            raise  # no shm directory here: the documented silent fallback
        except OSError as exc:
            why = "a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
            raise _unusable(path, why) from None
        mine = os.fstat(fd)
        unsafe = _unsafe(mine)
        if unsafe is not None:
            os.close(fd)
            raise _unusable(path, unsafe)
        _lock(fd, path, deadline, timeout_s)
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)  # unlinked by its last user while we waited for the lock: take the new one
    try:
        raw = os.pread(fd, _MAX_LEDGER_BYTES + 1, 0)
        try:
            if len(raw) > _MAX_LEDGER_BYTES:
                raise msgspec.DecodeError(f"larger than {_MAX_LEDGER_BYTES} bytes")
            entries = [e for e in _decoder.decode(raw) if pid_alive(e.pid)] if raw else []
        except msgspec.DecodeError as exc:  # torn, foreign or hand-edited: start over (entries are short-lived)
            _log.warning("host-memory reservations ledger %s is malformed (%s); truncated, starting over", path, exc)
            os.ftruncate(fd, 0)
            entries = []
        yield fd, entries
    finally:
        os.close(fd)  # releases the lock


def _write(fd: int, entries: list[_Entry], path: Path) -> None:
    if not entries:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # nothing reserved: leave no file behind
        return
    data = msgspec.json.encode(entries)
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def reserved_by_others(shm_dir: str | os.PathLike[str] = "/dev/shm", *, lock_timeout_s: float = LOCK_TIMEOUT_S) -> int:
    """Bytes other live processes have reserved and not finished allocating (0 without a usable ledger)."""
    try:
        with _locked_ledger(Path(shm_dir), lock_timeout_s) as (fd, entries):
            if not entries:
                _write(fd, entries, Path(shm_dir) / LEDGER_NAME)
            return sum(e.bytes for e in entries if e.pid != os.getpid())
    except OSError:
        return 0


@contextlib.contextmanager
def reserve_host_memory(
    nbytes: int,
    available: Callable[[], int],
    refuse: Callable[[int], HostMemoryError],
    *,
    shm_dir: str | os.PathLike[str] = "/dev/shm",
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> Iterator[None]:
    """Hold a reservation of ``nbytes`` while the body allocates and faults them in.

    Raises ``refuse(free)`` when ``nbytes`` exceeds ``available()`` minus the other processes' reservations.
    Where the ledger cannot be used (see the module's docstring), ``free`` is ``available()`` alone.
    """
    if not 0 <= nbytes <= _MAX_BYTES:
        raise ConfigError(f"reservation nbytes={nbytes!r} is outside [0, {_MAX_BYTES}]")
    directory = Path(shm_dir)
    token = _Entry(pid=os.getpid(), bytes=nbytes, id=next(_ids))
    try:
        with _locked_ledger(directory, lock_timeout_s) as (fd, entries):
            others = sum(e.bytes for e in entries if e.pid != os.getpid())
            free = available() - others
            if nbytes > free:
                _write(fd, entries, directory / LEDGER_NAME)  # keeps the cleanup of dead or malformed entries
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
        with contextlib.suppress(OSError), _locked_ledger(directory, lock_timeout_s) as (fd, entries):
            _write(fd, [e for e in entries if e != token], directory / LEDGER_NAME)
