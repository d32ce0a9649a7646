"""The raw baseline of a tier: the same records moved the plainest way the medium allows, to compare a tier with.

A tier's throughput means little alone (a disk, a page cache and a network differ by orders of magnitude); what it
should be compared with is its medium moving the same bytes without the tier: for the disk tier, ``preadv`` of the
same record files and ``pwritev`` of the same bytes into fresh files of the same directory, with the tier's open
flags and thread counts; for the Valkey tier, the client's pipelined GETs of the same keys and SETs of the same
values packed by hand (as the tier packs its own), in the tier's batch size over its thread count.
:func:`raw_throughput` measures that (the demo shows the tier's own figure as a share of it).
:func:`compare_with_raw` runs at the end of a run, when the tier may be failing: a probe that cannot run (a job of
the tier failed, the medium refused the raw baseline's IO, a full disk) gives no comparison and logs a WARNING with
the reason, never an exception.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import valkey.exceptions

from kvoffload._ints import round_up
from kvoffload.offload.keys import OffloadKey
from kvoffload.tiers._base import SecondaryTier, TierBase
from kvoffload.tiers._fs import FsTier
from kvoffload.tiers._valkey import ValkeyTier

if TYPE_CHECKING:
    from kvoffload.tiers._obj import ObjTier

__all__ = ["RawThroughput", "TierVsRaw", "compare_with_raw", "raw_throughput"]

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_scratch = itertools.count()
_IO_ERRORS = (OSError, valkey.exceptions.ValkeyError)
"""What the media raise on an IO fault (a full disk, an unreachable server): the probe then gives no comparison."""


@dataclass(frozen=True, slots=True)
class RawThroughput:
    """GB/s of the medium moving ``records`` records (``num_bytes`` bytes) without the tier."""

    write_gbps: float
    read_gbps: float
    records: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class TierVsRaw:
    """GB/s of the tier and of its raw baseline on the same records, timed side by side (best of three each)."""

    tier: RawThroughput
    raw: RawThroughput

    @property
    def write_share(self) -> float:
        """The tier's write GB/s as a share of the raw baseline's."""
        return self.tier.write_gbps / self.raw.write_gbps if self.raw.write_gbps else 0.0

    @property
    def read_share(self) -> float:
        """The tier's read GB/s as a share of the raw baseline's."""
        return self.tier.read_gbps / self.raw.read_gbps if self.raw.read_gbps else 0.0


def compare_with_raw(tier: SecondaryTier, keys: Sequence[OffloadKey], row_bytes: int) -> TierVsRaw | None:
    """The tier's own loads of the records of ``keys`` (rows of ``row_bytes``) and stores of the same bytes under
    scratch keys (removed after), against :func:`raw_throughput` on the same records, interleaved; None for a
    tier that is not built in or holds none of the records, and None with a WARNING naming the reason when the
    probe cannot run (a job of the tier fails, an IO error of the raw baseline). Call it with no job of the tier
    in flight (it polls the tier: results of other jobs would be lost)."""
    if not isinstance(tier, FsTier | ValkeyTier) and _as_obj(tier) is None:
        return None
    if row_bytes <= 0:
        return None
    tier = cast(TierBase, tier)
    keys = [k for k, found in zip(keys, tier.lookup(keys), strict=True) if found]
    if not keys:
        return None
    rows = [mmap.mmap(-1, round_up(row_bytes, _PAGE)) for _ in keys]
    for r in rows:
        r.write(bytes(len(r)))
    views = [memoryview(r)[:row_bytes] for r in rows]
    scratch = [OffloadKey(b"probe:" + k) for k in keys]
    best_read, best_write, moved_read, moved_write = float("inf"), float("inf"), 0, 0
    raws: list[RawThroughput] = []
    job = -(1 << 40)  # job ids far from the engine's
    try:
        for repeat in range(_REPEATS):
            # turns alternate who goes first: writes leave dirty pages and deletes behind that slow whoever follows
            for mine_now in (True, False) if repeat % 2 else (False, True):
                if not mine_now:
                    raw = raw_throughput(tier, keys, repeats=1)
                    if raw is None:
                        _no_comparison(tier, "its raw baseline found none of the records")
                        return None
                    raws.append(raw)
                    continue
                for is_load in (True, False):
                    job += 1
                    start = time.perf_counter()
                    if is_load:
                        tier.submit_load(job, list(keys), views)
                    else:
                        tier.submit_store(job, scratch, views)
                    tier.wait([job])
                    seconds = time.perf_counter() - start
                    results = [r for r in tier.poll() if r.job_id == job]
                    if not results or results[0].failed:
                        outcome = (
                            f"failed for {len(results[0].failed)} of {len(keys)} records "
                            f"({len(results[0].corrupt)} damaged)"
                            if results
                            else "reported no result"
                        )
                        _no_comparison(tier, f"its probe {'load' if is_load else 'store'} {outcome}")
                        return None
                    if is_load:
                        best_read, moved_read = min(best_read, seconds), results[0].num_bytes
                    else:
                        best_write, moved_write = min(best_write, seconds), results[0].num_bytes
                        tier.delete(scratch)
    except _IO_ERRORS as exc:
        _no_comparison(tier, f"its raw baseline failed: {type(exc).__name__}: {exc}")
        return None
    finally:
        tier.delete(scratch)
        _unmap(rows, views)
    best_raw = RawThroughput(
        max(r.write_gbps for r in raws), max(r.read_gbps for r in raws), raws[0].records, raws[0].num_bytes
    )
    mine = RawThroughput(moved_write / best_write / 1e9, moved_read / best_read / 1e9, len(keys), moved_read)
    return TierVsRaw(mine, best_raw)


def _no_comparison(tier: TierBase, reason: str) -> None:
    """Say why the probe of ``tier`` gives no comparison (its caller returns None)."""
    logger.warning("tier %s: no comparison with its raw baseline: %s", tier.name, reason)


def _unmap(maps: Sequence[mmap.mmap], views: Sequence[memoryview]) -> None:
    """Release the probe's rows. A failed job's batch can still hold views of them when ``wait`` returns (its
    frames and errors are freed later, by the garbage collector): such a mapping stays until the last view goes."""
    for view in views:
        with contextlib.suppress(BufferError):
            view.release()
    for mapping in maps:
        with contextlib.suppress(BufferError):
            mapping.close()


def raw_throughput(tier: SecondaryTier, keys: Sequence[OffloadKey], *, repeats: int = 3) -> RawThroughput | None:
    """The raw baseline of ``tier`` on the records of ``keys``, best of ``repeats`` (None: not a built-in tier,
    or no record); an IO error of the medium (a full disk) is raised, once its scratch files are removed."""
    if isinstance(tier, FsTier):
        return _fs_raw(tier, keys, repeats)
    if isinstance(tier, ValkeyTier):
        return _valkey_raw(tier, keys, repeats)
    obj = _as_obj(tier)
    if obj is not None:
        return _obj_raw(obj, keys, repeats)
    return None


def _as_obj(tier: object) -> ObjTier | None:
    """``tier`` if it is an ``ObjTier`` (None otherwise). A tier can only be one once its module is loaded: this
    module does not load the object-store client for the engines that have no object-store tier."""
    module = sys.modules.get("kvoffload.tiers._obj")
    if module is not None and isinstance(tier, module.ObjTier):
        return cast("ObjTier", tier)
    return None


_REPEATS = 4  # an even number: each side goes first as often as the other


def _timed(
    threads: int, work: Callable[[int], int], n: int, repeats: int, after: Callable[[], None] | None = None
) -> tuple[float, int]:
    """Best of ``repeats``: ``(seconds, bytes moved)`` of ``work(i)`` for every ``i`` on ``threads`` threads;
    ``after`` runs untimed after each repeat (it removes what the repeat wrote)."""
    parts = max(1, min(n, threads))
    batches = [range(i, n, parts) for i in range(parts)]  # one batch per thread, as the tiers split a job

    def run(batch: range) -> int:
        return sum(work(i) for i in batch)

    best, moved = float("inf"), 0
    with ThreadPoolExecutor(parts) as pool:
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            moved = sum(pool.map(run, batches))
            best = min(best, time.perf_counter() - start)
            if after is not None:
                after()
    return best, moved


def _fs_raw(tier: FsTier, keys: Sequence[OffloadKey], repeats: int) -> RawThroughput | None:
    paths = [str(tier.path_of(k)) for k in keys]
    sizes: list[int] = []
    for path in paths:
        try:
            sizes.append(os.stat(path).st_size)
        except OSError:
            sizes.append(0)
    found = [(p, s) for p, s in zip(paths, sizes, strict=True) if s > 0]
    if not found:
        return None
    flag = getattr(os, "O_DIRECT", 0) if tier.uses_odirect else 0
    bufs = [mmap.mmap(-1, round_up(s, _PAGE)) for _, s in found]  # page-aligned, as O_DIRECT needs
    for buf in bufs:
        buf.write(bytes(len(buf)))  # fault the pages in before timing (the tier's buffers are warm too)
    scratch = [f"{p}.raw-{os.getpid()}-{next(_scratch)}" for p, _ in found]

    def read(i: int) -> int:
        fd = os.open(found[i][0], os.O_RDONLY | flag)
        try:
            return os.preadv(fd, [memoryview(bufs[i])], 0)
        finally:
            os.close(fd)

    def write(i: int) -> int:
        fd = os.open(scratch[i], os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o600)
        try:
            return os.pwritev(fd, [memoryview(bufs[i])], 0)
        finally:
            os.close(fd)

    def remove() -> None:
        for path in scratch:
            with contextlib.suppress(OSError):
                os.unlink(path)

    try:
        read_s, read_bytes = _timed(tier.read_threads, read, len(found), repeats)
        write_s, write_bytes = _timed(tier.write_threads, write, len(found), repeats, remove)
    finally:
        remove()
        _unmap(bufs, [])
    return RawThroughput(write_bytes / write_s / 1e9, read_bytes / read_s / 1e9, len(found), read_bytes)


def _packed_sets(client: Any, pairs: Sequence[tuple[bytes, bytes]]) -> None:
    """Pipelined SETs packed by hand, values sent as they are: the fastest raw way, and the tier's (the client's
    packer copies every value when libvalkey is installed, a baseline that would flatter the tier)."""
    parts: list[bytes] = []
    for key, value in pairs:
        parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value)), value, b"\r\n"]
    pool = client.connection_pool
    conn = pool.get_connection("SET")
    try:
        conn.send_packed_command(parts)
        for _ in pairs:
            conn.read_response()
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _valkey_raw(tier: ValkeyTier, keys: Sequence[OffloadKey], repeats: int) -> RawThroughput | None:
    client = tier.raw_client()
    names = [tier.key_of(k) for k in keys]
    step = tier.batch_size
    batches = [names[i : i + step] for i in range(0, len(names), step)]
    values: list[list[bytes | None]] = [[] for _ in batches]

    def get(i: int) -> int:
        pipe = client.pipeline(transaction=False)
        for name in batches[i]:
            pipe.get(name)
        values[i] = pipe.execute()
        return sum(len(v) for v in values[i] if v is not None)

    tag = f"raw-{os.getpid()}-{next(_scratch)}:".encode()

    def put(i: int) -> int:
        pairs = [(tier.prefix + tag + n, v) for n, v in zip(batches[i], values[i], strict=True) if v is not None]
        if not pairs:
            return 0
        if tier.cluster:  # the tier's cluster SETs go through the cluster client's pipelines too
            pipe = client.pipeline(transaction=False)
            for key, value in pairs:
                pipe.set(key, value)
            pipe.execute()
        else:
            _packed_sets(client, pairs)
        return sum(len(v) for _, v in pairs)

    def remove() -> None:
        with contextlib.suppress(Exception):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.delete(tier.prefix + tag + name)
            pipe.execute()

    read_s, read_bytes = _timed(tier.read_threads, get, len(batches), repeats)
    if read_bytes == 0:
        return None
    try:
        write_s, write_bytes = _timed(tier.write_threads, put, len(batches), repeats, remove)
    finally:
        remove()
    records = sum(v is not None for batch in values for v in batch)
    return RawThroughput(write_bytes / write_s / 1e9, read_bytes / read_s / 1e9, records, read_bytes)


def _obj_raw(tier: ObjTier, keys: Sequence[OffloadKey], repeats: int) -> RawThroughput | None:
    """GETs of the tier's objects and PUTs of the same bytes under scratch names, with the tier's own client."""
    names = [tier.object_name(k) for k in keys]
    values: list[bytes | None] = [None] * len(names)
    tag = f"{tier.prefix}raw-{os.getpid()}-{next(_scratch)}/"

    def get(i: int) -> int:
        try:
            values[i] = tier.raw_get(names[i])
        except FileNotFoundError:
            return 0
        return len(values[i] or b"")

    def put(i: int) -> int:
        value = values[i]
        if value is None:
            return 0
        tier.raw_put(tag + str(i), value)
        return len(value)

    def remove() -> None:
        for i in range(len(names)):
            with contextlib.suppress(Exception):
                tier.raw_delete(tag + str(i))

    read_s, read_bytes = _timed(tier.read_threads, get, len(names), repeats)
    if read_bytes == 0:
        return None
    try:
        write_s, write_bytes = _timed(tier.write_threads, put, len(names), repeats, remove)
    finally:
        remove()
    records = sum(v is not None for v in values)
    return RawThroughput(write_bytes / write_s / 1e9, read_bytes / read_s / 1e9, records, read_bytes)
