"""The demo's worker hook: the simulated forward pass inside each worker process, and the memcpy probe.

The scheduler side sends every StepPlan with two attachments (:func:`step_attachments`): the blocks the forward
pass computes this step, ``(group, block_id, seed)`` triples, and the blocks loaded this step to check,
``(job_id, group, block_id, seed)``. After the step's loads (``after_step``) the hook verifies the pages of
every successfully loaded block byte for byte, then writes the computed blocks' deterministic KV, and replies
``[checked, mismatched, first mismatched block ids...]``. At shutdown (``finish``) it times one plain copy of
``memcpy_probe_bytes`` so the demo can show its transfer throughput as a share of a memcpy on the same machine,
and the checksum cost (:func:`_checksum_probe`): the same store and load of the worker's own blocks (up to
``memcpy_probe_bytes``) through two copy engines over a private host pool, one with content checksums and one
without, on the worker's memory, layout and copy threads, back to back; the extra time of the checksummed
jobs as a share of the plain copy of the same bytes (as ``benchmarks/transfer.py`` reports it). Both passes are
timed in the same moment on the same machine: comparing the run's own GB/s with a pass without checksums run
at another time would mostly measure the machine's noise. The loads write back the bytes just stored, so the
engine memory is left as it was.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvoffload._generated import OffloadingConfig, StepPlan, WorkerReport
from kvoffload._ints import cdiv, check_int
from kvoffload._packed import Int64Array
from kvoffload.demo.sim_engine import fill_blocks, verify_blocks
from kvoffload.errors import TransferError, WireError
from kvoffload.offload.pool import PAGE_SIZE, HostPool, plan_host_pool
from kvoffload.offload.worker.copy import CopyEngine, TransferLayout
from kvoffload.runtime.hooks import WorkerContext

__all__ = [
    "HOOK",
    "DemoHook",
    "TierFigures",
    "checksum_cost_of",
    "memcpy_gbps_of",
    "step_attachments",
    "step_stats",
    "tier_figures_of",
]

HOOK = f"{__name__}:DemoHook"
"""The dotted path the demo gives ``WorkerCluster(hook=...)``."""

_F64 = struct.Struct("<d")
_PROBES = struct.Struct("<3d")  # memcpy GB/s, store and load checksum cost (NaN: not measured)
_TIER_PROBE_BYTES = 16 << 20
"""The most bytes of records a tier's probe moves each way per repeat (an object store moves tens of MB/s here)."""
_TIER = struct.Struct("<6d")  # per tier: write and read GB/s in the run, of the tier's probe, of the raw baseline
_REPEATS = 9
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
    return _F64.unpack_from(bytes(extras[0]))[0] if extras else None


def checksum_cost_of(extras: Sequence[memoryview]) -> tuple[float, float] | None:
    """``(store, load)`` checksum cost one worker measured at shutdown: the extra time of its checksummed jobs
    over the same jobs without checksums, as a share of a plain memcpy of the same bytes (None: not measured)."""
    if not extras or len(extras[0]) != _PROBES.size:
        return None
    _, store, load = _PROBES.unpack(bytes(extras[0]))
    return None if math.isnan(store) or math.isnan(load) else (store, load)


@dataclass(frozen=True, slots=True)
class TierFigures:
    """One rank's figures of one tier (NaN where nothing was moved): its write and read GB/s in the run (bytes per
    second with a job of the tier in flight) and, at shutdown, the tier's and its raw baseline's on the same
    records timed side by side (:func:`kvoffload.tiers.compare_with_raw`)."""

    write_gbps: float
    read_gbps: float
    probe_write_gbps: float
    probe_read_gbps: float
    raw_write_gbps: float
    raw_read_gbps: float


def tier_figures_of(extras: Sequence[memoryview]) -> list[TierFigures]:
    """The tier figures of one worker's final reply, in tier order (empty without tiers)."""
    if len(extras) < 2:
        return []
    frame = bytes(extras[1])
    return [TierFigures(*_TIER.unpack_from(frame, at)) for at in range(0, len(frame), _TIER.size)]


