"""GPU <-> host GB/s of the CUDA copy backend against the link's ceiling measured in the same run, and what
offloading costs the engine's step. ``python benchmarks/transfer.py --device cuda`` runs it.

Each config ``PAGE`` or ``PAGExLAYERS`` (default ``32K,256K,2M,32Kx16``) lays engine memory out layer-major
(LAYERS layers of ``(num_blocks, PAGE)``, default 1: a block is one page); a transfer moves ``--blocks``
(1000) random blocks to or from random host chunks: a store, a load, and a store and a load at once. Each
runs in every way the backend moves runs (``auto``: its rule; ``dma``, ``gather``, ``kernel``: forced), with
checksums and without; GB/s are best of ``--repeats``, timed from submit to completion (hashing included).
The ceiling: one pinned ``cudaMemcpyAsync`` of the same bytes each way, and both ways at once on two streams.

The engine's cost: a compute stream runs a bf16 matmul loop as its step (``--matmul`` size,
``--matmuls-per-step``); its median step time without offloads, then with a store and a load in flight at
all times (each way, checksums on), and the GB/s those offloads reached meanwhile.

Prints tables; ``--json PATH`` writes the summary (rewritten after each config, so a cut-short run keeps what
it measured). ``--budget-s`` skips what would not fit.

    python benchmarks/transfer.py --device cuda [--configs 32K,256K,2M,32Kx16] [--blocks 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvoffload import KVCacheTensor
from kvoffload.offload.pool import HostPool, plan_host_pool
from kvoffload.offload.worker.copy import CopyEngine, build_transfer_layout
from kvoffload.offload.worker.copy._cuda import CudaBackend
from kvoffload.offload.worker.copy._cuda_plan import DMA_MIN_BYTES, Policy

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MODES = ("auto", "dma", "gather", "kernel")
DIRECTIONS = ("store", "load", "both")


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    return int(float(text[:-1]) * _UNITS[text[-1]]) if text[-1] in _UNITS else int(text)


def _config(text: str) -> tuple[str, int, int]:
    page, _, layers = text.partition("x")
    return text, _size(page), int(layers or 1)


def _wall(fn: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def ceiling(nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of one pinned ``cudaMemcpyAsync`` of ``nbytes`` each way, and of both at once (total bytes)."""
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    device = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def store() -> None:
        with torch.cuda.stream(streams[0]):
            host[0].copy_(device[0], non_blocking=True)

    def load() -> None:
        with torch.cuda.stream(streams[1]):
            device[1].copy_(host[1], non_blocking=True)

    def both() -> None:
        store()
        load()

    out = {}
    for name, fn, moved in (("store", store, nbytes), ("load", load, nbytes), ("both", both, 2 * nbytes)):
        fn()  # warm up
        out[name] = moved / min(_wall(fn) for _ in range(repeats)) / 1e9
    return out


