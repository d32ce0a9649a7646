"""Shared-memory pool files and host memory checks: naming, sweeping stale files, fitting.

A shared host pool is one file under ``/dev/shm`` that every rank maps (vLLM 0.33's shared offload region),
so a replicated offload (``replicated_layout``) keeps one copy of the cache for all ranks.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from kvoffload._procs import pid_alive
from kvoffload.errors import ConfigError, HostMemoryError
from kvoffload.offload.pool._plan import HostPoolPlan

__all__ = [
    "available_host_memory_bytes",
    "check_pools_fit",
    "owned_pool_id",
    "shared_pool_path",
    "sweep_stale_pools",
]

_SAFE_ENGINE_ID = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def available_host_memory_bytes() -> int:
    """Host memory the kernel could hand out now: ``MemAvailable`` when readable, else free physical pages."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def shared_pool_path(engine_id: str, shm_dir: str | os.PathLike[str] = "/dev/shm") -> Path:
    """Path of the shared-memory file that every rank of engine ``engine_id`` maps."""
    if not _SAFE_ENGINE_ID.fullmatch(engine_id):
        raise ConfigError(
            f"engine_id={engine_id!r} cannot name a shared-memory file: use 1-200 characters from [A-Za-z0-9_.-]"
        )
    return Path(shm_dir) / f"kvoffload_{engine_id}.mmap"


_OWNED_NAME = re.compile(r"kvoffload_.+\.pid([0-9]{1,10})\.mmap")


def owned_pool_id(engine_id: str, pid: int | None = None) -> str:
    """A shared-pool id that names its owner process (default: this one): ``{engine_id}.pid{pid}``.

    The owner is the process that chose the name and outlives every rank mapping it (the scheduler of a
    :class:`~kvoffload.runtime.cluster.WorkerCluster`). If it dies without removing the file (SIGKILL),
    :func:`sweep_stale_pools` in a later run sees the owner is gone and removes it.
    """
    return f"{engine_id}.pid{os.getpid() if pid is None else pid}"


def sweep_stale_pools(shm_dir: str | os.PathLike[str] = "/dev/shm") -> list[Path]:
    """Remove shared-pool files named by :func:`owned_pool_id` whose owner process no longer exists.

    Returns the removed paths. Files without an owner pid in their name are never touched; a reused pid only
    keeps a stale file longer (it is never a reason to remove a live one).
    """
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for path in sorted(Path(shm_dir).glob("kvoffload_*.mmap")):
            match = _OWNED_NAME.fullmatch(path.name)
            if match is None or pid_alive(int(match.group(1))):
                continue
            with contextlib.suppress(FileNotFoundError, PermissionError):
                path.unlink()
                removed.append(path)
    return removed


def check_pools_fit(plans: list[HostPoolPlan], *, shared: bool, available: int | None = None) -> None:
    """Refuse, before any rank allocates, host pools that together exceed the memory available now.

    ``plans`` holds one plan per rank of one machine; a shared pool is one file for all of them (the largest
    plan's ``total_bytes``), private pools add up (``num_chunks * slot_bytes`` each). Raises HostMemoryError
    with the numbers.
    """
    if not plans:
        return
    if shared:
        needed = max(plan.total_bytes for plan in plans)
        what = f"one shared pool of {needed} bytes for {len(plans)} ranks"
    else:
        sizes = [plan.num_chunks * plan.slot_bytes for plan in plans]
        needed = sum(sizes)
        what = f"{len(plans)} ranks x {max(sizes)} bytes" if len(set(sizes)) == 1 else f"ranks of {sizes} bytes"
    free = available_host_memory_bytes() if available is None else available
    if needed > free:
        raise HostMemoryError(
            f"host pools need {needed} bytes ({what}) but only {free} bytes of host memory are available; "
            f"lower cpu_bytes_to_use (={plans[0].cpu_bytes_to_use}, the total across all workers)"
        )
