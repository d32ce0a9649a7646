"""How long a background thread's work takes while the engine loop polls the native copy engine, with the poll
bound as it was (dropping the GIL around the C call) and as it is now (keeping it), side by side.

vLLM's engine loop calls the connector at every step, and the worker half polls the copy engine each time; while
a request waits for a tier lookup the loop spins at about 2,000 steps a second. A thread that drops the GIL for
microseconds at that rate starves the process's other threads: each drop wakes a waiter, which loses the race to
take it back and restarts its 5 ms switch interval, so it never asks for the GIL. This runs that loop (the poll
plus ``--step-us`` of Python work per step) on the main thread while a background thread does what a tier
lookup does: ``--keys`` short waits (a stand-in for a HEAD each) on a two-thread pool, then collects them.
Reported per binding: the lookup's median, p90 and worst time over ``--lookups`` lookups, and their ratio.

    python benchmarks/engine_loop_gil.py [--lookups 40] [--keys 5] [--step-us 300]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from kvoffload import KVCacheTensor
from kvoffload.offload.pool import HostPool, plan_host_pool
from kvoffload.offload.worker.copy import CopyEngine, _native, build_transfer_layout
from kvoffload.offload.worker.copy._cpu_native import NativeCpuBackend

_PAGE, _BLOCKS = 4096, 16


def _python_work(micros: float) -> None:
    """About ``micros`` of interpreted work (the scheduler's per-step Python)."""
    end = time.perf_counter() + micros / 1e6
    while time.perf_counter() < end:
        pass


def _lookup(pool: ThreadPoolExecutor, keys: int) -> None:
    """What a tier lookup does: one short blocking wait per key on the tier's pool, collected in order."""
    list(pool.map(time.sleep, [0.0005] * keys))


def measure(poll: ctypes._CFuncPtr, args: tuple[int, ...], opts: argparse.Namespace) -> list[float]:
    """Lookup times (s) while the main thread loops: ``poll(*args)`` and ``--step-us`` of Python."""
    times: list[float] = []
    done = threading.Event()

    def background() -> None:
        with ThreadPoolExecutor(2) as pool:
            _lookup(pool, opts.keys)  # the pool's threads exist before timing
            for _ in range(opts.lookups):
                started = time.perf_counter()
                _lookup(pool, opts.keys)
                times.append(time.perf_counter() - started)
                time.sleep(0.01)
        done.set()

    thread = threading.Thread(target=background)
    thread.start()
    while not done.is_set():
        poll(*args)
        _python_work(opts.step_us)
    thread.join()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lookups", type=int, default=40)
    parser.add_argument("--keys", type=int, default=5)
    parser.add_argument("--step-us", type=float, default=300.0)
    opts = parser.parse_args()
    if _native.KERNEL is None:
        sys.exit("the native copy kernel is not built: pip install -e .")
    names = ("layer0",)
    placement = KVCacheTensor(size=_BLOCKS * _PAGE, layers=names, layer_stride=_BLOCKS * _PAGE, block_stride=_PAGE)
    layout = build_transfer_layout(
        [placement], [[("layer0", _PAGE)]], num_blocks=_BLOCKS, worker_kv_bytes_per_block=_PAGE
    )
    plan = plan_host_pool(
        worker_kv_bytes_per_block=_PAGE,
        world_size=1,
        blocks_per_chunk=1,
        cpu_bytes_to_use=1 << 20,
        replicated=False,
        rank=0,
    )
    kv = torch.zeros(_BLOCKS * _PAGE, dtype=torch.uint8)
    with HostPool(plan) as host, CopyEngine(kv, layout, host) as mover:
        backend = mover._backend
        if not isinstance(backend, NativeCpuBackend):
            sys.exit("the copy engine did not pick the native backend")
        engine = backend._engine
        records, chunks = engine._addresses
        args = (engine.handle, records, 1024, chunks, engine._chunks.size)
        # The binding before: the library's own function pointer, which drops the GIL around the call.
        dropping = _native.KERNEL.lib.kvcopy_engine_poll
        dropping.restype, dropping.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        dropping.argtypes += [ctypes.c_void_p, ctypes.c_int64]
        rows = []
        for label, poll in (("drops the GIL (before)", dropping), ("keeps the GIL (now)", engine._poll)):
            times = sorted(measure(poll, args, opts))
            rows.append((label, statistics.median(times), times[int(0.9 * (len(times) - 1))], times[-1]))
    print(f"{opts.lookups} lookups of {opts.keys} keys; engine loop: poll + {opts.step_us:g} us of Python per step")
    print(f"{'poll binding':<24}{'median ms':>11}{'p90 ms':>9}{'worst ms':>10}")
    for label, med, p90, worst in rows:
        print(f"{label:<24}{med * 1e3:>11.1f}{p90 * 1e3:>9.1f}{worst * 1e3:>10.1f}")
    print(f"median ratio (before / now): {rows[0][1] / rows[1][1]:.1f}x")


if __name__ == "__main__":
    main()
