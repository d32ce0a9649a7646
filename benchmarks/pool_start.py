"""How long a host pool holds a worker's start, by pool size: the previous implementation against this one.

The previous private pool was ``torch.zeros`` of the rows (every page faulted in and zeroed before the
constructor returned); a shared pool faulted its ranges in the same way. ``HostPool`` now returns with the rows
mapped and faults them in on a background thread (``wait_prefaulted``). For each size the script prints the
seconds until the constructor returned (what holds the start), until the pages were resident, and the
baseline's seconds (``torch.zeros`` of the same bytes, in the same process). Run:
``python benchmarks/pool_start.py --gib 1 4 8`` (sizes must fit in free memory, one at a time).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvoffload.offload.pool import HostPool, HostPoolPlan, plan_host_pool


def _plan(nbytes: int, world_size: int = 1, rank: int = 0) -> HostPoolPlan:
    return plan_host_pool(
        worker_kv_bytes_per_block=256 << 10,
        world_size=world_size,
        blocks_per_chunk=1,
        cpu_bytes_to_use=nbytes * world_size,
        replicated=False,
        rank=rank,
    )


def _time_pool(nbytes: int, shared: bool) -> tuple[float, float]:
    plan = _plan(nbytes)
    start = time.perf_counter()
    pool = HostPool(plan, pin_memory=False, engine_id=f"bench-{uuid.uuid4().hex[:8]}" if shared else None)
    returned = time.perf_counter() - start
    if not pool.wait_prefaulted(600):
        raise SystemExit("the background prefault did not finish in 600 s")
    resident = time.perf_counter() - start
    pool.close()
    del pool
    gc.collect()
    return returned, resident


def _time_zeros(nbytes: int) -> float:
    start = time.perf_counter()
    rows = torch.zeros(nbytes, dtype=torch.uint8)
    seconds = time.perf_counter() - start
    del rows
    gc.collect()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0], help="pool sizes in GiB")
    args = parser.parse_args()
    print(f"{'GiB':>6} {'kind':>8} {'start held s':>13} {'resident s':>11} {'previous s':>11} {'ratio':>7}")
    for gib in args.gib:
        nbytes = int(gib * (1 << 30))
        previous = _time_zeros(nbytes)
        for shared in (False, True):
            returned, resident = _time_pool(nbytes, shared)
            kind = "shared" if shared else "private"
            ratio = previous / returned if returned else float("inf")
            print(f"{gib:>6.1f} {kind:>8} {returned:>13.4f} {resident:>11.3f} {previous:>11.3f} {ratio:>6.0f}x")


if __name__ == "__main__":
    main()
