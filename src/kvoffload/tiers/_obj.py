"""The object-store tier (vLLM's ``obj``): one object per chunk record in an S3-compatible bucket.

Object names: ``{prefix}/{namespace.dirname}/{hex[:2]}/{hex}.bin`` (``hex = key.hex()``), the fs tier's layout, so
engines of one namespace share records. The record is today's (namespace tag, checksums, optional MAC).

Client: ``obstore`` (Rust ``object_store``), chosen over NIXL's OBJ plugin (vLLM's choice) by measurement
(``benchmarks/obj_clients.py``, docs/tiers.md): against a real SeaweedFS server it is as fast as the plugin and as
a raw signed GET/PUT, it speaks conditional PUT, and every failure surfaces as an exception at the call; the
plugin's failures come back as a bare ``NIXL_ERR_BACKEND`` from a later poll, and without credentials it sent
``aws-chunked`` bodies the server stored framing and all.

Writers never leave a torn or mixed record readable: an S3 PUT publishes the whole object or nothing, and stores
are conditional (``If-None-Match: *``): the first complete record of a key wins and later writers of the same key
(other engines, same namespace) find it there; a server that does not take the condition gets plain PUTs (one INFO
line), which still publish whole objects. A damaged record is deleted when read (the base class), so the next
store of its key writes it again.

A lookup costs the store one HEAD per key it asks (about a millisecond of the server's time each), so it asks the
way a request's chunks can load, in order: in waves of ``2 * io_threads`` keys run side by side, stopping after the
first wave with a miss (a chunk after a missing one cannot load: it is reported missing unasked), and it does not
ask again for a key it saw stored or found within ``known_ttl_s``; a verdict that went stale meanwhile (another
engine deleted a damaged record) costs one failed promotion, which the scheduler turns into a recompute.

A server that answers a GET with a 5xx while it serves other objects of the batch (a storage node of a cluster is
gone) fails only that record (counted as unreachable) and the tier stays available; a batch none of whose objects
it serves is a fault of the tier.

Every request is bounded by ``request_timeout_s`` (connect included) and never retried (a failed record is a miss
that the request recomputes; a retry would only make a lookup late): a store that is gone or frozen is a fault
within that bound (the tier backs off, lookups miss), never a hang.
"""

from __future__ import annotations

import datetime
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import obstore
import obstore.exceptions
from obstore.store import S3Store

from kvoffload.errors import ConfigError, RecordError, TierError
from kvoffload.offload.keys import OffloadKey
from kvoffload.tiers._base import TierBase
from kvoffload.tiers._namespace import Namespace
from kvoffload.tiers._record import (
    encode_header,
    record_mac_blake3,
    record_secret,
)
from kvoffload.tiers._record_reader import RecordReader

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config

    from kvoffload._generated import ObjStoreConfig

__all__ = ["ObjTier", "endpoint_url"]

logger = logging.getLogger(__name__)

_SCHEMES = ("http", "https")
_KNOWN_MAX = 1 << 16
"""Keys remembered as present per tier instance (the oldest are forgotten first)."""


def endpoint_url(store: ObjStoreConfig) -> str:
    """The endpoint as a URL: ``endpoint_override`` as given when it names its scheme, else with ``scheme``."""
    if store.scheme not in _SCHEMES:
        raise ConfigError(f"obj tier: store_config.scheme={store.scheme!r} is not http or https")
    endpoint = store.endpoint_override.rstrip("/")
    if "://" in endpoint:
        scheme = endpoint.split("://", 1)[0]
        if scheme not in _SCHEMES:
            raise ConfigError(f"obj tier: store_config.endpoint_override={store.endpoint_override!r} is not http(s)")
        return endpoint
    return f"{store.scheme}://{endpoint}"


