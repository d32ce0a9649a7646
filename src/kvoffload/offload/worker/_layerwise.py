"""Layer-wise transfers: the loads a step's forward pass reads, and the step's stores, copied one layer at a time.

An engine with per-layer hooks (vLLM's ``wait_for_layer_load`` / ``save_kv_layer``) can start computing layer
``i`` while layer ``i+1`` still loads, and store layer ``i`` as soon as its attention wrote it. Each job of the
plan is split into one sub-job per offloaded layer, copied by a second :class:`CopyEngine` whose layout holds
one layer per group (same host pool, same engine memory). The sub-jobs check each sub-block's key tag and
state; the content checksums cover a whole chunk (every layer), so they are verified (loads, on a thread beside
the copies) or sealed (stores, once every layer landed) over the host bytes before the job reports. A load
whose checksum fails is reported failed like any corrupt load: the engine recomputes it and drops what the
step computed from it (vLLM discards the step's output of a request whose load failed).
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Container, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvoffload._generated import JobResult, TransferJob
from kvoffload._ints import cdiv
from kvoffload._packed import Int32Array, Int64Array, pack_int64
from kvoffload._placement import CopySegment, GroupLayout, LayerPlacement, TransferLayout
from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.offload._direction import Direction
from kvoffload.offload.pool import BlockSlots, HostPool
from kvoffload.offload.worker.copy import CopyEngine, CopyJob, build_block_slots, check_job_ids

__all__ = ["LayerwiseCopies"]

_NUMBER = re.compile(r"\d+")


def _layer_number(name: str) -> float:
    """The first number in a layer's name (its place in the forward pass); names without one go last."""
    found = _NUMBER.search(name)
    return float(found.group()) if found else float("inf")


@dataclass(frozen=True)
class _GroupPart:
    """One group's share of a job: its block count and first block index, its engine blocks, chunks, tags."""

    size: int
    start: int
    blocks: np.ndarray
    chunks: np.ndarray
    tags: np.ndarray | None


@dataclass
class _Whole:
    """One plan job split into per-layer sub-jobs, until every sub-job (and its checksum pass) is done."""

    job: TransferJob
    direction: Direction
    started: float
    slots: BlockSlots | None
    parts: list[_GroupPart]
    pending: set[int] = field(default_factory=set)  # sub-job ids in flight
    issued: set[int] = field(default_factory=set)  # layer indices submitted
    num_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    corrupt: set[int] = field(default_factory=set)
    verify: Future[list[int]] | None = None


