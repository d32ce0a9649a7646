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

``--profile`` prints, instead of the table, where a checksummed native CPU job's time goes (the median job of
``--repeats``, each after the same 50 ms pause): Python before the kernel (submit: checks and the job's blocks;
the hand-over to the direction's thread; the call into C), the kernel (ordering and cutting the job, each
thread's busy time and granules, when the helper started, how long the caller waited for it at the end, the
share of bytes hashed in the copy loop or from memory), Python after it (out of C, seal or verify, publishing
the result, ``wait()`` returning); then the kernel alone on one thread: copy, copy while hashing, and the hash
of the same bytes from memory.

    python benchmarks/transfer.py [--pages 32K,256K,2M] [--total-mib 256] [--layers 4] [--repeats 5] [--profile]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks._contend

from benchmarks._contend import add_contend_argument, contended
from kvoffload import KVCacheTensor
from kvoffload.offload.pool import HostPool, plan_host_pool
from kvoffload.offload.worker.copy import CopyEngine, _native, build_block_slots, build_transfer_layout
from kvoffload.offload.worker.copy._cpu import CpuBackend, JobProfile
from kvoffload.offload.worker.copy._cpu_native import NativeCpuBackend

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


class _Setup:
    """One page size's engine memory, layout, host pool and job size (as ``bench_page`` lays them out)."""

    def __init__(self, page: int, args: argparse.Namespace, device: torch.device) -> None:
        layers, bpc = args.layers, args.blocks_per_chunk
        block_bytes = layers * page
        self.job_blocks = max(bpc, (args.total_mib << 20) // block_bytes // bpc * bpc)
        self.num_blocks = 2 * self.job_blocks
        self.total = self.job_blocks * block_bytes
        size = self.num_blocks * block_bytes
        names = tuple(f"layer{i}" for i in range(layers))
        placement = KVCacheTensor(size=size, layers=names, layer_stride=self.num_blocks * page, block_stride=page)
        self.layout = build_transfer_layout(
            [placement],
            [[(n, page) for n in names]],
            num_blocks=self.num_blocks,
            worker_kv_bytes_per_block=block_bytes,
        )
        self.plan = plan_host_pool(
            worker_kv_bytes_per_block=block_bytes,
            world_size=1,
            blocks_per_chunk=bpc,
            cpu_bytes_to_use=3 * self.job_blocks * block_bytes + (1 << 20),
            replicated=False,
            rank=0,
        )
        self.kv = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
        self.pool = HostPool(self.plan)
        self.pool.rows.fill_(1)  # fault the pages in before timing


def bench_page(
    page: int, args: argparse.Namespace, device: torch.device
) -> list[tuple[str, float, float, float, float]]:
    """Return ``(direction, checksummed GB/s, unchecked GB/s, checksummed GB/s of the pure-Python CPU path,
    copy_ GB/s)`` for one page size."""
    setup = _Setup(page, args, device)
    bpc, job_blocks, num_blocks, total = args.blocks_per_chunk, setup.job_blocks, setup.num_blocks, setup.total
    plan, kv, pool, layout = setup.plan, setup.kv, setup.pool, setup.layout
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


def profile_page(page: int, args: argparse.Namespace) -> None:
    """``--profile``: where a checksummed native job's time goes (CPU), from the backend's :class:`JobProfile`
    stamps and the kernel's own stats, then the kernel alone on one thread (copy, copy while hashing, hash of
    the same bytes from memory)."""
    setup = _Setup(page, args, torch.device("cpu"))
    plan, pool, job_blocks, total = setup.plan, setup.pool, setup.job_blocks, setup.total
    rows: dict[str, list[dict[str, float]]] = {"store": [], "load": []}
    with pool, CopyEngine(setup.kv, setup.layout, pool, cpu_threads=args.threads) as engine:
        backend = engine._backend
        if not isinstance(backend, CpuBackend | NativeCpuBackend) or not engine.native:
            raise SystemExit("--profile needs the CPU engine with the native kernel")
        in_c = isinstance(backend, NativeCpuBackend)  # the kernel's engine: its own threads, integrity in C
        backend.profile = []
        job = 0
        for _ in range(args.repeats):
            chunks = torch.randperm(plan.num_chunks)[:job_blocks]
            tags = torch.randint(1, 1 << 62, (job_blocks,), dtype=torch.int64)
            block_ids = torch.randperm(setup.num_blocks)[:job_blocks]
            for is_store in (True, False):
                job += 1
                time.sleep(_SETTLE_S)
                submit = engine.submit_store if is_store else engine.submit_load
                kw = {"group_sizes": [job_blocks], "block_indices": [0], "block_ids": block_ids}
                t0 = time.perf_counter_ns()
                submit(job, chunk_ids=chunks, chunk_tags=tags, **kw)  # type: ignore[arg-type]
                t1 = time.perf_counter_ns()
                engine.wait([job])
                t2 = time.perf_counter_ns()
                (result,) = engine.poll()
                record = backend.profile[-1]
                k = record.kernel
                if not result.success or k is None:
                    raise SystemExit(f"job {job} failed: {result}")
                rows["store" if is_store else "load"].append(_profile_row(record, k, t0, t1, t2))
        arrays = _kernel_alone(setup, engine)
    title = f"{page >> 10} KB pages, {total >> 20} MiB per job ({job_blocks} sub-blocks)"
    print(f"  {title}; µs, the median job of {args.repeats}")
    for direction, found in rows.items():
        med = sorted(found, key=lambda r: r["wall"])[len(found) // 2]  # one job's numbers: they add up
        best = min(r["wall"] for r in found)
        print(
            f"    {direction}: wall {med['wall']:.0f} (best {best:.0f}, {total / best / 1e3:.1f} GB/s); "
            f"kernel {med['kernel']:.0f} ({total / med['kernel'] / 1e3:.1f} GB/s); Python {med['python']:.0f}"
        )
        handover = "the engine's thread picks it up" if in_c else "to the direction thread"
        print(
            f"      before the kernel: submit (checks, blocks) {med['submit']:.0f}, {handover} {med['queue']:.0f}, "
            f"to the kernel call {med['to_call']:.0f}, into C {med['ctypes_in']:.0f}, order + cut {med['planning']:.0f}"
        )
        print(
            f"      in the kernel: {med['granules']:.0f} granules; caller busy {med['caller_busy']:.0f} "
            f"({med['caller_granules']:.0f} granules in {med['caller_takes']:.0f} takes), helper busy "
            f"{med['helper_busy']:.0f} ({med['helper_granules']:.0f} in {med['helper_takes']:.0f}), helper "
            f"started {med['helper_wake']:.0f} after the cut, caller waited {med['caller_wait']:.0f} at the end; "
            f"bytes hashed in the copy loop {med['fused']:.1%}, copied alone {med['plain']:.1%}, hashed from "
            f"memory {med['memhash']:.1%}; streaming stores {'on' if med['stream'] else 'off'}"
        )
        check = "seal" if direction == "store" else "verify"
        if in_c:  # sealing or verifying is the kernel's last step there
            after = f"{check} in the kernel; filed {med['integrity']:.0f} after it"
        else:
            after = f"out of C {med['ctypes_out']:.0f}, {check} {med['integrity']:.0f}, publish {med['publish']:.0f}"
        print(f"      after the kernel: {after}, to wait() returning {med['wake']:.0f}")
    for direction, (copy_us, fused_us, hash_us) in arrays.items():
        print(
            f"    kernel alone, one thread, {direction}: copy {copy_us:.0f} ({total / copy_us / 1e3:.1f} GB/s), copy "
            f"while hashing {fused_us:.0f} (+{fused_us / copy_us - 1:.0%}), hash of the same bytes from memory "
            f"{hash_us:.0f} ({total / hash_us / 1e3:.1f} GB/s)"
        )


def _profile_row(record: JobProfile, k: dict[str, int], t0: int, t1: int, t2: int) -> dict[str, float]:
    """One job's profile in µs (and byte shares)."""
    us = 1e-3
    moved = max(1, sum(k[f"{w}_{kind}"] for w in ("caller", "helper") for kind in ("fused", "plain")))
    kernel = (k["exit_ns"] - k["enter_ns"]) * us
    wall = (t2 - t0) * us
    return {
        "wall": wall,
        "kernel": kernel,
        "python": wall - kernel,
        "submit": (t1 - t0) * us,
        "queue": (record.started - record.submitted) * us,
        "to_call": (record.copy_entered - record.started) * us,
        "ctypes_in": (k["enter_ns"] - record.copy_entered) * us,
        "planning": (k["planned_ns"] - k["enter_ns"]) * us,
        "granules": k["granules"],
        "caller_busy": k["caller_busy_ns"] * us,
        "caller_granules": k["caller_granules"],
        "caller_takes": k["caller_takes"],
        "helper_busy": k["helper_busy_ns"] * us,
        "helper_granules": k["helper_granules"],
        "helper_takes": k["helper_takes"],
        "helper_wake": (k["helper_first_ns"] - k["planned_ns"]) * us if k["helper_first_ns"] else float("nan"),
        "caller_wait": (k["exit_ns"] - k["caller_done_ns"]) * us,
        "fused": (k["caller_fused"] + k["helper_fused"]) / moved,
        "plain": (k["caller_plain"] + k["helper_plain"]) / moved,
        "memhash": (k["caller_memhash"] + k["helper_memhash"]) / moved,
        "stream": k["stream"],
        "ctypes_out": (record.copy_returned * 1.0 - k["exit_ns"]) * us,
        "integrity": (record.checked - record.copy_returned) * us,
        "publish": (record.published - record.checked) * us,
        "wake": (t2 - record.published) * us if t2 > record.published else 0.0,
    }


def _kernel_alone(setup: _Setup, engine: CopyEngine) -> dict[str, tuple[float, float, float]]:
    """µs (best of 3) of the last profiled job's runs through the kernel on one thread: copy only, copy while
    hashing, and the hash of the same sub-blocks from memory (what a load verifying before its copy pays)."""
    kernel = _native.KERNEL
    assert kernel is not None
    chunks = torch.randperm(setup.plan.num_chunks)[: setup.job_blocks]
    block_ids = torch.randperm(setup.num_blocks)[: setup.job_blocks]
    job = {"group_sizes": [setup.job_blocks], "block_indices": [0], "block_ids": block_ids, "chunk_ids": chunks}
    runs = engine.plan_runs(**job)  # type: ignore[arg-type]
    slots = build_block_slots(
        setup.layout,
        setup.pool.integrity,
        group_sizes=[setup.job_blocks],
        block_indices=[0],
        chunk_ids=chunks,
        chunk_tags=None,
        blocks_per_chunk=setup.plan.blocks_per_chunk,
        host_row_bytes=setup.pool.row_bytes,
        host_slot_offset=setup.pool.slot_offset,
    )
    arrays = (runs.engine_offsets.numpy(), runs.host_offsets.numpy(), runs.lengths.numpy())
    first, size = slots.arrays()
    sums = np.zeros(len(slots), dtype=np.uint64)
    bases = {"kv_base": setup.kv.data_ptr(), "host_base": setup.pool.rows.data_ptr()}
    flags = _native.FUSED | _native.STREAM
    none = np.zeros(0, dtype=np.int64)
    order = np.argsort(first, kind="stable")
    hash_slots = (np.ascontiguousarray(first[order]), np.ascontiguousarray(size[order]), order.astype(np.int64))
    out: dict[str, tuple[float, float, float]] = {}
    for is_store in (True, False):
        copy_only = partial(kernel.job, None, arrays, None, is_store=is_store, digests=None, flags=flags, **bases)
        fused = partial(kernel.job, None, arrays, (first, size), is_store=is_store, digests=sums, flags=flags, **bases)
        from_memory = partial(
            kernel.copy_hash, (none, none, none, none), hash_slots, 128 << 10, setup.pool.rows.data_ptr(), sums
        )
        times = [min(_timed(fn, torch.device("cpu")) for _ in range(3)) * 1e6 for fn in (copy_only, fused, from_memory)]
        out["store" if is_store else "load"] = (times[0], times[1], times[2])
    return out


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
    parser.add_argument(
        "--profile", action="store_true", help="print where a checksummed CPU job's time goes (instead of the table)"
    )
    add_contend_argument(parser)
    args = parser.parse_args()
    with contended(args.contend):
        _main(args)


def _main(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} layers={args.layers} "
        f"blocks_per_chunk={args.blocks_per_chunk} total={args.total_mib} MiB, best of {args.repeats}"
    )
    kernel = _native.KERNEL
    builds = _native.load_kernels()
    gbps = [(1 << 20) / _native.measure_kernel(k) / 1e9 for k in builds]
    measured = ", ".join(f"{_native.kernel_name(k)} {g:.1f} GB/s" for k, g in zip(builds, gbps, strict=True))
    name = _native.kernel_name(kernel) if kernel else "not built"
    print(f"native copy kernel: {name} (copy+hash on one thread: {measured}; py path: native=False)")
    # hashing is compute-bound: on a shared machine its speed says how much CPU this run got
    threads = args.threads or min(4, max(1, torch.get_num_threads()))  # the engine's default
    _machine_check("machine check", threads)
    if args.profile:
        for text in args.pages.split(","):
            profile_page(_parse_size(text), args)
        _machine_check("machine check after", threads)
        return
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
