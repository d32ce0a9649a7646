"""Enqueueing one planned job (:mod:`._cuda_plan`) with torch ops, on the current stream of any device.

On CUDA every op is asynchronous on the current stream; the returned tensors (indices, tile tables, their
pinned host copies, the staging buffer) are what the copies still read and must stay alive until the stream
has passed them. On CPU the same ops run at once (the tests compare their bytes with the CPU backend's).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from kvoffload.offload.worker.copy._cuda_plan import Gather, JobPlan, Policy, Runs, Tiles, plan_job
from kvoffload.offload.worker.copy._runs import CopyRuns

__all__ = ["TileLauncher", "enqueue_plan", "plan_runs", "transfer_runs"]

_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class TileLauncher(Protocol):
    """The zero-copy kernel's call (:class:`~._cuda_kernel.TileKernel`)."""

    def __call__(
        self, dst: torch.Tensor, src: torch.Tensor, table: torch.Tensor, num_tiles: int, tile_elements: int
    ) -> None: ...


def _elements(flat: torch.Tensor, size: int) -> torch.Tensor:
    """A flat uint8 tensor viewed as ``size``-byte elements (its tail past the last whole element dropped)."""
    return flat[: flat.numel() // size * size].view(_DTYPES[size])


def _to_device(values: np.ndarray, device: torch.device, keep: list[torch.Tensor]) -> torch.Tensor:
    """An int64 array on ``device``; on CUDA through pinned memory so the copy is asynchronous (the pinned
    buffer comes from torch's host allocator, which also holds it until the copy has run)."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if device.type == "cpu":
        return host
    pinned = host.pin_memory()
    out = pinned.to(device, non_blocking=True)
    keep += (pinned, out)
    return out


def _dma(kv: torch.Tensor, host: torch.Tensor, runs: Runs, is_store: bool) -> None:
    """One copy per run, straight between engine memory and the host pool."""
    for e, h, n in zip(runs.engine.tolist(), runs.host.tolist(), runs.length.tolist(), strict=True):
        if is_store:
            host[h : h + n].copy_(kv[e : e + n], non_blocking=True)
        else:
            kv[e : e + n].copy_(host[h : h + n], non_blocking=True)


def _gather(kv: torch.Tensor, host: torch.Tensor, plan: Gather, is_store: bool, keep: list[torch.Tensor]) -> None:
    """A store gathers the rows into staging, then one DMA per host stretch; a load the other way round."""
    width = plan.row_bytes // plan.element_bytes
    num_rows = kv.numel() // plan.row_bytes
    kv_rows = _elements(kv[: num_rows * plan.row_bytes], plan.element_bytes).view(num_rows, width)
    staging = torch.empty(plan.num_bytes, dtype=torch.uint8, device=kv.device)
    staged_rows = staging.view(_DTYPES[plan.element_bytes]).view(-1, width)
    index = _to_device(plan.rows, kv.device, keep)
    keep.append(staging)
    stretches = zip(
        plan.stretch_host.tolist(), plan.stretch_staging.tolist(), plan.stretch_length.tolist(), strict=True
    )
    if is_store:
        torch.index_select(kv_rows, 0, index, out=staged_rows)
        for h, s, n in stretches:
            host[h : h + n].copy_(staging[s : s + n], non_blocking=True)
    else:
        for h, s, n in stretches:
            staging[s : s + n].copy_(host[h : h + n], non_blocking=True)
        kv_rows.index_copy_(0, index, staged_rows)


def _tiles(
    kv: torch.Tensor, host: torch.Tensor, plan: Tiles, is_store: bool, kernel: TileLauncher, keep: list[torch.Tensor]
) -> None:
    """One launch of the zero-copy kernel over every tile."""
    table = _to_device(plan.table(), kv.device, keep)
    kv_elements, host_elements = _elements(kv, plan.element_bytes), _elements(host, plan.element_bytes)
    src, dst = (kv_elements, host_elements) if is_store else (host_elements, kv_elements)
    kernel(dst, src, table, len(plan), plan.tile_elements)


def enqueue_plan(
    kv: torch.Tensor, host: torch.Tensor, plan: JobPlan, is_store: bool, kernel: TileLauncher | None
) -> list[torch.Tensor]:
    """Issue a planned job's copies on the current stream; returns what must outlive them."""
    keep: list[torch.Tensor] = []
    if plan.tiles is not None:
        if kernel is None:
            raise RuntimeError("the job was planned for the zero-copy kernel but none was given")
        _tiles(kv, host, plan.tiles, is_store, kernel, keep)
    if plan.gather is not None:
        _gather(kv, host, plan.gather, is_store, keep)
    _dma(kv, host, plan.dma, is_store)
    return keep


def plan_runs(
    kv: torch.Tensor, host: torch.Tensor, runs: CopyRuns, is_store: bool, policy: Policy, kernel: bool
) -> JobPlan:
    """:func:`~._cuda_plan.plan_job` for ``runs`` between these two flat tensors."""
    return plan_job(
        runs.engine_offsets.numpy(),
        runs.host_offsets.numpy(),
        runs.lengths.numpy(),
        is_store=is_store,
        policy=policy,
        kernel=kernel,
        kv_ptr=kv.data_ptr(),
        host_ptr=host.data_ptr(),
    )


def transfer_runs(
    kv: torch.Tensor,
    host: torch.Tensor,
    runs: CopyRuns,
    is_store: bool,
    policy: Policy | None = None,
    kernel: TileLauncher | None = None,
) -> list[torch.Tensor]:
    """Plan and issue ``runs`` (store: ``kv`` → ``host``; load: back) on the current stream of ``kv``'s
    device; returns what must outlive the copies. ``kernel``: the zero-copy kernel, if it may run."""
    if not len(runs):
        return []
    plan = plan_runs(kv, host, runs, is_store, policy or Policy(), kernel is not None)
    return enqueue_plan(kv, host, plan, is_store, kernel)
