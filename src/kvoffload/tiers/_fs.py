"""The disk tier: one record file per chunk key under a namespace directory, written atomically.

Paths: ``{root_dir}/{namespace.dirname}/{hex[:2]}/{hex}.bin`` with ``hex = key.hex()`` (the chunk key holds
the group id), plus ``namespace.json`` (the hashed fields, for humans). A record is written to a temporary
name in the same directory (``.tmp-{pid}-{n}``) and renamed over its final name, so a reader either sees no
file or a whole record: never a torn one. ``fsync=False`` (the default, as vLLM's fs tier) skips the flush
to the device before the rename: a process crash loses nothing (the page cache survives it) and after a
power loss a record may come back short or zeroed, which the record checksum turns into a counted miss;
``fsync=True`` flushes the file before the rename and the directory after it.

O_DIRECT (``use_odirect=None``: when the file system supports it) bypasses the page cache; it needs
page-aligned buffers and lengths, so each thread stages records in its own page-aligned ``mmap`` buffer and
files are padded to the page size (readers ignore bytes after the payload). Buffered IO sends the host row
itself (``os.pwritev``/``os.preadv`` straight from/into the row: no copy).

Capacity: ``max_bytes`` caps the namespace directory; past it the least recently written or read records of
this instance are deleted. A new instance on the same directory indexes the records already there (oldest
modification first) and serves them: prefixes survive restarts. Disk full, a read-only or vanished directory
mark the tier unavailable (:class:`~kvoffload.tiers.TierBase`): lookups miss and stores are dropped
until a later probe succeeds.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

from kvoffload._ints import check_int, check_optional_int, round_up
from kvoffload._procs import pid_alive
from kvoffload.errors import ConfigError, RecordError, TierError
from kvoffload.offload.keys import OffloadKey
from kvoffload.tiers._base import TierBase
from kvoffload.tiers._fileio import Staging, copy_bytes, read_direct, read_full, skip_written
from kvoffload.tiers._namespace import Namespace
from kvoffload.tiers._record import (
    HEADER_SIZE,
    encode_header,
    parse_header,
    record_mac_blake3,
    record_secret,
    verify_payload,
)

__all__ = ["FsTier"]

_PAGE = mmap.PAGESIZE
_DOWN_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ENOENT}
_tmp_counter = itertools.count()


class FsTier(TierBase):
    """Records of one namespace as files under ``root_dir`` (see the module docstring).

    ``n_read_threads``/``n_write_threads`` are vLLM's key names (default 16 each); ``max_bytes=None`` means
    no limit. ``scan=False`` skips indexing (and so capacity eviction) at open: for lookup-only instances.
    Raises :class:`ConfigError` for invalid arguments. A ``root_dir`` that cannot be used now (a file in the way,
    no permission) raises :class:`TierError`, an ``OSError`` as vLLM's fs tier raises, unless ``start_down``: the
    tier then starts unavailable and is retried later (how an engine opens it, for ``start_degraded`` and its
    one-line start-up check). Faults of the medium after that never raise.
    """

    name = "fs"

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        namespace: Namespace,
        *,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        max_bytes: int | None = None,
        use_odirect: bool | None = None,
        fsync: bool = False,
        file_mode: int = 0o600,
        scan: bool = True,
        start_down: bool = False,
        retry_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        for field_name, value in (("n_read_threads", n_read_threads), ("n_write_threads", n_write_threads)):
            check_int(field_name, value, 1, where="fs tier: ")
        check_optional_int("max_bytes", max_bytes, 1, where="fs tier: ")
        check_int("file_mode", file_mode, 0, 0o777, where="fs tier: ")
        if not str(root_dir):
            raise ConfigError("fs tier: root_dir must be a non-empty path")
        super().__init__(
            n_read_threads=n_read_threads,
            n_write_threads=n_write_threads,
            retry_backoff_s=retry_backoff_s,
            max_backoff_s=max_backoff_s,
            max_bytes=max_bytes,
        )
        self.root_dir = Path(root_dir)
        self.namespace = namespace
        self._ns_tag = namespace.tag
        self._secret = record_secret()
        self._blake3 = record_mac_blake3()
        self.dir = self.root_dir / namespace.dirname
        self._dir_str = str(self.dir)
        self.fsync = fsync
        self.file_mode = file_mode
        self.dir_mode = file_mode | (file_mode & 0o444) >> 2  # search wherever the files are readable
        self._staging = Staging()
        self._made_dirs: set[str] = set()
        self._odirect = False
        try:
            self._open_dir()
            self._odirect = self._probe_odirect() if use_odirect is None else use_odirect
            if scan:
                self._scan()
        except OSError as exc:
            error = TierError(f"fs tier cannot use root_dir={str(self.root_dir)!r} ({self.dir}): {exc}")
            if not start_down:
                self.close()
                raise error from exc
            self._mark_down(error)

    # ------------------------------------------------------------------ setup

    def _open_dir(self) -> None:
        for directory in (self.root_dir, self.dir):
            if not directory.is_dir():
                directory.mkdir(parents=True, exist_ok=True)
                os.chmod(directory, self.dir_mode)  # exactly these bits, whatever the umask
        meta = self.dir / "namespace.json"
        if not meta.exists():
            tmp = self.dir / f".tmp-{os.getpid()}-{next(_tmp_counter)}-namespace"
            fd = self._create(str(tmp), os.O_WRONLY)
            try:
                os.write(fd, (self.namespace.fields_json + "\n").encode())
            finally:
                os.close(fd)
            os.replace(tmp, meta)

    def _create(self, path: str, flags: int) -> int:
        """A new file with the tier's permission bits (set after creation: the umask does not apply)."""
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, self.file_mode)
        try:
            os.fchmod(fd, self.file_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _probe_odirect(self) -> bool:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return False
        probe = self.dir / f".tmp-{os.getpid()}-{next(_tmp_counter)}-odirect"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o600)
        except OSError:
            with contextlib.suppress(OSError):
                probe.unlink()
            return False
        try:
            buf = self._staging.get(_PAGE)
            os.pwrite(fd, memoryview(buf)[:_PAGE], 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                probe.unlink()

    def _scan(self) -> None:
        """Index the records a previous process left (oldest first) and remove its dead temp files."""
        found: list[tuple[float, bytes, int]] = []
        for sub in os.scandir(self.dir):
            if sub.name.startswith(".tmp-"):
                self._remove_stale_tmp(sub.path, sub.name)
                continue
            if not sub.is_dir():
                continue
            self._made_dirs.add(sub.name)
            for entry in os.scandir(sub.path):
                if entry.name.startswith(".tmp-"):
                    self._remove_stale_tmp(entry.path, entry.name)
                    continue
                if not entry.name.endswith(".bin"):
                    continue
                try:
                    key = bytes.fromhex(entry.name[:-4])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort()
        self.residency.add_found((key, size) for _, key, size in found)
        self._enforce_bound()

    @staticmethod
    def _remove_stale_tmp(path: str, name: str) -> None:
        try:
            pid = int(name.split("-")[1])
        except (IndexError, ValueError):
            pid = -1
        if pid != os.getpid() and not pid_alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(path)

    # ------------------------------------------------------------------ paths

    @property
    def uses_odirect(self) -> bool:
        """Whether records are read and written with O_DIRECT."""
        return self._odirect

    def path_of(self, key: bytes) -> Path:
        """The record file of ``key``."""
        return Path(self._path_str(key))

    def _path_str(self, key: bytes) -> str:
        h = key.hex()
        return f"{self._dir_str}/{h[:2]}/{h}.bin"

    @property
    def total_bytes(self) -> int:
        """Bytes of the records this instance indexes."""
        return self.residency.nbytes

    def __len__(self) -> int:
        return len(self.residency)

    def _record_bytes(self, key: bytes, payload_bytes: int) -> int:
        size = super()._record_bytes(key, payload_bytes)
        return round_up(size, _PAGE) if self._odirect else size

    # ------------------------------------------------------------------ IO

    def _store_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> list[int | None]:
        out: list[int | None] = []
        for key, row in zip(keys, rows, strict=True):
            out.append(self._store_one(key, row))
        return out

    def _store_one(self, key: bytes, row: memoryview) -> int | None:
        if key in self.residency:  # this instance wrote or indexed it: rewriting would only cost bandwidth
            return 0
        h = key.hex()
        sub = f"{self._dir_str}/{h[:2]}"
        path = f"{sub}/{h}.bin"
        if h[:2] not in self._made_dirs:
            try:
                if not os.path.isdir(sub):
                    os.makedirs(sub, mode=self.dir_mode, exist_ok=True)
                    os.chmod(sub, self.dir_mode)
            except OSError as exc:
                raise TierError(f"fs tier cannot create {sub}: {exc}") from exc
            self._made_dirs.add(h[:2])
        header = encode_header(key, row, namespace=self._ns_tag, secret=self._secret, blake3=self._blake3)
        tmp = f"{sub}/.tmp-{os.getpid()}-{next(_tmp_counter)}"
        try:
            size = self._write_file(tmp, header, row)
            os.rename(tmp, path)
            if self.fsync:
                dfd = os.open(sub, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if exc.errno == errno.ENOENT:
                self._made_dirs.discard(h[:2])  # the directory vanished: recreate it on the next attempt
            raise TierError(f"fs tier cannot write {path}: {exc}") from exc
        self.residency.add(key, size)
        return len(row)

    def _write_file(self, tmp: str, header: bytes, row: memoryview) -> int:
        total = len(header) + len(row)
        if self._odirect:
            size = round_up(total, _PAGE)
            buf = self._staging.get(size)
            view = memoryview(buf)
            view[: len(header)] = header
            copy_bytes(view[len(header) : total], row)
            view[total:size] = bytes(size - total)
            fd = self._create(tmp, os.O_WRONLY | os.O_DIRECT)
            parts = [view[:size]]
        else:
            size = total
            fd = self._create(tmp, os.O_WRONLY)
            parts = [memoryview(header), row]
        try:
            written = 0
            while written < size:
                n = os.pwritev(fd, parts, written)
                if n <= 0:
                    raise TierError(errno.EIO, "short write")
                written += n
                parts = skip_written(parts, n)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return size

    def _load_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> list[int | RecordError | None]:
        return [self._load_one(key, row) for key, row in zip(keys, rows, strict=True)]

    def _load_one(self, key: bytes, row: memoryview) -> int | RecordError | None:
        path = self._path_str(key)
        head_len = HEADER_SIZE + len(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT) if self._odirect else os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in _DOWN_ERRNOS:
                raise TierError(f"fs tier cannot read {path}: {exc}") from exc
            return None
        try:
            if self._odirect:
                size = round_up(head_len + len(row), _PAGE)
                buf = self._staging.get(size)
                view = memoryview(buf)
                n = read_direct(fd, view[:size])
                try:
                    header = parse_header(
                        view[:n], expected_key=key, expected_len=len(row), expected_namespace=self._ns_tag
                    )
                except RecordError as exc:
                    return exc
                payload = view[head_len : min(n, head_len + len(row))]
                copy_bytes(row[: len(payload)], payload)
                got = len(payload)
            else:
                head = bytearray(head_len)
                n = read_full(fd, [memoryview(head), row])
                try:
                    header = parse_header(
                        head[: min(n, head_len)],
                        expected_key=key,
                        expected_len=len(row),
                        expected_namespace=self._ns_tag,
                    )
                except RecordError as exc:
                    return exc
                got = max(0, n - head_len)
        except OSError as exc:
            raise TierError(f"fs tier cannot read {path}: {exc}") from exc
        finally:
            os.close(fd)
        try:
            verify_payload(header, row[:got], secret=self._secret)
        except RecordError as exc:
            return exc
        return got

    def _exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool]:
        if not os.path.isdir(self._dir_str):
            raise TierError(f"fs tier directory {self.dir} is gone")
        return [os.path.exists(self._path_str(key)) for key in keys]

    def _delete(self, key: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_of(key))

    def clear(self) -> None:
        """Delete every record of this namespace (the directory stays)."""
        for key in self.residency.clear():
            with contextlib.suppress(OSError):
                os.unlink(self.path_of(key))
