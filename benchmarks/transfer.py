"""Store/load throughput of the CopyEngine against one plain ``copy_`` of the same bytes, side by side.

For each page size (default 32 KB, 256 KB, 2 MB) the engine memory is laid out layer-major (``--layers``
layers, each ``(num_blocks, page)``, the default vLLM layout), a job moves about ``--total-mib`` MiB of
randomly chosen engine blocks to/from randomly chosen host chunks, and each repeat times one plain
``copy_`` of the same total bytes right before the job (engine→host for stores, host→engine for loads).
Every job runs three times, on three engines over the same pool: with integrity checksums (the default: stores
hash what they wrote, loads verify before reporting), with ``checksums=False`` (key tags only), and with
checksums on the pure-Python CPU path (``native=False``: the copy loop before the native kernel, and what runs
where it was not built).
The three jobs run in a rotating order, and each starts at least 50 ms after the plain copy: torch's OpenMP
workers keep spinning for about 10 ms after a ``copy_`` (measured here), which on a 2-core machine takes one of
the two cores from whichever job runs next.
Reported: best-of-repeats GB/s of both, of the plain copy, their ratio, and the checksum cost: the extra
time of the checksummed job over the unchecked one, as a share of the plain copy of the same bytes (goal:
at most 10% on CPU). Runs on CUDA when available (engine memory on the GPU, pinned host pool), else on CPU.

The machine check hashes a cached buffer on one thread (how fast a core is), then on one and on as many threads
as the engine copies with (how many of those cores this run gets: on a shared machine the copies' speed follows
it; memory bandwidth taken by other tenants shows only in the ``copy_`` column).

    python benchmarks/transfer.py [--pages 32K,256K,2M] [--total-mib 256] [--layers 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import xxhash

from kvoffload import KVCacheTensor
from kvoffload.offload.pool import HostPool, plan_host_pool
from kvoffload.offload.worker.copy import CopyEngine, _native, build_transfer_layout

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SETTLE_S = 0.05
"""Pause after each plain copy so that torch's OpenMP workers have stopped spinning (about 10 ms here)."""


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _plain_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def _job(
    engine: CopyEngine,
    job_id: int,
    is_store: bool,
    block_ids: torch.Tensor,
    chunk_ids: torch.Tensor,
    chunk_tags: torch.Tensor,
) -> None:
    submit = engine.submit_store if is_store else engine.submit_load
    submit(
        job_id,
        group_sizes=[block_ids.numel()],
        block_indices=[0],
        block_ids=block_ids,
        chunk_ids=chunk_ids,
        chunk_tags=chunk_tags,
    )
    engine.wait([job_id])