class DemoHook:
    """Fills and verifies the simulated engine's KV in one worker process (see module docstring).

    Options: ``memcpy_probe_bytes`` (int >= 0, default 0: neither probe runs).
    """

    def __init__(self, context: WorkerContext) -> None:
        self._kv = context.kv
        self._layout = context.layout
        self._config = context.config
        self._rank = context.rank
        self._tiers = context.tiers
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
        """Time a plain memcpy of ``memcpy_probe_bytes`` and the checksum cost (0 GB/s and NaN when off), and
        each tier's figures against its raw baseline."""
        memcpy = _memcpy_gbps(self._probe_bytes)
        store, load = math.nan, math.nan
        if memcpy > 0:
            store, load = _checksum_probe(self._kv, self._layout, self._config, self._probe_bytes, memcpy)
        return [_PROBES.pack(memcpy, store, load), self._tier_figures()]

    def _tier_figures(self) -> bytes:
        if self._tiers is None:
            return b""
        from kvoffload.tiers import compare_with_raw

        out = bytearray()
        row_bytes = self._tiers.namespace.row_bytes
        for t, tier in enumerate(self._tiers.tiers):
            st = tier.stats()
            write = st.bytes_written / st.write_busy_seconds / 1e9 if st.write_busy_seconds else math.nan
            read = st.bytes_read / st.read_busy_seconds / 1e9 if st.read_busy_seconds else math.nan
            probe_bytes = min(self._probe_bytes, _TIER_PROBE_BYTES)
            keys = self._tiers.recent_keys(t)[-max(1, probe_bytes // max(1, row_bytes)) :]
            both = compare_with_raw(tier, keys, row_bytes) if self._probe_bytes else None
            probe = (math.nan,) * 4
            if both is not None:
                probe = (both.tier.write_gbps, both.tier.read_gbps, both.raw.write_gbps, both.raw.read_gbps)
            out += _TIER.pack(write, read, *probe)
        return bytes(out)

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


def _checksum_probe(
    kv: torch.Tensor, layout: TransferLayout, config: OffloadingConfig, nbytes: int, memcpy_gbps: float
) -> tuple[float, float]:
    """``(store, load)`` checksum cost: best of nine of one store and one load of up to ``nbytes`` of the
    worker's blocks (every group, in random order), with checksums on and off in turn; the extra seconds
    with checksums per second of a plain memcpy of the same bytes (NaN when the layout moves nothing)."""
    per_block = sum(g.bytes_per_block for g in layout.groups)
    if per_block == 0 or layout.num_blocks == 0:
        return math.nan, math.nan
    blocks = max(1, min(layout.num_blocks, nbytes // per_block))
    bpc = config.cache.blocks_per_chunk
    groups = len(layout.groups)
    chunks = groups * cdiv(blocks, bpc)
    row = cdiv(layout.worker_kv_bytes_per_block * bpc, PAGE_SIZE) * PAGE_SIZE
    plan = plan_host_pool(
        worker_kv_bytes_per_block=layout.worker_kv_bytes_per_block,
        world_size=1,
        blocks_per_chunk=bpc,
        cpu_bytes_to_use=chunks * row,
        replicated=False,
        rank=0,
    )
    ids = torch.randperm(layout.num_blocks)[:blocks].repeat(groups)
    tags = torch.arange(1, chunks + 1)

    def run(engine: CopyEngine, job_id: int, is_store: bool) -> float:
        submit = engine.submit_store if is_store else engine.submit_load
        start = time.perf_counter()
        submit(
            job_id,
            group_sizes=[blocks] * groups,
            block_indices=[0] * groups,
            block_ids=ids,
            chunk_ids=torch.arange(chunks),
            chunk_tags=tags,
        )
        engine.wait([job_id])
        seconds = time.perf_counter() - start
        (result,) = engine.poll()
        if not result.success:
            raise TransferError(f"checksum probe: job {job_id} (store={is_store}) failed: {result.error}")
        return seconds

    best = {(on, is_store): math.inf for on in (True, False) for is_store in (True, False)}
    threads = torch.get_num_threads()
    with (
        HostPool(plan) as pool,
        CopyEngine(kv, layout, pool, cpu_threads=threads) as checked,
        CopyEngine(kv, layout, pool, cpu_threads=threads, checksums=False) as unchecked,
    ):
        job_id = 0
        for repeat in range(_REPEATS):
            # both engines use the same chunks: each pass stores, then loads back what it stored
            for engine in (checked, unchecked) if repeat % 2 == 0 else (unchecked, checked):
                for is_store in (True, False):
                    job_id += 1
                    key = (engine.checksums, is_store)
                    best[key] = min(best[key], run(engine, job_id, is_store))
    plain = blocks * per_block / (memcpy_gbps * 1e9)
    store, load = ((best[True, d] - best[False, d]) / plain for d in (True, False))
    return store, load