class Bench:
    """One config: engine memory on the GPU, a registered host pool, two copy engines (checksums on, off)."""

    def __init__(self, page: int, layers: int, args: argparse.Namespace) -> None:
        self.blocks = args.blocks
        num_blocks = 2 * self.blocks
        block_bytes = page * layers
        self.bytes = self.blocks * block_bytes
        names = tuple(f"layer{i}" for i in range(layers))
        size = num_blocks * block_bytes
        placement = KVCacheTensor(size=size, layers=names, layer_stride=num_blocks * page, block_stride=page)
        self.layout = build_transfer_layout(
            [placement], [[(n, page) for n in names]], num_blocks=num_blocks, worker_kv_bytes_per_block=block_bytes
        )
        plan = plan_host_pool(
            worker_kv_bytes_per_block=block_bytes,
            world_size=1,
            blocks_per_chunk=1,
            cpu_bytes_to_use=(2 * self.blocks + 8) * -(-block_bytes // 4096) * 4096,
            replicated=False,
            rank=0,
        )
        started = time.perf_counter()
        self.pool = HostPool(plan)
        self.construct_s = time.perf_counter() - started
        if not self.pool.wait_pinned(timeout=300):
            raise SystemExit(f"the host pool was not registered: {self.pool.pin_error}")
        registration = self.pool._res.registration
        self.register_s = registration.seconds if registration is not None else None
        self.kv = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
        self.engines = {c: CopyEngine(self.kv, self.layout, self.pool, checksums=c) for c in (True, False)}
        self.job = 0
        order = torch.randperm(num_blocks)
        self.stored, self.loaded = order[: self.blocks], order[self.blocks :]
        chunks = torch.randperm(plan.num_chunks)[: 2 * self.blocks]
        self.chunks = {True: chunks[: self.blocks], False: chunks[self.blocks :]}  # (A, B) per engine pair
        self.tags = torch.randint(1, 1 << 62, (self.blocks,), dtype=torch.int64)

    def backend(self, checksums: bool) -> CudaBackend:
        backend = self.engines[checksums]._backend
        assert isinstance(backend, CudaBackend)
        return backend

    def submit(self, engine: CopyEngine, store: bool, chunks: torch.Tensor) -> int:
        self.job += 1
        submit = engine.submit_store if store else engine.submit_load
        blocks = self.stored if store else self.loaded
        submit(self.job, group_sizes=[self.blocks], block_indices=[0], block_ids=blocks, chunk_ids=chunks)
        return self.job

    def transfer(self, checksums: bool, direction: str) -> tuple[float, float]:
        """Seconds from submit to completion of one transfer, and the summed copy seconds of its jobs."""
        engine = self.engines[checksums]
        a, b = self.chunks[True], self.chunks[False]
        started = time.perf_counter()
        if direction == "both":
            jobs = [self.submit(engine, True, b), self.submit(engine, False, a)]
        else:
            jobs = [self.submit(engine, direction == "store", a)]
        engine.wait(jobs, timeout=120)
        wall = time.perf_counter() - started
        results = engine.poll()
        bad = [r for r in results if not r.success]
        if bad or len(results) != len(jobs):
            raise SystemExit(f"transfer failed: {bad or results}")
        return wall, sum(r.seconds for r in results)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.pool.close()


def bench_config(name: str, page: int, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(page, layers, args)
    top = ceiling(bench.bytes, args.repeats)
    rows = []
    kernel_error = None
    try:
        bench.transfer(True, "store")  # the chunks A every load reads, sealed with checksums
        for checksums in (True, False):
            for mode in args.modes:
                backend = bench.backend(checksums)
                backend.policy = Policy(mode=mode)
                if mode == "kernel" and backend._kernel_now() is None:
                    kernel_error = backend.kernel_error or "the zero-copy kernel did not load (no Triton?)"
                    continue
                for direction in DIRECTIONS:
                    bench.transfer(checksums, direction)  # warm up: compiles the kernel, fills the allocator
                    timings = [bench.transfer(checksums, direction) for _ in range(args.repeats)]
                    wall, copy = min(timings)
                    moved = bench.bytes * (2 if direction == "both" else 1)
                    gbps = moved / wall / 1e9
                    rows.append(
                        {
                            "config": name,
                            "page_bytes": page,
                            "layers": layers,
                            "mode": mode,
                            "checksums": checksums,
                            "direction": direction,
                            "gbps": gbps,
                            "copy_gbps": moved / copy / 1e9 if direction != "both" else None,
                            "vs_ceiling": gbps / top[direction],
                        }
                    )
                kernel_error = backend.kernel_error or kernel_error
    finally:
        bench.close()
    return {
        "config": name,
        "bytes_per_transfer": bench.bytes,
        "pool_bytes": bench.pool.pin_bytes,
        "pool_construct_s": bench.construct_s,
        "pool_register_s": bench.register_s,
        "ceiling": top,
        "rows": rows,
        "kernel_error": kernel_error,
    }


def engine_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Median step time of a matmul loop alone and with offloads in flight (each mode, checksums on)."""
    _, page, layers = _config(args.engine_config)
    bench = Bench(page, layers, args)
    n = args.matmul
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    c = torch.empty_like(a)

    def steps(mode: str | None) -> tuple[float, float, float]:
        engine = bench.engines[True]
        if mode is not None:
            bench.backend(True).policy = Policy(mode=mode)
        inflight: set[int] = set()
        moved, gpu_ms, wall_ms = 0, [], []
        window = 0.0
        for step in range(args.steps + 3):
            if mode is not None:
                for result in engine.poll():
                    inflight.discard(result.job_id)
                    moved += result.num_bytes if step >= 3 and result.success else 0
                if not inflight:
                    a_chunks, b_chunks = bench.chunks[True], bench.chunks[False]
                    inflight = {bench.submit(engine, True, b_chunks), bench.submit(engine, False, a_chunks)}
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began = time.perf_counter()
            start.record()
            for _ in range(args.matmuls_per_step):
                torch.mm(a, b, out=c)
            end.record()
            end.synchronize()
            if step >= 3:  # warm-up steps excluded
                wall_ms.append((time.perf_counter() - began) * 1e3)
                gpu_ms.append(start.elapsed_time(end))
                window += wall_ms[-1] / 1e3
        if inflight:
            engine.wait(inflight, timeout=120)
            engine.poll()
        return statistics.median(gpu_ms), statistics.median(wall_ms), moved / window / 1e9

    try:
        bench.transfer(True, "store")
        base_gpu, base_wall, _ = steps(None)
        rows = []
        for mode in args.modes:
            if mode == "kernel" and bench.backend(True)._kernel_now() is None:
                continue
            gpu, wall, gbps = steps(mode)
            rows.append(
                {"mode": mode, "step_ms": gpu, "step_wall_ms": wall, "slowdown": gpu / base_gpu - 1, "gbps": gbps}
            )
    finally:
        bench.close()
    return {
        "config": args.engine_config,
        "matmul": n,
        "matmuls_per_step": args.matmuls_per_step,
        "base_step_ms": base_gpu,
        "base_step_wall_ms": base_wall,
        "with_offloads": rows,
    }


def suggest_threshold(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """Where DMA overtakes the kernel (store and load, no checksums, one page per block): the smallest page
    from which DMA is at least as fast at every larger page."""
    speed: dict[tuple[int, str], float] = {}
    for config in configs:
        for row in config["rows"]:
            if row["layers"] == 1 and not row["checksums"] and row["direction"] != "both":
                key = (row["page_bytes"], row["mode"])
                speed[key] = speed.get(key, 0.0) + row["gbps"]
    pages = sorted({p for p, m in speed if m == "dma" and (p, "kernel") in speed})
    wins = [p for p in pages if speed[p, "dma"] >= speed[p, "kernel"]]
    suggested = next((p for p in pages if all(q in wins for q in pages if q >= p)), None)
    return {"dma_min_bytes": DMA_MIN_BYTES, "dma_wins_from_page": suggested, "pages_compared": pages}


def _print_config(config: dict[str, Any]) -> None:
    top = config["ceiling"]
    print(
        f"\n{config['config']}: {config['bytes_per_transfer'] / 1e6:.0f} MB per transfer; ceiling GB/s store "
        f"{top['store']:.1f} load {top['load']:.1f} both {top['both']:.1f}; pool {config['pool_bytes'] / 1e9:.2f} GB "
        f"constructed in {config['pool_construct_s'] * 1e3:.1f} ms, "
        f"registered in {config['pool_register_s'] or 0:.2f} s"
    )
    print(f"{'mode':>7} {'checksums':>9} {'direction':>9} {'GB/s':>7} {'copy GB/s':>9} {'of ceiling':>10}")
    for row in config["rows"]:
        copy = f"{row['copy_gbps']:9.1f}" if row["copy_gbps"] is not None else f"{'':9}"
        print(
            f"{row['mode']:>7} {('on' if row['checksums'] else 'off'):>9} {row['direction']:>9} {row['gbps']:7.1f} "
            f"{copy} {row['vs_ceiling']:10.0%}"
        )
    if config["kernel_error"]:
        print(f"kernel: {config['kernel_error']}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda"], default="cuda")
    parser.add_argument("--configs", default="32K,256K,2M,32Kx16", help="PAGE or PAGExLAYERS, comma-separated")
    parser.add_argument("--blocks", type=int, default=1000, help="blocks per transfer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), type=lambda s: s.split(","))
    parser.add_argument("--engine-config", default="256K", help="the config of the step-time measurement")
    parser.add_argument("--matmul", type=int, default=8192)
    parser.add_argument("--matmuls-per-step", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--budget-s", type=float, default=None, help="skip configs that would start after this")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    started = time.monotonic()
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "blocks": args.blocks,
        "repeats": args.repeats,
        "configs": [],
        "skipped": [],
    }
    try:
        import triton

        summary["triton"] = triton.__version__
    except ImportError:
        summary["triton"] = None
    print(f"{summary['device']} torch={summary['torch']} cuda={summary['cuda']} triton={summary['triton']}")

    def save() -> None:
        if args.json is not None:
            args.json.write_text(json.dumps(summary, indent=1))

    for text in args.configs.split(","):
        if args.budget_s is not None and time.monotonic() - started > args.budget_s:
            summary["skipped"].append(text)
            continue
        name, page, layers = _config(text)
        summary["configs"].append(bench_config(name, page, layers, args))
        _print_config(summary["configs"][-1])
        summary["threshold"] = suggest_threshold(summary["configs"])
        save()
    print(f"\nthreshold: {summary.get('threshold')}")
    if args.budget_s is None or time.monotonic() - started <= args.budget_s:
        cost = summary["engine"] = engine_cost(args)
        print(
            f"\nengine step ({cost['config']}, {cost['matmuls_per_step']} x bf16 matmul {cost['matmul']}): "
            f"{cost['base_step_ms']:.2f} ms alone"
        )
        for row in cost["with_offloads"]:
            print(
                f"{row['mode']:>7}: {row['step_ms']:.2f} ms ({row['slowdown']:+.1%}), "
                f"wall {row['step_wall_ms']:.2f} ms, offloads {row['gbps']:.1f} GB/s meanwhile"
            )
    else:
        summary["skipped"].append("engine")
    summary["seconds"] = time.monotonic() - started
    save()


if __name__ == "__main__":
    main(sys.argv[1:])
