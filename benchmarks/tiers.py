"""Store/load GB/s of each secondary tier against the raw operation on the same bytes, side by side.

Disk: the tier (records with header and xxh3 checksum, atomic rename, thread pool) vs ``os.pwritev`` /
``os.preadv`` of the same chunks into one file per chunk (no header, checksum or rename), same threads. The
``disk-odirect`` rows compare the O_DIRECT tier with raw O_DIRECT IO from page-aligned copies of the chunks
(the raw side needs no staging copy: its buffers are aligned from the start).
Valkey: the tier (records, checksums, pipelined batches, thread pool) vs the client's raw pipelined
``SET``/``GET`` of the same chunk bytes (same batch size, same threads) on one embedded server (Unix socket); the
raw write is the faster of the client's ``SET`` and the same SETs packed by hand (the client's packer copies each
value when libvalkey is installed).
Each repeat runs raw and tier back to back on fresh keys; best of ``--repeats``. Reads are warm (page
cache, server memory) for both sides. The ``-mac`` rows (``disk-mac``, ``valkey-mac``) run the same tier with
a record secret (``KVOFFLOAD_RECORD_SECRET``: every record also carries a keyed MAC of its bytes, made on write
and checked on read: BLAKE3 where the ``blake3`` package is installed), so the MAC's cost is the ratio against the
plain row of the same run; the ``-blake2b`` rows (``disk-mac-blake2b``, ``valkey-mac-blake2b``) force the
standard library's BLAKE2b MAC (``KVOFFLOAD_RECORD_MAC=blake2b``) for comparison.

    python benchmarks/tiers.py [--chunks 256K,2M] [--total-mib 128] [--repeats 3] [--threads 2]
        [--tiers disk,disk-odirect,valkey,disk-mac,valkey-mac,disk-mac-blake2b,valkey-mac-blake2b]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks._contend

from benchmarks._contend import add_contend_argument, contended
from kvoffload.tiers import EmbeddedValkey, FsTier, Namespace, TierBase, ValkeyTier
from kvoffload.tiers._record import MAC_ENV, SECRET_ENV

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def _split(items: Sequence[int], parts: int) -> list[list[int]]:
    step = -(-len(items) // parts)
    return [list(items[i : i + step]) for i in range(0, len(items), step)]


def _parallel(threads: int, n: int, fn: Callable[[list[int]], None]) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, _split(range(n), threads)))
    return time.perf_counter() - start


def _tier_run(tier: TierBase, job: int, keys: list[bytes], views: list[memoryview], store: bool) -> float:
    start = time.perf_counter()
    (tier.submit_store if store else tier.submit_load)(job, keys, views)
    tier.wait([job])
    (result,) = tier.poll()
    if result.failed:
        raise RuntimeError(f"tier job {job} failed for {len(result.failed)} keys")
    return time.perf_counter() - start


def _pair(best: list[float], at: int, rep: int, raw: Callable[[], float], tier: Callable[[], float]) -> None:
    """Time raw and tier back to back, alternating which goes first (writeback of one must not tax the other)."""
    if rep % 2:
        best[at + 1] = min(best[at + 1], tier())
        best[at] = min(best[at], raw())
    else:
        best[at] = min(best[at], raw())
        best[at + 1] = min(best[at + 1], tier())


def bench_disk(rows: torch.Tensor, threads: int, repeats: int, odirect: bool) -> tuple[float, float, float, float]:
    n, size = rows.shape
    views = [memoryview(r.numpy()) for r in rows]
    out = torch.empty_like(rows)
    out_views = [memoryview(r.numpy()) for r in out]
    best = [float("inf")] * 4
    root = Path(tempfile.mkdtemp(prefix="kvo-bench-disk-"))
    flag = os.O_DIRECT if odirect else 0
    raw_src, raw_dst = views, out_views
    if odirect:  # raw O_DIRECT needs page-aligned buffers: aligned copies of the same chunks
        src_map, dst_map = mmap.mmap(-1, n * size), mmap.mmap(-1, n * size)
        src_map[:] = rows.numpy().tobytes()
        raw_src = [memoryview(src_map)[i * size : (i + 1) * size] for i in range(n)]
        raw_dst = [memoryview(dst_map)[i * size : (i + 1) * size] for i in range(n)]
    try:
        ns = Namespace("bench", f"{size:x}", "{}", size)
        tier = FsTier(root / "tier", ns, n_read_threads=threads, n_write_threads=threads, use_odirect=odirect)
        raw_dir = root / "raw"
        raw_dir.mkdir()
        for rep in range(repeats):
            keys = [rep.to_bytes(4, "big") + i.to_bytes(32, "big") for i in range(n)]

            def raw_write(ids: list[int], rep: int = rep) -> None:
                for i in ids:
                    fd = os.open(raw_dir / f"{rep}-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
                    try:
                        os.pwritev(fd, [raw_src[i]], 0)
                    finally:
                        os.close(fd)

            def raw_read(ids: list[int], rep: int = rep) -> None:
                for i in ids:
                    fd = os.open(raw_dir / f"{rep}-{i}", os.O_RDONLY | flag)
                    try:
                        os.preadv(fd, [raw_dst[i]], 0)
                    finally:
                        os.close(fd)

            _pair(
                best,
                0,
                rep,
                lambda: _parallel(threads, n, raw_write),
                lambda: _tier_run(tier, 2 * rep, keys, views, True),  # noqa: B023
            )
            _pair(
                best,
                2,
                rep,
                lambda: _parallel(threads, n, raw_read),
                lambda: _tier_run(tier, 2 * rep + 1, keys, out_views, False),  # noqa: B023
            )
            if not torch.equal(out, rows):
                raise RuntimeError("disk tier read back different bytes")
        tier.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = n * size
    return tuple(total / t / 1e9 for t in best)  # type: ignore[return-value]


def bench_valkey(rows: torch.Tensor, threads: int, repeats: int, batch: int) -> tuple[float, float, float, float]:
    n, size = rows.shape
    views = [memoryview(r.numpy()) for r in rows]
    out = torch.empty_like(rows)
    out_views = [memoryview(r.numpy()) for r in out]
    best = [float("inf")] * 4
    server = EmbeddedValkey(maxmemory="4gb")
    try:
        ns = Namespace("bench", f"{size:x}", "{}", size)
        tier = ValkeyTier(server.url, ns, n_read_threads=threads, n_write_threads=threads, batch_size=batch)
        client = tier.raw_client()
        for rep in range(repeats):
            client.flushall()
            keys = [rep.to_bytes(4, "big") + i.to_bytes(32, "big") for i in range(n)]

            def raw_set(ids: list[int], rep: int = rep) -> None:
                for part in _split(ids, max(1, -(-len(ids) // batch))):
                    pipe = client.pipeline(transaction=False)
                    for i in part:
                        pipe.set(b"raw:%d:%d" % (rep, i), views[i])
                    pipe.execute()

            def raw_set_packed(ids: list[int], rep: int = rep) -> None:
                """The same SETs packed by hand (the row sent as a memoryview, as the tier sends its records):
                with libvalkey installed the client's own packer copies each value and is the slower way."""
                pool = client.connection_pool
                for part in _split(ids, max(1, -(-len(ids) // batch))):
                    conn = pool.get_connection("SET")
                    try:
                        parts: list[bytes | memoryview] = []
                        for i in part:
                            key = b"raw:%d:%d" % (rep, i)
                            parts += [
                                b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size),
                                views[i],
                                b"\r\n",
                            ]
                        conn.send_packed_command(parts)
                        for _ in part:
                            conn.read_response()
                    finally:
                        pool.release(conn)

            def raw_get(ids: list[int], rep: int = rep) -> None:
                for part in _split(ids, max(1, -(-len(ids) // batch))):
                    pipe = client.pipeline(transaction=False)
                    for i in part:
                        pipe.get(b"raw:%d:%d" % (rep, i))
                    for i, value in zip(part, pipe.execute(), strict=True):
                        out_views[i][:] = value

            _pair(
                best,
                0,
                rep,
                lambda: min(_parallel(threads, n, raw_set), _parallel(threads, n, raw_set_packed)),
                lambda: _tier_run(tier, 2 * rep, keys, views, True),  # noqa: B023
            )
            _pair(
                best,
                2,
                rep,
                lambda: _parallel(threads, n, raw_get),
                lambda: _tier_run(tier, 2 * rep + 1, keys, out_views, False),  # noqa: B023
            )
            if not torch.equal(out, rows):
                raise RuntimeError("valkey tier read back different bytes")
        tier.close()
    finally:
        server.stop()
    total = n * size
    return tuple(total / t / 1e9 for t in best)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", default="256K,2M", help="chunk sizes (default 256K,2M)")
    parser.add_argument("--total-mib", type=int, default=128, help="bytes moved per run (default 128 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    parser.add_argument("--batch", type=int, default=16, help="Valkey pipeline batch (default 16)")
    parser.add_argument(
        "--tiers",
        default="disk,disk-odirect,valkey,disk-mac,valkey-mac,disk-mac-blake2b,valkey-mac-blake2b",
        help="which tiers (default: all of disk,disk-odirect,valkey,disk-mac,valkey-mac,disk-mac-blake2b,"
        "valkey-mac-blake2b)",
    )
    add_contend_argument(parser)
    args = parser.parse_args()
    with contended(args.contend):
        _main(args)


def _main(args: argparse.Namespace) -> None:
    header = f"{'tier':<18} {'chunk':>7} {'raw write':>10} {'tier write':>10} {'ratio':>6} "
    header += f"{'raw read':>9} {'tier read':>9} {'ratio':>6}   (GB/s)"
    print(header)
    for text in args.chunks.split(","):
        size = _parse_size(text)
        n = max(1, args.total_mib * (1 << 20) // size)
        rows = torch.randint(0, 256, (n, size), dtype=torch.uint8)
        for name in args.tiers.split(","):
            kind = name.removesuffix("-blake2b").removesuffix("-mac")
            if "-mac" in name:
                os.environ[SECRET_ENV] = "benchmark secret"
            if name.endswith("-blake2b"):
                os.environ[MAC_ENV] = "blake2b"
            try:
                if kind == "valkey":
                    rw, tw, rr, tr = bench_valkey(rows, args.threads, args.repeats, args.batch)
                else:
                    rw, tw, rr, tr = bench_disk(rows, args.threads, args.repeats, odirect=kind == "disk-odirect")
            finally:
                os.environ.pop(SECRET_ENV, None)
                os.environ.pop(MAC_ENV, None)
            print(f"{name:<18} {text:>7} {rw:>10.2f} {tw:>10.2f} {tw / rw:>6.0%} {rr:>9.2f} {tr:>9.2f} {tr / rr:>6.0%}")


if __name__ == "__main__":
    main()