class LayerwiseCopies:
    """Per-layer loads and stores over ``pool`` (module docstring); ``every_load``: all loads are read by the
    step that plans them (``load_mode='sync'``), else only those marked ``sync``."""

    def __init__(
        self,
        layout: TransferLayout,
        kv_memory: torch.Tensor,
        pool: HostPool,
        *,
        checksums: bool = True,
        every_load: bool = False,
        hooked_groups: Collection[int] | None = None,
        cpu_threads: int | None = None,
    ) -> None:
        self._layout = layout
        # Forward order (the layer number in the name, e.g. model.layers.3.self_attn.attn), so that waiting
        # for layer i never waits behind a later layer of another group.
        placed = [(g, layer) for g, group in enumerate(layout.groups) for layer in group.layers]
        self._order: list[tuple[int, LayerPlacement]] = [
            placed[i] for i in sorted(range(len(placed)), key=lambda i: (_layer_number(placed[i][1].name), i))
        ]
        hooked = set(range(len(layout.groups))) if hooked_groups is None else set(hooked_groups)
        # Layers the engine calls no per-layer hook for (e.g. Mamba mixers): waited for before the forward pass.
        self._unhooked = {i for i, (g, _) in enumerate(self._order) if g not in hooked}
        per_layer = TransferLayout(
            groups=tuple(
                GroupLayout(
                    layers=(layer,),
                    segments=(
                        CopySegment(layer.engine_offset, layer.block_stride, layer.page_bytes, layer.host_offset),
                    ),
                    bytes_per_block=layer.page_bytes,
                )
                for _, layer in self._order
            ),
            num_blocks=layout.num_blocks,
            worker_kv_bytes_per_block=layout.worker_kv_bytes_per_block,
            engine_bytes=layout.engine_bytes,
        )
        # Tags and states are checked per sub-job; checksums span every layer of a chunk (checked below).
        self._engine = CopyEngine(kv_memory, per_layer, pool, cpu_threads=cpu_threads, checksums=False)
        self._index = {layer.name: i for i, (_, layer) in enumerate(self._order)}
        self._pool = pool
        self._host = memoryview(pool.rows.reshape(-1).numpy())  # type: ignore[arg-type]  # numpy is a buffer
        self._checksums = checksums
        self.every_load = every_load
        self._bpc = pool.plan.blocks_per_chunk
        self._whole: dict[int, _Whole] = {}
        self._parent: dict[int, tuple[int, int]] = {}  # sub-job id -> (plan job id, layer index)
        self._next_sub = 0
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-layerwise-verify")
        self._done: list[JobResult] = []
        self._refused: set[int] = set()  # plan jobs whose ids were refused (reported failed once)
        self.layer_waits = 0
        """``wait_layer`` calls that had a layer of a load to wait for (the engine's per-layer hook was used)."""
        self.layer_stores = 0
        """Per-layer store sub-jobs started from ``store_layer`` (not left to ``finish_stores``)."""

    @property
    def layer_names(self) -> list[str]:
        """The offloaded layers, in the order their sub-jobs are submitted (group, then the group's order)."""
        return [layer.name for _, layer in self._order]

    def takes(self, job: TransferJob) -> bool:
        """Whether a load is copied layer by layer (the step's forward pass reads it)."""
        return self.every_load or job.sync

    @property
    def in_flight(self) -> frozenset[int]:
        """Plan jobs not reported yet."""
        return frozenset(self._whole)

    # ---------------------------------------------------------------------------------------- submitting

    def start_loads(self, jobs: Sequence[TransferJob]) -> None:
        """Submit every layer of the loads, layer by layer across the jobs (layer 0 of all first), and start
        verifying their checksums beside the copies."""
        opened: list[_Whole] = []
        for job in jobs:
            whole = self._open(job, Direction.LOAD)
            if whole is None:
                continue
            opened.append(whole)
            if whole.slots is not None and self._checksums:
                whole.verify = self._verifier.submit(self._verify, whole.slots)
        for i in range(len(self._order)):
            for whole in opened:
                self._submit_layer(whole, i)

    def wait_unhooked(self, timeout: float | None = None) -> None:
        """Before the forward pass: wait for the loads' layers that get no per-layer hook from the engine."""
        subs = self._load_subs(self._unhooked)
        if subs:
            self._engine.wait(subs, timeout)

    def store_layer(self, layer_name: str, jobs: Sequence[TransferJob]) -> None:
        """Layer ``layer_name`` of this step's stores is final in engine memory: copy it now."""
        i = self._index.get(layer_name)
        if i is None:
            return  # a layer kvoffload does not offload
        for job in jobs:
            whole = self._store(job)
            if whole is not None and i not in whole.issued:
                self._submit_layer(whole, i)
                self.layer_stores += 1

    def finish_stores(self, jobs: Sequence[TransferJob] | None = None) -> None:
        """After the forward pass: copy the layers of the stores that no ``store_layer`` call covered (``None``:
        of every store started so far, as at shutdown)."""
        if jobs is None:
            wholes = [w for w in self._whole.values() if w.direction is Direction.STORE]
        else:
            wholes = [w for job in jobs if (w := self._store(job)) is not None]
        for whole in wholes:
            for i in range(len(self._order)):
                if i not in whole.issued:
                    self._submit_layer(whole, i)

    def _store(self, job: TransferJob) -> _Whole | None:
        whole = self._whole.get(job.job_id)
        if whole is not None or job.job_id in self._refused:
            return whole  # in flight, or refused already
        return self._open(job, Direction.STORE)

    def _open(self, job: TransferJob, direction: Direction) -> _Whole | None:
        """Start tracking a plan job; None when its ids are refused (reported failed, the worker goes on)."""
        if job.job_id in self._whole:
            raise ConfigError(f"job_id={job.job_id} is already being copied layer by layer")
        try:
            return self._track(job, direction)
        except KVOffloadError as exc:
            self._refused.add(job.job_id)
            self._done.append(
                JobResult(
                    job_id=job.job_id,
                    success=False,
                    is_store=direction.is_store,
                    num_bytes=0,
                    seconds=0.0,
                    error=f"{type(exc).__name__}: {exc}",
                )
            )
            return None

    def _track(self, job: TransferJob, direction: Direction) -> _Whole:
        sizes = Int32Array.from_buffer(job.group_sizes).tolist()
        starts = Int32Array.from_buffer(job.block_indices).tolist()
        blocks, chunks = check_job_ids(  # counts and id ranges, naming the first bad one
            self._layout,
            group_sizes=sizes,
            block_indices=starts,
            block_ids=Int64Array.from_buffer(job.block_ids).to_tensor(),
            chunk_ids=Int64Array.from_buffer(job.chunk_ids).to_tensor(),
            blocks_per_chunk=self._bpc,
            num_chunks=self._pool.num_chunks,
        )
        tags = Int64Array.from_buffer(job.chunk_tags).to_tensor().numpy() if job.chunk_tags else None
        slots = build_block_slots(
            self._layout,
            self._pool.integrity,
            group_sizes=sizes,
            block_indices=starts,
            chunk_ids=chunks,
            chunk_tags=tags,
            blocks_per_chunk=self._bpc,
            host_row_bytes=self._pool.row_bytes,
            host_slot_offset=self._pool.slot_offset,
        )
        # Each group's share: chunk ids are consumed group after group.
        parts: list[_GroupPart] = []
        block_at = chunk_at = 0
        for n, start in zip(sizes, starts, strict=True):
            count = cdiv(n + start % self._bpc, self._bpc) if n else 0
            chunk_range = slice(chunk_at, chunk_at + count)
            parts.append(
                _GroupPart(
                    n,
                    start,
                    blocks[block_at : block_at + n],
                    chunks[chunk_range],
                    None if tags is None else tags[chunk_range],
                )
            )
            block_at += n
            chunk_at += count
        writes = self._pool.writes or direction is Direction.LOAD  # a shared pool's other ranks store nothing
        whole = _Whole(job, direction, time.perf_counter(), slots if writes else None, parts)
        self._whole[job.job_id] = whole
        return whole

    def _submit_layer(self, whole: _Whole, i: int) -> None:
        part = whole.parts[self._order[i][0]]
        layer_sizes = [0] * len(self._order)
        layer_starts = [0] * len(self._order)
        layer_sizes[i], layer_starts[i] = part.size, part.start
        sub = self._next_sub
        self._next_sub += 1
        whole.issued.add(i)
        try:
            self._engine.submit(
                CopyJob(sub, whole.direction, layer_sizes, layer_starts, part.blocks, part.chunks, part.tags)
            )
        except KVOffloadError as exc:  # bad ids in a plan: this job fails, the worker goes on
            whole.errors.append(f"{type(exc).__name__}: {exc}")
            return
        whole.pending.add(sub)
        self._parent[sub] = (whole.job.job_id, i)

    def _verify(self, slots: BlockSlots) -> list[int]:
        return self._pool.integrity.verify(slots, self._host, checksums=True)

    # ---------------------------------------------------------------------------------------- waiting

    def wait_layer(self, layer_name: str, timeout: float | None = None) -> None:
        """Block until every load's sub-job of layer ``layer_name`` is copied (a layer it does not know: at once)."""
        i = self._index.get(layer_name)
        if i is None:
            return
        subs = self._load_subs({i})
        if subs:
            self.layer_waits += 1
            self._engine.wait(subs, timeout)

    def _load_subs(self, layers: Container[int]) -> list[int]:
        """Sub-jobs in flight of loads, of the given layer indices."""
        whole = self._whole
        return [
            s
            for s, (job_id, layer) in self._parent.items()
            if layer in layers and whole[job_id].direction is Direction.LOAD
        ]

    def wait(self, job_ids: Iterable[int] | None = None, timeout: float | None = None) -> None:
        """Block until the named plan jobs (default: all in flight) have every sub-job done."""
        wanted = set(self._whole) if job_ids is None else set(job_ids) & set(self._whole)
        subs = [s for s, (job_id, _) in self._parent.items() if job_id in wanted]
        if subs:
            self._engine.wait(subs, timeout)
        for job_id in wanted:
            verify = self._whole[job_id].verify
            if verify is not None:
                verify.result(timeout)

    def poll(self) -> list[JobResult]:
        """Plan jobs whose every layer is done (and whose checksums were verified or sealed)."""
        for result in self._engine.poll():
            job_id, _ = self._parent.pop(result.job_id)
            whole = self._whole[job_id]
            whole.pending.discard(result.job_id)
            whole.num_bytes += result.num_bytes
            if not result.success:
                whole.errors.append(result.error)
                whole.corrupt.update(Int64Array.from_buffer(result.corrupt_chunk_ids).tolist())
        for job_id, whole in list(self._whole.items()):
            if whole.pending or len(whole.issued) < len(self._order):
                continue
            if whole.verify is not None and not whole.verify.done():
                continue
            del self._whole[job_id]
            self._done.append(self._finish(whole))
        out, self._done = self._done, []
        return out

    def _finish(self, whole: _Whole) -> JobResult:
        if whole.verify is not None:
            bad = whole.verify.result()
            if bad:
                whole.corrupt.update(bad)
                whole.errors.append(f"integrity: host chunks {sorted(set(bad))} failed their checksum")
        elif whole.direction.is_store and whole.slots is not None:
            if whole.errors:  # some layers landed: the chunk must not read as tagged
                self._pool.integrity.invalidate(whole.slots)
            else:
                self._pool.integrity.seal(whole.slots, self._host, checksums=self._checksums)
        ok = not whole.errors
        return JobResult(
            job_id=whole.job.job_id,
            success=ok,
            is_store=whole.direction.is_store,
            num_bytes=whole.num_bytes if ok else 0,
            seconds=time.perf_counter() - whole.started,
            error="; ".join(dict.fromkeys(whole.errors)),
            corrupt_chunk_ids=pack_int64(sorted(whole.corrupt)),
        )

    def close(self) -> None:
        """Stop the copies (in-flight ones finish first) and the checksum thread."""
        self._engine.close()
        self._verifier.shutdown(wait=True)