class ObjTier(TierBase):
    """Records of one namespace in an S3-compatible bucket (see the module docstring)."""

    name = "obj"

    def __init__(
        self,
        store: ObjStoreConfig,
        namespace: Namespace,
        *,
        prefix: str = "",
        io_threads: int = 4,
        request_timeout_s: float = 5.0,
        known_ttl_s: float = 30.0,
        retry_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_bytes: int | None = None,
        index_existing: bool = False,
    ) -> None:
        if not store.bucket:
            raise ConfigError("obj tier: store_config.bucket must be non-empty")
        if request_timeout_s <= 0:
            raise ConfigError(f"obj tier: request_timeout_s={request_timeout_s!r} must be > 0")
        super().__init__(
            n_read_threads=io_threads,
            n_write_threads=io_threads,
            retry_backoff_s=retry_backoff_s,
            max_backoff_s=max_backoff_s,
            max_bytes=max_bytes,
        )
        self.endpoint = endpoint_url(store)
        self.bucket = store.bucket
        self.namespace = namespace
        self._ns_tag = namespace.tag
        self._secret = record_secret()
        self._reader = RecordReader(namespace=self._ns_tag, secret=self._secret, what=self._describe())
        self._blake3 = record_mac_blake3()
        base = prefix.strip("/")
        self.prefix = f"{base}/{namespace.dirname}/" if base else f"{namespace.dirname}/"
        config: S3Config = {"endpoint": self.endpoint, "region": store.region or "us-east-1"}
        if store.access_key or store.secret_key:
            config["access_key_id"] = store.access_key
            config["secret_access_key"] = store.secret_key
        if store.session_token:
            config["session_token"] = store.session_token
        timeout = datetime.timedelta(seconds=request_timeout_s)
        client: ClientConfig = {
            "allow_http": self.endpoint.startswith("http://"),
            "timeout": timeout,
            "connect_timeout": timeout,
        }
        if store.ca_bundle:
            try:
                with open(store.ca_bundle, "rb") as f:
                    client["root_certificate"] = f.read()
            except OSError as exc:
                raise ConfigError(f"obj tier: store_config.ca_bundle={store.ca_bundle!r}: {exc}") from exc
        retry: RetryConfig = {"max_retries": 0, "retry_timeout": timeout}
        try:
            self._store = S3Store(store.bucket, config=config, client_options=client, retry_config=retry)
        except obstore.exceptions.BaseError as exc:
            raise ConfigError(f"obj tier: store_config {self._describe()}: {exc}") from exc
        self._heads = ThreadPoolExecutor(io_threads, thread_name_prefix="kvo-obj-head")
        self._conditional = True  # until the server refuses the condition
        self._wave = 2 * io_threads
        self._known_ttl_s = known_ttl_s
        self._known: OrderedDict[bytes, float] = OrderedDict()  # key -> seen stored or found until then
        self._known_lock = threading.Lock()
        if index_existing:
            self._index_in_background(self._listing)

    def _listing(self) -> list[tuple[bytes, int]]:
        """The namespace's records in the bucket (one LIST, paged), oldest first, with their sizes."""
        found: list[tuple[datetime.datetime, bytes, int]] = []
        for page in obstore.list(self._store, prefix=self.prefix, chunk_size=1000):
            for meta in page:
                name = meta["path"].rsplit("/", 1)[-1]
                if not name.endswith(".bin"):
                    continue
                try:
                    key = bytes.fromhex(name[:-4])
                except ValueError:
                    continue
                found.append((meta["last_modified"], key, int(meta["size"])))
        found.sort()
        return [(key, size) for _, key, size in found]

    def _describe(self) -> str:
        return f"obj tier {self.endpoint}/{self.bucket}"

    def object_name(self, key: bytes) -> str:
        """The object name of a chunk key."""
        h = key.hex()
        return f"{self.prefix}{h[:2]}/{h}.bin"

    def probe(self) -> str | None:
        """Why the store cannot be used: it is backing off, or listing the tier's names in the bucket fails (a
        store that does not answer, a missing bucket, refused credentials; None: it can)."""
        reason = super().probe()
        if reason is not None:
            return reason
        try:
            list(obstore.list(self._store, prefix=f"{self.prefix}__probe__/", chunk_size=1))
        except Exception as exc:
            error = TierError(f"{self._describe()} cannot be reached: {_reason(exc)}")
            self._mark_down(error)
            return str(error)
        return None

    def _exists(self, name: str) -> bool:
        try:
            obstore.head(self._store, name)
        except FileNotFoundError:  # obstore's NotFoundError is one
            return False
        except Exception as exc:
            raise TierError(f"{self._describe()} cannot be reached: {_reason(exc)}") from exc
        return True

    # ------------------------------------------------------------------ IO

    def _store_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> list[int | TierError | None]:
        out: list[int | TierError | None] = []
        for key, row in zip(keys, rows, strict=True):
            header = encode_header(key, row, namespace=self._ns_tag, secret=self._secret, blake3=self._blake3)
            name = self.object_name(key)
            try:
                self._put(name, header + row)
            except obstore.exceptions.AlreadyExistsError:
                pass  # a complete record of this key is there (written by us earlier or by another engine)
            except Exception as exc:
                raise TierError(f"{self._describe()} store failed: {_reason(exc)}") from exc
            out.append(len(row))
        self._remember(keys)
        return out

    def _put(self, name: str, data: bytes) -> None:
        """A conditional PUT (``If-None-Match: *``); a plain one, from then on, where the server does not take the
        condition (a PUT still publishes a whole object or nothing: only the first-writer-wins rule is lost)."""
        if self._conditional:
            try:
                obstore.put(self._store, name, data, mode="create")
                return
            except obstore.exceptions.NotSupportedError:
                self._conditional = False
            except Exception as exc:
                if re.search(r"status code: 501", str(exc)) is None:
                    raise
                self._conditional = False
            logger.info("kvoffload: %s does not take conditional PUTs: records are written unconditionally", self)
        obstore.put(self._store, name, data)

    def __str__(self) -> str:
        return self._describe()

    def _load_batch(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]
    ) -> list[int | RecordError | TierError | None]:
        out: list[int | RecordError | TierError | None] = []
        answered = False  # the server answered some GET of this batch (a 5xx of one object is that object's fault)
        refused: list[int] = []
        for key, row in zip(keys, rows, strict=True):
            try:
                value = obstore.get(self._store, self.object_name(key)).bytes()
            except FileNotFoundError:
                self._forget(key)
                answered = True
                out.append(None)
                continue
            except Exception as exc:
                if not _server_error(exc):
                    raise TierError(f"{self._describe()} load failed: {_reason(exc)}") from exc
                # A server that answers but cannot serve this object (the storage node holding it is gone):
                # this key fails, the others may still load.
                refused.append(len(out))
                out.append(TierError(f"{self._describe()} cannot serve {self.object_name(key)}: {_reason(exc)}"))
                continue
            answered = True
            out.append(self._reader.into(memoryview(value), key, row))
        if refused and not answered:
            raise TierError(f"{self._describe()} load failed: every object of the batch: {out[refused[0]]}")
        return out

    def _exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool | TierError]:
        out: list[bool | TierError] = []
        now = time.monotonic()
        for start in range(0, len(keys), self._wave):
            wave = keys[start : start + self._wave]
            ask = [k for k in wave if not self._is_known(k, now)]
            found = dict(zip(ask, self._heads.map(self._exists, [self.object_name(k) for k in ask]), strict=True))
            answers = [found.get(k, True) for k in wave]
            self._remember(k for k, hit in found.items() if hit)
            out.extend(answers)
            if not all(answers):
                break
        out.extend([False] * (len(keys) - len(out)))
        return out

    def _is_known(self, key: bytes, now: float) -> bool:
        with self._known_lock:
            until = self._known.get(key)
            if until is None:
                return False
            if until < now:
                del self._known[key]
                return False
            return True

    def _remember(self, keys: Iterable[bytes]) -> None:
        until = time.monotonic() + self._known_ttl_s
        with self._known_lock:
            for key in keys:
                self._known[key] = until
                self._known.move_to_end(key)
            while len(self._known) > _KNOWN_MAX:
                self._known.popitem(last=False)

    def forget(self, keys: Sequence[bytes]) -> None:
        """Keys a promotion found missing leave the known cache too: the next lookup asks the store again."""
        super().forget(keys)
        for key in keys:
            self._forget(key)

    def _forget(self, key: bytes) -> None:
        with self._known_lock:
            self._known.pop(key, None)

    def _delete(self, key: bytes) -> None:
        self._forget(key)
        try:
            obstore.delete(self._store, self.object_name(key))
        except FileNotFoundError:
            return
        except Exception as exc:
            raise TierError(f"{self._describe()} delete failed: {_reason(exc)}") from exc

    # ------------------------------------------------------------------ the raw baseline's access

    def raw_get(self, name: str) -> bytes:
        """The bytes of object ``name`` as the client returns them (FileNotFoundError: none; OSError: a fault)."""
        try:
            return bytes(obstore.get(self._store, name).bytes())
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise OSError(f"{self._describe()} GET {name}: {_reason(exc)}") from exc

    def raw_put(self, name: str, data: bytes) -> None:
        """Write ``data`` as object ``name`` (OSError: a fault)."""
        try:
            obstore.put(self._store, name, data)
        except Exception as exc:
            raise OSError(f"{self._describe()} PUT {name}: {_reason(exc)}") from exc

    def raw_delete(self, name: str) -> None:
        """Remove object ``name``."""
        obstore.delete(self._store, name)

    def close(self) -> None:
        """Finish in-flight jobs, then stop the lookup threads."""
        super().close()
        self._heads.shutdown(wait=True)


def _server_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the server's 5xx answer to a request (not a connection or timeout fault)."""
    return re.search(r"status code: 5\d\d", str(exc)) is not None


def _reason(exc: BaseException) -> str:
    """A client error in one line: the S3 error code where the server sent one (``NoSuchBucket``,
    ``InvalidAccessKeyId``, ``SignatureDoesNotMatch``), else the error's first line cut short (obstore's messages
    carry the whole request chain)."""
    text = str(exc)
    code = re.search(r"<Code>([^<]{1,64})</Code>", text)
    status = re.search(r"status code: (\d{3}[^:<]{0,40})", text)
    if code is not None:
        return f"{code.group(1)} ({status.group(1).strip() if status else type(exc).__name__})"
    lines = text.strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first[:300]}"