def bench_page(
    page: int, args: argparse.Namespace, device: torch.device
) -> list[tuple[str, float, float, float, float]]:
    """Return ``(direction, checksummed GB/s, unchecked GB/s, checksummed GB/s of the pure-Python CPU path,
    copy_ GB/s)`` for one page size."""
    layers, bpc = args.layers, args.blocks_per_chunk
    block_bytes = layers * page
    job_blocks = max(bpc, (args.total_mib << 20) // block_bytes // bpc * bpc)
    num_blocks = 2 * job_blocks
    total = job_blocks * block_bytes
    size = num_blocks * block_bytes
    names = tuple(f"layer{i}" for i in range(layers))
    placement = KVCacheTensor(size=size, layers=names, layer_stride=num_blocks * page, block_stride=page)
    layout = build_transfer_layout(
        [placement],
        [[(n, page) for n in names]],
        num_blocks=num_blocks,
        worker_kv_bytes_per_block=block_bytes,
    )
    plan = plan_host_pool(
        worker_kv_bytes_per_block=block_bytes,
        world_size=1,
        blocks_per_chunk=bpc,
        cpu_bytes_to_use=3 * job_blocks * block_bytes + (1 << 20),
        replicated=False,
        rank=0,
    )
    kv = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    pool = HostPool(plan)
    pool.rows.fill_(1)  # fault the pages in before timing
    engine_side = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device)
    host_side = torch.empty(total, dtype=torch.uint8, pin_memory=pool.is_pinned)
    host_side.fill_(1)
    best = {(d, kind): float("inf") for d in ("store", "load") for kind in ("on", "off", "py", "copy")}
    with (
        pool,
        CopyEngine(kv, layout, pool, cpu_threads=args.threads) as checked,
        CopyEngine(kv, layout, pool, cpu_threads=args.threads, checksums=False) as unchecked,
        CopyEngine(kv, layout, pool, cpu_threads=args.threads, native=False) as python_path,
    ):
        job = turn = 0
        for _ in range(args.repeats):
            # Each engine loads back the chunks it stored (a checksummed load needs a checksummed store).
            chunks = torch.randperm(plan.num_chunks)[: 3 * (job_blocks // bpc)].chunk(3)
            tags = torch.randint(1, 1 << 62, (job_blocks // bpc,), dtype=torch.int64)
            for is_store in (True, False):
                direction = "store" if is_store else "load"
                block_ids = torch.randperm(num_blocks)[:job_blocks]
                src, dst = (engine_side, host_side) if is_store else (host_side, engine_side)
                best[direction, "copy"] = min(best[direction, "copy"], _timed(partial(_plain_copy, dst, src), device))
                time.sleep(_SETTLE_S)
                contenders = [("on", checked, chunks[0]), ("off", unchecked, chunks[1]), ("py", python_path, chunks[2])]
                turn = (turn + 1) % len(contenders)
                for kind, engine, chunk_ids in contenders[turn:] + contenders[:turn]:
                    job += 1
                    run = partial(_job, engine, job, is_store, block_ids, chunk_ids, tags)
                    best[direction, kind] = min(best[direction, kind], _timed(run, device))
                    (result,) = engine.poll()
                    if not result.success or result.num_bytes != total:
                        raise SystemExit(f"job {job} failed: {result}")
    return [(d, *(total / best[d, kind] / 1e9 for kind in ("on", "off", "py", "copy"))) for d in ("store", "load")]


def _cached_hash_gbps(size: int = 256 << 10, rounds: int = 2000) -> float:
    data = memoryview(bytes(range(256)) * (size // 256))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(rounds):
            xxhash.xxh3_64_intdigest(data)
        best = min(best, time.perf_counter() - start)
    return size * rounds / best / 1e9


def _cores_free(threads: int, size: int = 256 << 10, rounds: int = 2000) -> float | None:
    """How many of ``threads`` cores this run gets: the native kernel hashes a cached buffer ``rounds`` times in
    one GIL-free call per thread, on 1 and on ``threads`` threads (None without the kernel). Python threads
    calling xxhash would hand the GIL over at every call and read low even on a quiet machine."""
    kernel = _native.KERNEL
    if kernel is None:
        return None
    data = np.frombuffer(bytes(range(256)) * (size // 256), dtype=np.uint8)
    none = np.zeros(0, dtype=np.int64)
    slots = (np.zeros(rounds, dtype=np.int64), np.full(rounds, size, dtype=np.int64), np.arange(rounds, dtype=np.int64))

    def hash_rounds() -> None:
        kernel.copy_hash((none, none, none, none), slots, size, data.ctypes.data, np.zeros(rounds, dtype=np.uint64))

    def seconds(n: int) -> float:
        best = float("inf")
        for _ in range(3):
            workers = [threading.Thread(target=hash_rounds) for _ in range(n)]
            start = time.perf_counter()
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            best = min(best, time.perf_counter() - start)
        return best

    return threads * seconds(1) / seconds(threads)


def main() -> None:
    """Parse the arguments, run every page size and print the table."""
    import sys

    if "--device=cuda" in sys.argv or " --device cuda " in f" {' '.join(sys.argv)} ":
        import transfer_cuda  # beside this script: the GPU <-> host benchmark (benchmarks/gpu/check.sh runs it)

        transfer_cuda.main(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", default="32K,256K,2M", help="comma-separated page sizes")
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement, MiB")
    parser.add_argument("--layers", type=int, default=4, help="layers (pages per block)")
    parser.add_argument("--blocks-per-chunk", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU copy threads (default: engine's)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} layers={args.layers} "
        f"blocks_per_chunk={args.blocks_per_chunk} total={args.total_mib} MiB, best of {args.repeats}"
    )
    kernel = _native.KERNEL
    print(f"native copy kernel: {kernel.path.name if kernel else 'not built'} (py path: native=False)")
    # hashing is compute-bound: on a shared machine its speed says how much CPU this run got
    threads = args.threads or min(4, max(1, torch.get_num_threads()))  # the engine's default
    _machine_check("machine check", threads)
    print(
        f"{'page':>8} {'direction':>9} {'ours GB/s':>10} {'no-cksum GB/s':>14} {'py path GB/s':>13} "
        f"{'copy_ GB/s':>11} {'ratio':>6} {'vs py path':>11} {'checksum cost':>14}"
    )
    for text in args.pages.split(","):
        page = _parse_size(text)
        for direction, ours, bare, python_path, base in bench_page(page, args, device):
            # extra seconds of the checksummed job over the unchecked one, per second of plain copy
            cost = (1 / ours - 1 / bare) * base
            print(
                f"{text:>8} {direction:>9} {ours:10.2f} {bare:14.2f} {python_path:13.2f} {base:11.2f} "
                f"{ours / base:6.2f} {ours / python_path:10.2f}x {cost:13.0%}"
            )
    _machine_check("machine check after", threads)


def _machine_check(title: str, threads: int) -> None:
    free = _cores_free(threads)
    print(
        f"{title}: xxh3 of a cached 256 KiB buffer {_cached_hash_gbps():.1f} GB/s (one thread); "
        + (f"{free:.1f} of {threads} cores free" if free is not None else "cores free: n/a (no kernel)")
    )


if __name__ == "__main__":
    main()
