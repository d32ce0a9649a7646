"""The demo's worker hook: the simulated forward pass inside each worker process, and the memcpy probe.

The scheduler side sends every StepPlan with two attachments (:func:`step_attachments`): the blocks the forward
pass computes this step, ``(group, block_id, seed)`` triples, and the blocks loaded this step to check,
``(job_id, group, block_id, seed)``. After the step's loads (``after_step``) the hook verifies the pages of
every successfully loaded block byte for byte, then writes the computed blocks' deterministic KV, and replies
``[checked, mismatched, first mismatched block ids...]``. At shutdown (``finish``) it times one plain copy of
``memcpy_probe_bytes`` so the demo can show its transfer throughput as a share of a memcpy on the same machine.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping, Sequence

import torch

from kvoffload._generated import StepPlan, WorkerReport
from kvoffload._ints import check_int
from kvoffload._packed import Int64Array
from kvoffload.demo.sim_engine import fill_blocks, verify_blocks
from kvoffload.errors import WireError
from kvoffload.runtime.hooks import WorkerContext

__all__ = ["HOOK", "DemoHook", "memcpy_gbps_of", "step_attachments", "step_stats"]

HOOK = f"{__name__}:DemoHook"
"""The dotted path the demo gives ``WorkerCluster(hook=...)``."""

_F64 = struct.Struct("<d")
_MAX_REPORTED = 16  # mismatched block ids sent back per step (the count is always exact)


def step_attachments(fill: Sequence[int] = (), verify: Sequence[int] = ()) -> list[bytes]:
    """The two frames of a step: flat ``(group, block, seed)`` fills and ``(job, group, block, seed)`` checks."""
    return [Int64Array(fill).tobytes(), Int64Array(verify).tobytes()]


def step_stats(extras: Sequence[memoryview]) -> tuple[int, list[int]]:
    """``(blocks verified, mismatched block ids)`` from one worker's step reply (ids capped at 16 per step)."""
    stats = Int64Array.from_buffer(extras[0]).tolist()
    return stats[0], stats[2:]


def memcpy_gbps_of(extras: Sequence[memoryview]) -> float | None:
    """The memcpy bandwidth one worker measured at shutdown (None when its final reply carried none)."""
    return _F64.unpack(bytes(extras[0]))[0] if extras else None


class DemoHook:
    """Fills and verifies the simulated engine's KV in one worker process (see module docstring).

    Options: ``memcpy_probe_bytes`` (int >= 0, default 0: no probe).
    """

    def __init__(self, context: WorkerContext) -> None:
        self._kv = context.kv
        self._layout = context.layout
        self._rank = context.rank
        self._probe_bytes = _probe_bytes(context.options)
        self._fill: list[tuple[int, int, int]] = []
        self._verify: list[tuple[int, int, int, int]] = []

    def before_step(self, plan: StepPlan, attachments: Sequence[memoryview]) -> None:
        """Decode this step's fill and verify lists."""
        if len(attachments) != 2:
            raise WireError(f"a simulated step needs 2 attachments (fill, verify), got {len(attachments)}")
        flat = Int64Array.from_buffer(attachments[0]).tolist()
        self._fill = [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat) - 2, 3)]
        flat = Int64Array.from_buffer(attachments[1]).tolist()
        self._verify = [(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(0, len(flat) - 3, 4)]

    def after_step(self, plan: StepPlan, report: WorkerReport) -> Sequence[bytes]:
        """Verify the blocks of this step's successful loads, then write the computed blocks (the forward pass)."""
        loaded = {r.job_id for r in report.results if not r.is_store and r.success}
        checked = [(g, b, s) for job, g, b, s in self._verify if job in loaded]
        bad = verify_blocks(self._kv, self._layout, self._rank, checked)
        fill_blocks(self._kv, self._layout, self._rank, self._fill)
        self._fill, self._verify = [], []
        return [Int64Array([len(checked), len(bad), *bad[:_MAX_REPORTED]]).tobytes()]

    def finish(self, report: WorkerReport) -> Sequence[bytes]:
        """Time a plain memcpy of ``memcpy_probe_bytes`` (0 GB/s when the probe is off)."""
        return [_F64.pack(_memcpy_gbps(self._probe_bytes))]

    def close(self) -> None:
        """Nothing to release: the KV memory belongs to the worker."""


def _probe_bytes(options: Mapping[str, object]) -> int:
    return check_int("memcpy_probe_bytes", options.get("memcpy_probe_bytes", 0), 0, value_first=True)


def _memcpy_gbps(nbytes: int) -> float:
    """Bandwidth of one plain torch copy of ``nbytes`` (best of three): what our copies are compared to."""
    if nbytes <= 0:
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9
