"""Moves KV pages between the engine's KV memory and the host pool, asynchronously.

Three layers, each usable on its own:

* :func:`build_transfer_layout` turns the engine's placement description (``KVCacheTensor``-like: layer ``l``
  of a placement has its page for block ``b`` at ``offset + l*layer_stride + b*block_stride`` of ONE flat
  backing allocation) plus the offloaded groups' layers into a :class:`TransferLayout`: where each page is in
  engine memory and where it goes inside the host per-block slot (``worker_kv_bytes_per_block`` bytes).
* :func:`build_copy_runs` turns one job (groups, logical block indices, engine block ids, host chunk ids)
  into coalesced byte runs, with vLLM 0.33's sub-block rule (reference §4.6): chunk row sub-block ``j``
  holds engine block ``j`` of the chunk and a partly covered first chunk is entered at ``block_index % bpc``.
* :class:`CopyEngine` executes jobs in submission order per direction and reports
  :class:`TransferResult` s: on CPU with one thread per direction, on CUDA with one stream per direction.
* :func:`build_block_slots` names the sub-blocks a job touches (same index math as the runs) so that stores
  seal and loads verify them in the pool's integrity table (:mod:`kvoffload.offload.integrity`).
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import xxhash

from kvoffload.errors import ConfigError, InvalidStateError, TransferError
from kvoffload.offload.host_pool import HostPool
from kvoffload.offload.integrity import BlockSlots, IntegrityTable

if TYPE_CHECKING:
    from kvoffload._generated import KVCacheConfig, OffloadingConfig

__all__ = [
    "CopyEngine",
    "CopyRuns",
    "CopySegment",
    "GroupLayout",
    "IdsLike",
    "LayerPlacement",
    "Placement",
    "PlacementLike",
    "TransferLayout",
    "TransferResult",
    "build_block_slots",
    "build_copy_runs",
    "build_transfer_layout",
    "transfer_layout_from_config",
]

IdsLike = Sequence[int] | torch.Tensor
"""Block or chunk ids: a sequence of ints or a 1-D integer tensor."""

_PIECE_BYTES = 4 << 20
"""On CPU, longer runs are cut into pieces of this size so that the copy threads share the work evenly."""

_xxh3_64 = xxhash.xxh3_64_intdigest

_PARALLEL_MIN_BYTES = 2 << 20
"""On CPU, jobs smaller than this run on the direction's thread alone (waking helpers costs more)."""


# ---------------------------------------------------------------------------------------------------------
# Layout: where pages live in engine memory and in the host slot
# ---------------------------------------------------------------------------------------------------------


class PlacementLike(Protocol):
    """What a ``KVCacheTensor`` tells about placement (the generated type satisfies this protocol)."""

    @property
    def size(self) -> int: ...

    @property
    def layers(self) -> Sequence[str]: ...

    @property
    def layer_stride(self) -> int: ...

    @property
    def block_stride(self) -> int: ...

    @property
    def offset(self) -> int: ...


@dataclass(frozen=True)
class Placement:
    """A plain ``KVCacheTensor``: layer ``l`` of ``layers`` has block ``b``'s page at
    ``offset + l*layer_stride + b*block_stride`` of one backing allocation of ``size`` bytes."""

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0


@dataclass(frozen=True)
class LayerPlacement:
    """One offloaded layer: engine bytes of block ``b`` start at ``engine_offset + b*block_stride``;
    its page sits at ``host_offset`` inside the host per-block slot."""

    name: str
    page_bytes: int
    engine_offset: int
    block_stride: int
    host_offset: int


@dataclass(frozen=True)
class CopySegment:
    """Consecutive layers whose pages are adjacent both in engine memory and in the host slot: one copy."""

    engine_offset: int
    block_stride: int
    length: int
    host_offset: int


@dataclass(frozen=True)
class GroupLayout:
    """Placement of one offloaded group: its layers (given order) and the segments copied per block."""

    layers: tuple[LayerPlacement, ...]
    segments: tuple[CopySegment, ...]
    bytes_per_block: int


@dataclass(frozen=True)
class TransferLayout:
    """Per-group page placement for a worker whose KV memory is one flat allocation of ``engine_bytes``."""

    groups: tuple[GroupLayout, ...]
    num_blocks: int
    worker_kv_bytes_per_block: int
    engine_bytes: int


def build_transfer_layout(
    placements: Sequence[PlacementLike],
    groups: Sequence[Sequence[tuple[str, int]]],
    *,
    num_blocks: int,
    worker_kv_bytes_per_block: int,
) -> TransferLayout:
    """Place every offloaded layer's page in engine memory and in the host per-block slot.

    ``groups[g]`` lists ``(layer_name, page_bytes)`` of offloaded group ``g`` (``page_bytes`` unpadded).
    Host placement packs a group's pages in engine-address order, so pages adjacent in engine memory stay
    adjacent in the slot and copy as one run (a block-major block is one copy). Raises :class:`ConfigError`
    naming the layer and the numbers when a layer is unknown, pages overlap, a page leaves the allocation
    or the group does not fit in ``worker_kv_bytes_per_block``.
    """
    if num_blocks < 0:
        raise ConfigError(f"num_blocks={num_blocks} must be >= 0")
    if worker_kv_bytes_per_block < 0:
        raise ConfigError(f"worker_kv_bytes_per_block={worker_kv_bytes_per_block} must be >= 0")
    where: dict[str, tuple[int, int, int, int]] = {}  # name -> (engine offset, block stride, size, tensor)
    for t, p in enumerate(placements):
        for field in ("size", "layer_stride", "block_stride", "offset"):
            if getattr(p, field) < 0:
                raise ConfigError(f"kv_cache_tensors[{t}].{field}={getattr(p, field)} must be >= 0")
        for index, name in enumerate(p.layers):
            if name in where:
                first = where[name][3]
                raise ConfigError(f"layer {name!r} is placed by kv_cache_tensors[{first}] and [{t}]")
            where[name] = (p.offset + index * p.layer_stride, p.block_stride, p.size, t)
    engine_bytes = max((p.size for p in placements), default=0)
    return TransferLayout(
        groups=tuple(
            _place_group(g, layers, where, num_blocks, worker_kv_bytes_per_block) for g, layers in enumerate(groups)
        ),
        num_blocks=num_blocks,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        engine_bytes=engine_bytes,
    )


def transfer_layout_from_config(kv_cache_config: KVCacheConfig, config: OffloadingConfig) -> TransferLayout:
    """:func:`build_transfer_layout` for a worker's ``KVCacheConfig`` and its offloading plan.

    Placements are the engine-resident ``kv_cache_tensors``; each offloaded layer copies its unpadded page
    (``layout.real_page_size_bytes`` of its own spec, a ``uniform_type`` wrapper's entry for that layer).
    """
    from kvoffload._generated import UniformTypeKVCacheSpecs
    from kvoffload.layout import real_page_size_bytes

    groups: list[list[tuple[str, int]]] = []
    for group in config.groups:
        if not 0 <= group.group_id < len(kv_cache_config.kv_cache_groups):
            raise ConfigError(
                f"offloading group_id={group.group_id} is not one of the "
                f"{len(kv_cache_config.kv_cache_groups)} kv_cache_groups"
            )
        spec = kv_cache_config.kv_cache_groups[group.group_id].kv_cache_spec
        layers: list[tuple[str, int]] = []
        for name in group.layer_names:
            layer_spec = spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                if name not in spec.kv_cache_specs:
                    raise ConfigError(f"group {group.group_id} layer {name!r} has no entry in kv_cache_specs")
                layer_spec = spec.kv_cache_specs[name]
            layers.append((name, real_page_size_bytes(layer_spec)))
        groups.append(layers)
    return build_transfer_layout(
        [t for t in kv_cache_config.kv_cache_tensors if not t.host_resident],
        groups,
        num_blocks=kv_cache_config.num_blocks,
        worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
    )


def _place_group(
    g: int,
    layers: Sequence[tuple[str, int]],
    where: dict[str, tuple[int, int, int, int]],
    num_blocks: int,
    wkb: int,
) -> GroupLayout:
    seen: set[str] = set()
    items: list[tuple[int, int, int, str, int]] = []  # (block stride, engine offset, index, name, page)
    for i, (name, page) in enumerate(layers):
        if name in seen:
            raise ConfigError(f"group {g} lists layer {name!r} twice")
        seen.add(name)
        if name not in where:
            raise ConfigError(f"group {g} layer {name!r} is in no kv_cache_tensors placement")
        if page <= 0:
            raise ConfigError(f"group {g} layer {name!r}: page_bytes={page} must be > 0")
        engine_offset, stride, size, t = where[name]
        if num_blocks > 1 and stride < page:
            raise ConfigError(
                f"layer {name!r}: block_stride={stride} of kv_cache_tensors[{t}] is smaller than its "
                f"page_bytes={page}, so the pages of consecutive blocks overlap"
            )
        end = engine_offset + max(num_blocks - 1, 0) * stride + page
        if num_blocks > 0 and end > size:
            raise ConfigError(
                f"layer {name!r}: the page of block {num_blocks - 1} ends at byte {end}, beyond "
                f"kv_cache_tensors[{t}].size={size}"
            )
        items.append((stride, engine_offset, i, name, page))
    total = sum(item[4] for item in items)
    if total > wkb:
        raise ConfigError(
            f"group {g}: its pages take {total} bytes per block, more than the host slot of "
            f"worker_kv_bytes_per_block={wkb}"
        )
    placed: dict[int, LayerPlacement] = {}
    segments: list[CopySegment] = []
    host = 0
    for stride, engine_offset, i, name, page in sorted(items):
        last = segments[-1] if segments else None
        if last is not None and last.block_stride == stride:
            last_end = last.engine_offset + last.length
            if last_end > engine_offset:
                raise ConfigError(f"group {g} layer {name!r}: its page overlaps the previous layer's page")
            if last_end == engine_offset:
                segments[-1] = CopySegment(last.engine_offset, stride, last.length + page, last.host_offset)
            else:
                segments.append(CopySegment(engine_offset, stride, page, host))
        else:
            segments.append(CopySegment(engine_offset, stride, page, host))
        placed[i] = LayerPlacement(name, page, engine_offset, stride, host)
        host += page
    return GroupLayout(
        layers=tuple(placed[i] for i in range(len(items))),
        segments=tuple(segments),
        bytes_per_block=total,
    )


# ---------------------------------------------------------------------------------------------------------
# Copy runs of one job (shared by the CPU and the CUDA paths)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyRuns:
    """Coalesced byte runs of one job: ``lengths[i]`` bytes between engine byte ``engine_offsets[i]`` and
    host byte ``host_offsets[i]`` (offsets into the flat engine allocation and the flat host rows)."""

    engine_offsets: torch.Tensor
    host_offsets: torch.Tensor
    lengths: torch.Tensor
    num_bytes: int

    @staticmethod
    def empty() -> CopyRuns:
        """No bytes to move."""
        none = torch.zeros(0, dtype=torch.int64)
        return CopyRuns(none, none, none, 0)

    def __len__(self) -> int:
        return int(self.lengths.numel())


def _as_ids(ids: IdsLike, field: str) -> torch.Tensor:
    try:
        out = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{field} must be a sequence of ints or an integer tensor: {exc}") from exc
    if out.dim() != 1:
        raise ConfigError(f"{field} must be one-dimensional, got shape {tuple(out.shape)}")
    if out.numel() and out.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ConfigError(f"{field} must hold integers, got dtype {out.dtype}")
    return out.to(device="cpu", dtype=torch.int64)


def _check_range(ids: torch.Tensor, field: str, limit: int, limit_name: str) -> None:
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise ConfigError(f"{field} contains {bad}, outside [0, {limit_name}={limit})")


def build_copy_runs(
    layout: TransferLayout,
    *,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    block_ids: IdsLike,
    chunk_ids: IdsLike,
    blocks_per_chunk: int,
    num_chunks: int,
    host_row_bytes: int,
    host_slot_offset: int = 0,
) -> CopyRuns:
    """Byte runs moving one job's pages (reference §4.6; the same runs serve stores and loads).

    Group ``g`` moves ``group_sizes[g]`` engine blocks, taken in order from ``block_ids``; its first block
    has logical index ``block_indices[g]``, so it starts at sub-block ``skip = block_indices[g] %
    blocks_per_chunk`` of its first chunk and uses the next ``cdiv(n + skip, blocks_per_chunk)`` ids of
    ``chunk_ids``. Engine block ``i`` of the group lands in host chunk ``chunk[(skip+i) // bpc]`` at
    sub-block ``(skip+i) % bpc``, i.e. host byte ``chunk*host_row_bytes + host_slot_offset +
    sub*worker_kv_bytes_per_block + page host offset``. Raises :class:`ConfigError` when the counts are not
    consumed exactly or an id is out of range.
    """
    bpc = blocks_per_chunk
    if bpc < 1:
        raise ConfigError(f"blocks_per_chunk={bpc} must be >= 1")
    num_groups = len(layout.groups)
    if len(group_sizes) != num_groups or len(block_indices) != num_groups:
        raise ConfigError(
            f"group_sizes has {len(group_sizes)} and block_indices has {len(block_indices)} entries; "
            f"the layout has {num_groups} groups"
        )
    needed_chunks = 0
    for g, (n, b) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if n < 0 or b < 0:
            raise ConfigError(f"group {g}: group_sizes={n} and block_indices={b} must be >= 0")
        if n:
            needed_chunks += -(-(n + b % bpc) // bpc)
    blocks = _as_ids(block_ids, "block_ids")
    chunks = _as_ids(chunk_ids, "chunk_ids")
    needed_blocks = sum(group_sizes)
    if blocks.numel() != needed_blocks or chunks.numel() != needed_chunks:
        raise ConfigError(
            f"group_sizes={list(group_sizes)} with block_indices={list(block_indices)} and "
            f"blocks_per_chunk={bpc} consume {needed_blocks} block_ids and {needed_chunks} chunk_ids, "
            f"but the job has {blocks.numel()} block_ids and {chunks.numel()} chunk_ids"
        )
    _check_range(blocks, "block_ids", layout.num_blocks, "num_blocks")
    _check_range(chunks, "chunk_ids", num_chunks, "num_chunks")

    wkb = layout.worker_kv_bytes_per_block
    engine_parts: list[torch.Tensor] = []
    host_parts: list[torch.Tensor] = []
    length_parts: list[torch.Tensor] = []
    num_bytes = 0
    block_pos = chunk_pos = 0
    for g, (n, b) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if n == 0:
            continue
        group = layout.groups[g]
        skip = b % bpc
        count = -(-(n + skip) // bpc)
        engine_blocks = blocks[block_pos : block_pos + n]
        group_chunks = chunks[chunk_pos : chunk_pos + count]
        block_pos += n
        chunk_pos += count
        num_bytes += n * group.bytes_per_block
        if not group.segments:
            continue
        chunk_of_block, sub_block = _block_positions(group_chunks, skip, n, bpc)
        host_block = chunk_of_block * host_row_bytes + sub_block * wkb + host_slot_offset
        seg = torch.tensor(
            [(s.engine_offset, s.block_stride, s.length, s.host_offset) for s in group.segments],
            dtype=torch.int64,
        )
        # Segment-major order: consecutive blocks of one segment sit next to each other, so runs of
        # consecutive engine blocks landing in consecutive sub-blocks coalesce.
        engine_parts.append((seg[:, 0:1] + seg[:, 1:2] * engine_blocks).reshape(-1))
        host_parts.append((seg[:, 3:4] + host_block).reshape(-1))
        length_parts.append(seg[:, 2:3].expand(-1, n).reshape(-1))
    if not engine_parts:
        return CopyRuns.empty()
    (engine, host), length = _merge((torch.cat(engine_parts), torch.cat(host_parts)), torch.cat(length_parts))
    return CopyRuns(engine, host, length, num_bytes)


def _block_positions(group_chunks: torch.Tensor, skip: int, n: int, bpc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host chunk id and sub-block of each of a group's ``n`` blocks entered at sub-block ``skip`` (§4.6)."""
    sub = torch.arange(skip, skip + n, dtype=torch.int64)
    return group_chunks[sub // bpc], sub % bpc


def build_block_slots(
    layout: TransferLayout,
    table: IntegrityTable,
    *,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    chunk_ids: IdsLike,
    chunk_tags: IdsLike | None,
    blocks_per_chunk: int,
    host_row_bytes: int,
    host_slot_offset: int = 0,
) -> BlockSlots:
    """The sub-blocks a job writes or reads, for integrity: same index math as :func:`build_copy_runs`.

    Each engine block of group ``g`` covers bytes ``[0, bytes_per_block)`` of its sub-block slot (a group's
    pages are packed from the slot start). ``chunk_tags[i]`` is the key tag of ``chunk_ids[i]``; ``None``
    or empty means untagged (tag 0). Call after :func:`build_copy_runs` validated the job.
    """
    bpc = blocks_per_chunk
    chunks = _as_ids(chunk_ids, "chunk_ids")
    tags = torch.zeros_like(chunks) if chunk_tags is None else _as_ids(chunk_tags, "chunk_tags")
    if tags.numel() == 0:
        tags = torch.zeros_like(chunks)
    if tags.numel() != chunks.numel():
        raise ConfigError(f"chunk_tags has {tags.numel()} entries but the job has {chunks.numel()} chunk_ids")
    wkb = layout.worker_kv_bytes_per_block
    chunk_parts: list[torch.Tensor] = []
    sub_parts: list[torch.Tensor] = []
    tag_parts: list[torch.Tensor] = []
    length_parts: list[torch.Tensor] = []
    chunk_pos = 0
    for g, (n, b) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if n == 0:
            continue
        skip = b % bpc
        count = -(-(n + skip) // bpc)
        positions = torch.arange(chunk_pos, chunk_pos + count, dtype=torch.int64)
        chunk_pos += count
        chunk_of_block, sub_block = _block_positions(chunks[positions], skip, n, bpc)
        tag_of_block, _ = _block_positions(tags[positions], skip, n, bpc)
        chunk_parts.append(chunk_of_block)
        sub_parts.append(sub_block)
        tag_parts.append(tag_of_block)
        length_parts.append(torch.full((n,), layout.groups[g].bytes_per_block, dtype=torch.int64))
    if not chunk_parts:
        none = np.zeros(0, dtype=np.int64)
        return BlockSlots(none, none, [], [], none)
    chunk_of = torch.cat(chunk_parts)
    sub_of = torch.cat(sub_parts)
    host = chunk_of * host_row_bytes + sub_of * wkb + host_slot_offset
    chunk_np = chunk_of.numpy()
    return BlockSlots(
        entries=table.entry_index(chunk_np, sub_of.numpy()),
        chunk_ids=chunk_np,
        host_offsets=host.tolist(),
        lengths=torch.cat(length_parts).tolist(),
        tags=torch.cat(tag_parts).numpy(),
    )


def _merge(offsets: tuple[torch.Tensor, ...], length: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Merge neighbouring runs whose every offset continues where the previous run ended."""
    m = length.numel()
    if m <= 1:
        return offsets, length
    joins = torch.ones(m - 1, dtype=torch.bool)
    for off in offsets:
        joins &= off[1:] == off[:-1] + length[:-1]
    if not bool(joins.any()):
        return offsets, length
    starts = torch.ones(m, dtype=torch.bool)
    starts[1:] = ~joins
    first = starts.nonzero().squeeze(1)
    last = torch.cat([first[1:] - 1, torch.tensor([m - 1])])
    total = length.cumsum(0)
    merged = total[last] - total[first] + length[first]
    return tuple(off[first] for off in offsets), merged


# ---------------------------------------------------------------------------------------------------------
# Execution primitives
# ---------------------------------------------------------------------------------------------------------


def _memmove_runs(dsts: list[int], srcs: list[int], lengths: list[int]) -> None:
    """Copy each run with the C library's memmove.

    ``ctypes`` releases the GIL for the copy and, unlike a loop of torch ``copy_`` calls, wakes no OpenMP
    team per call (which collapses to ~1-4 GB/s for 64 KB-1 MB pages when run off the main thread).
    """
    move = ctypes.memmove
    for dst, src, n in zip(dsts, srcs, lengths, strict=True):
        move(dst, src, n)


def _cpu_work(
    runs: CopyRuns, is_store: bool, kv_ptr: int, host_ptr: int, parts: int
) -> list[tuple[list[int], list[int], list[int]]]:
    """Absolute (dst, src, length) lists for ``parts`` threads, split so each moves about the same bytes."""
    engine, host, length = runs.engine_offsets, runs.host_offsets, runs.lengths
    if length.numel() == 0:
        return []
    if parts > 1:
        pieces = (length + (_PIECE_BYTES - 1)) // _PIECE_BYTES
        if int(pieces.max()) > 1:
            owner = torch.repeat_interleave(torch.arange(length.numel()), pieces)
            piece_no = torch.arange(owner.numel()) - (pieces.cumsum(0) - pieces)[owner]
            skip = piece_no * _PIECE_BYTES
            engine, host = engine[owner] + skip, host[owner] + skip
            length = torch.clamp(length[owner] - skip, max=_PIECE_BYTES)
    engine, host = engine + kv_ptr, host + host_ptr
    dst, src = (host, engine) if is_store else (engine, host)
    if parts <= 1:
        return [(dst.tolist(), src.tolist(), length.tolist())]
    ends = length.cumsum(0)
    owner = (2 * ends - length) * parts // (2 * int(ends[-1]))  # the part holding each run's middle byte
    bounds = torch.searchsorted(owner, torch.arange(parts + 1)).tolist()
    return [
        (dst[a:b].tolist(), src[a:b].tolist(), length[a:b].tolist()) for a, b in itertools.pairwise(bounds) if b > a
    ]


_ELEMENT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _element_index(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Index of every element of the runs, run after run (``starts[i] .. starts[i] + lengths[i] - 1``)."""
    before = lengths.cumsum(0) - lengths
    base = torch.repeat_interleave(starts - before, lengths, output_size=total)
    return base + torch.arange(total, dtype=torch.int64, device=starts.device)


def _indexed_transfer(
    kv_flat: torch.Tensor, host_flat: torch.Tensor, runs: CopyRuns, is_store: bool
) -> list[torch.Tensor]:
    """Move ``runs`` with one gather (store) or scatter (load) on ``kv_flat``'s device through a staging
    buffer, plus one host copy per host-contiguous stretch; issued on the current stream.

    Works on any device (the CPU tests run it); on CUDA the copies are asynchronous and the returned tensors
    must stay alive until the stream has passed them.
    """
    if len(runs) == 0:
        return []
    order = torch.argsort(runs.host_offsets)
    host, engine, length = runs.host_offsets[order], runs.engine_offsets[order], runs.lengths[order]
    total = int(length.sum())
    size = 8
    while size > 1 and (kv_flat.data_ptr() % size or bool(((engine | length) % size).any())):
        size //= 2
    dtype = _ELEMENT_DTYPES[size]
    kv_elems = kv_flat[: kv_flat.numel() // size * size].view(dtype)
    device = kv_flat.device
    starts = (engine // size).to(device, non_blocking=True)
    counts = (length // size).to(device, non_blocking=True)
    index = _element_index(starts, counts, total // size)
    staging = torch.empty(total, dtype=torch.uint8, device=device)
    (stretch_host,), stretch_len = _merge((host,), length)
    stretch_stage = stretch_len.cumsum(0) - stretch_len
    stretches = zip(stretch_host.tolist(), stretch_stage.tolist(), stretch_len.tolist(), strict=True)
    if is_store:
        torch.index_select(kv_elems, 0, index, out=staging.view(dtype))
        for h, s, n in stretches:
            host_flat[h : h + n].copy_(staging[s : s + n], non_blocking=True)
    else:
        for h, s, n in stretches:
            staging[s : s + n].copy_(host_flat[h : h + n], non_blocking=True)
        kv_elems.index_copy_(0, index, staging.view(dtype))
    return [staging, index, starts, counts]


# ---------------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one job: bytes moved (0 on failure) and the seconds its copies took."""

    job_id: int
    success: bool
    is_store: bool
    num_bytes: int
    seconds: float
    error: str | None = None
    corrupt_chunk_ids: tuple[int, ...] = ()
    """Chunks whose key tag or checksum did not verify (a failed load); empty otherwise."""


def _failed(job_id: int, is_store: bool, seconds: float, exc: BaseException) -> TransferResult:
    return TransferResult(job_id, False, is_store, 0, seconds, f"{type(exc).__name__}: {exc}")


def _corrupt(job_id: int, seconds: float, chunk_ids: Sequence[int]) -> TransferResult:
    message = f"integrity: host chunks {list(chunk_ids)} failed verification (key tag or content checksum)"
    return TransferResult(job_id, False, False, 0, seconds, message, tuple(chunk_ids))


@dataclass(frozen=True)
class _Integrity:
    """What a backend needs to seal stores and verify loads: the pool's table and the host bytes."""

    table: IntegrityTable
    host: memoryview
    checksums: bool

    def seal(self, slots: BlockSlots | None, sums: list[int] | None = None) -> None:
        if slots is not None and len(slots):
            self.table.seal(slots, self.host, checksums=self.checksums, sums=sums)

    def verify(self, slots: BlockSlots | None, sums: list[int] | None = None) -> list[int]:
        if slots is None or not len(slots):
            return []
        return self.table.verify(slots, self.host, checksums=self.checksums, sums=sums)


@dataclass(frozen=True)
class _HashedPart:
    """A share of a checksummed job: slots in host order and the runs that lie in them (absolute pointers)."""

    slots: list[int]  # indices into the job's BlockSlots
    run_starts: list[int]  # host offsets, relative to the rows
    run_ends: list[int]
    dsts: list[int]
    srcs: list[int]
    lengths: list[int]


def _hashed_parts(
    runs: CopyRuns, is_store: bool, kv_ptr: int, host_ptr: int, slots: BlockSlots, parts: int
) -> list[_HashedPart]:
    """Split a checksummed job into up to ``parts`` shares of about equal bytes, cut only between slots that
    no run spans (so a share never hashes bytes another share is still writing)."""
    order = torch.argsort(runs.host_offsets)
    host_start = runs.host_offsets[order]
    lengths = runs.lengths[order]
    starts = host_start.tolist()
    ends = (host_start + lengths).tolist()
    abs_host = (host_start + host_ptr).tolist()
    abs_engine = (runs.engine_offsets[order] + kv_ptr).tolist()
    dsts, srcs = (abs_host, abs_engine) if is_store else (abs_engine, abs_host)
    length_list = lengths.tolist()
    visit = sorted(range(len(slots)), key=slots.host_offsets.__getitem__)
    total = sum(slots.lengths) or 1
    out: list[_HashedPart] = []
    r = 0
    share: list[int] = []
    done = 0
    for position, i in enumerate(visit):
        share.append(i)
        done += slots.lengths[i]
        last = position + 1 == len(visit)
        if not last and done * parts < total * (len(out) + 1):
            continue
        # the share ends here: take every run starting before the next slot, unless one spans into it
        limit = slots.host_offsets[visit[position + 1]] if not last else None
        j = r
        while j < len(starts) and (limit is None or starts[j] < limit):
            j += 1
        if limit is not None and j > r and ends[j - 1] > limit:
            continue  # a run crosses into the next slot: keep growing this share
        out.append(_HashedPart(share, starts[r:j], ends[r:j], dsts[r:j], srcs[r:j], length_list[r:j]))
        share, r = [], j
    if r < len(starts):  # runs beyond every slot (none for a job built by build_copy_runs)
        out.append(_HashedPart([], starts[r:], ends[r:], dsts[r:], srcs[r:], length_list[r:]))
    return out


def _copy_and_hash(part: _HashedPart, is_store: bool, slots: BlockSlots, host: memoryview, digests: list[int]) -> None:
    """Copy a share's runs and hash each of its slots while the bytes are in cache (digests by slot index).

    A store hashes a slot right after copying the runs that start before its end; a load hashes a slot first
    and then copies the runs that end within it, so every byte it hands to the engine was just hashed.
    """
    starts, ends, dsts, srcs, lengths = part.run_starts, part.run_ends, part.dsts, part.srcs, part.lengths
    offsets, sizes = slots.host_offsets, slots.lengths
    digest = _xxh3_64
    r, count = 0, len(lengths)
    for i in part.slots:
        first = offsets[i]
        last = first + sizes[i]
        if is_store:
            j = r
            while j < count and starts[j] < last:
                j += 1
            _memmove_runs(dsts[r:j], srcs[r:j], lengths[r:j])
            digests[i] = digest(host[first:last])
        else:
            digests[i] = digest(host[first:last])
            j = r
            while j < count and ends[j] <= last:
                j += 1
            _memmove_runs(dsts[r:j], srcs[r:j], lengths[r:j])
        r = j
    _memmove_runs(dsts[r:], srcs[r:], lengths[r:])


class _CpuBackend:
    """One thread per direction runs jobs in order; big jobs are shared with ``threads - 1`` helpers.

    Integrity runs on the direction's thread right after a job's copy, while its bytes are still in cache:
    a store seals its sub-blocks, a load verifies them and fails if any does not match.
    """

    def __init__(self, kv_flat: torch.Tensor, host_flat: torch.Tensor, threads: int, integrity: _Integrity) -> None:
        self._kv = kv_flat
        self._integrity = integrity
        self._host = host_flat  # the references keep the memory behind the raw pointers alive
        self._parts = threads
        self._helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvoffload-copy") if threads > 1 else None
        self._cond = threading.Condition()
        self._done: dict[bool, deque[TransferResult]] = {True: deque(), False: deque()}
        self._pending: set[int] = set()
        self._queues: dict[bool, queue.SimpleQueue[tuple[int, CopyRuns, BlockSlots | None] | None]] = {
            True: queue.SimpleQueue(),
            False: queue.SimpleQueue(),
        }
        self._threads = [
            threading.Thread(target=self._loop, args=(d,), name=f"kvoffload-{n}", daemon=True)
            for d, n in ((True, "store"), (False, "load"))
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job_id: int, is_store: bool, runs: CopyRuns, slots: BlockSlots | None) -> None:
        with self._cond:
            self._pending.add(job_id)
        self._queues[is_store].put((job_id, runs, slots))

    def _loop(self, is_store: bool) -> None:
        jobs = self._queues[is_store]
        integrity = self._integrity
        while (item := jobs.get()) is not None:
            job_id, runs, slots = item
            start = time.perf_counter()
            try:
                sums: list[int] | None = None
                if integrity.checksums and slots is not None and len(slots) and len(runs):
                    sums = self._execute_hashed(runs, is_store, slots)
                else:
                    self._execute(runs, is_store)
                if is_store:
                    integrity.seal(slots, sums)
                    bad = []
                else:
                    bad = integrity.verify(slots, sums)
                seconds = time.perf_counter() - start
                if bad:
                    result = _corrupt(job_id, seconds, bad)
                else:
                    result = TransferResult(job_id, True, is_store, runs.num_bytes, seconds)
            except Exception as exc:
                result = _failed(job_id, is_store, time.perf_counter() - start, exc)
            with self._cond:
                self._done[is_store].append(result)
                self._pending.discard(job_id)
                self._cond.notify_all()

    def _execute(self, runs: CopyRuns, is_store: bool) -> None:
        if len(runs) == 0:
            return
        parallel = self._helpers is not None and runs.num_bytes >= _PARALLEL_MIN_BYTES
        work = _cpu_work(runs, is_store, self._kv.data_ptr(), self._host.data_ptr(), self._parts if parallel else 1)
        futures = [self._helpers.submit(_memmove_runs, *w) for w in work[1:]] if self._helpers else []
        try:
            _memmove_runs(*work[0])
        finally:
            errors = [f.exception() for f in futures]  # wait for every helper before reporting
        for error in errors:
            if error is not None:
                raise error

    def _execute_hashed(self, runs: CopyRuns, is_store: bool, slots: BlockSlots) -> list[int]:
        """Copy and hash in shares (helpers copy while another share hashes); the slots' digests."""
        parallel = self._helpers is not None and runs.num_bytes >= _PARALLEL_MIN_BYTES
        work = _hashed_parts(
            runs, is_store, self._kv.data_ptr(), self._host.data_ptr(), slots, self._parts if parallel else 1
        )
        digests = [0] * len(slots)
        host = self._integrity.host
        futures = (
            [self._helpers.submit(_copy_and_hash, w, is_store, slots, host, digests) for w in work[1:]]
            if self._helpers
            else []
        )
        try:
            if work:
                _copy_and_hash(work[0], is_store, slots, host, digests)
        finally:
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return digests

    def poll(self) -> list[TransferResult]:
        with self._cond:
            out = [*self._done[True], *self._done[False]]
            self._done[True].clear()
            self._done[False].clear()
        return out

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not (job_ids & self._pending), timeout)

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
        if self._helpers is not None:
            self._helpers.shutdown()


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _done(event: torch.cuda.Event) -> bool:
    return bool(event.query())  # type: ignore[no-untyped-call]


@dataclass
class _CudaJob:
    job_id: int
    num_bytes: int
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    keep: list[torch.Tensor]
    error: BaseException | None = None
    slots: BlockSlots | None = None
    corrupt: tuple[int, ...] = ()


class _CudaBackend:
    """One CUDA stream per direction; jobs run in order on it and complete when their end event fires.

    Integrity stays off the copy streams: a load's host sub-blocks are verified on the host before its
    copies are enqueued (a mismatch fails the job without copying), and a store is sealed on the host in
    :meth:`poll` once its end event has completed. The compute stream is never synchronized.
    """

    def __init__(self, kv_flat: torch.Tensor, host_flat: torch.Tensor, integrity: _Integrity) -> None:
        self._kv = kv_flat
        self._integrity = integrity
        self._host = host_flat
        self._device = kv_flat.device
        self._streams = {d: _new_stream(self._device) for d in (True, False)}
        self._jobs: dict[bool, deque[_CudaJob]] = {True: deque(), False: deque()}
        self._last_end: dict[bool, torch.cuda.Event | None] = {True: None, False: None}

    def submit(self, job_id: int, is_store: bool, runs: CopyRuns, slots: BlockSlots | None) -> None:
        stream = self._streams[is_store]
        start, end = _timing_event(), _timing_event()
        if not is_store:
            try:
                bad = self._integrity.verify(slots)
            except Exception as exc:
                self._jobs[is_store].append(_CudaJob(job_id, 0, None, None, [], exc))
                return
            if bad:
                self._jobs[is_store].append(_CudaJob(job_id, 0, None, None, [], None, corrupt=tuple(bad)))
                return
        try:
            # Start after the compute stream's pending work (which produced or still reads these blocks)
            # and after this direction's previous job (strict FIFO per direction).
            stream.wait_stream(torch.cuda.current_stream(self._device))
            previous = self._last_end[is_store]
            if previous is not None:
                stream.wait_event(previous)
            with torch.cuda.stream(stream):
                start.record(stream)
                keep = _indexed_transfer(self._kv, self._host, runs, is_store)
                end.record(stream)
        except Exception as exc:
            self._jobs[is_store].append(_CudaJob(job_id, 0, None, None, [], exc))
            return
        self._last_end[is_store] = end
        self._jobs[is_store].append(_CudaJob(job_id, runs.num_bytes, start, end, keep, slots=slots))

    def poll(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        for is_store in (True, False):
            jobs = self._jobs[is_store]
            while jobs:
                job = jobs[0]
                try:
                    if job.corrupt:
                        result = _corrupt(job.job_id, 0.0, job.corrupt)
                    elif job.error is None and job.end is not None and job.start is not None:
                        if not _done(job.end):
                            break
                        seconds = job.start.elapsed_time(job.end) * 1e-3
                        if is_store:
                            self._integrity.seal(job.slots)  # host bytes are final once the end event fired
                        result = TransferResult(job.job_id, True, is_store, job.num_bytes, seconds)
                    else:
                        result = _failed(job.job_id, is_store, 0.0, job.error or TransferError("no events"))
                except Exception as exc:  # an asynchronous CUDA error surfaces here
                    result = _failed(job.job_id, is_store, 0.0, exc)
                jobs.popleft()
                out.append(result)
        return out

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for jobs in self._jobs.values():
            for job in list(jobs):
                if job.job_id not in job_ids or job.end is None:
                    continue
                if deadline is None:
                    job.end.synchronize()
                    continue
                while not _done(job.end):
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.0002)
        return True

    def close(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()


class CopyEngine:
    """Asynchronous page mover between one worker's KV memory and its host pool.

    ``kv_memory`` is the engine's flat backing allocation (any contiguous tensor; viewed as bytes) that
    ``layout`` describes. ``submit_store``/``submit_load`` validate, plan the runs and return at once;
    :meth:`poll` returns finished jobs, in submission order per direction. CPU memory: one thread per
    direction (``cpu_threads`` threads share a big job). CUDA memory: one stream per direction, timed with
    CUDA events. Copy failures become ``TransferResult(success=False)``. Call from one thread.

    Integrity (on by default): every store records, per sub-block of this rank's slot, the key tag from
    ``chunk_tags`` and an xxh3_64 checksum of the stored bytes in the pool's table; every load verifies both
    and fails with ``corrupt_chunk_ids`` on a mismatch or a missing entry. ``checksums=False`` skips the
    content checksums (key tags are still written and verified); every rank of a pool must agree on it.
    """

    def __init__(
        self,
        kv_memory: torch.Tensor,
        layout: TransferLayout,
        host_pool: HostPool,
        *,
        cpu_threads: int | None = None,
        checksums: bool = True,
    ) -> None:
        if not isinstance(checksums, bool):
            raise ConfigError(f"checksums={checksums!r} must be a bool")
        if not kv_memory.is_contiguous():
            raise ConfigError(f"kv_memory must be contiguous (shape {tuple(kv_memory.shape)})")
        kv_flat = kv_memory.reshape(-1).view(torch.uint8)
        if kv_flat.numel() < layout.engine_bytes:
            raise ConfigError(
                f"kv_memory has {kv_flat.numel()} bytes but the placements describe an allocation of "
                f"size={layout.engine_bytes}"
            )
        plan = host_pool.plan
        if plan.worker_kv_bytes_per_block != layout.worker_kv_bytes_per_block:
            raise ConfigError(
                f"host pool worker_kv_bytes_per_block={plan.worker_kv_bytes_per_block} differs from the "
                f"layout's worker_kv_bytes_per_block={layout.worker_kv_bytes_per_block}"
            )
        rows = host_pool.rows
        if not rows.is_contiguous() or rows.device.type != "cpu":
            raise ConfigError("host pool rows must be one contiguous CPU tensor")
        threads = min(4, max(1, torch.get_num_threads())) if cpu_threads is None else cpu_threads
        if threads < 1:
            raise ConfigError(f"cpu_threads={cpu_threads} must be >= 1")
        self._layout = layout
        self._bpc = plan.blocks_per_chunk
        self._num_chunks = host_pool.num_chunks
        self._row_bytes = host_pool.row_bytes
        self._slot_offset = host_pool.slot_offset
        self._writes = host_pool.writes
        self._table = host_pool.integrity
        self._checksums = checksums
        self._unpolled: set[int] = set()
        self._closed = False
        host_flat = rows.reshape(-1)
        self._kv_bytes = kv_flat.numel()
        self._host_bytes = host_flat.numel()
        host_bytes: memoryview = memoryview(host_flat.numpy())  # type: ignore[arg-type]  # numpy is a buffer
        integrity = _Integrity(self._table, host_bytes, checksums)
        self._backend: _CpuBackend | _CudaBackend
        if kv_flat.is_cuda:
            self._backend = _CudaBackend(kv_flat, host_flat, integrity)
        elif kv_flat.device.type == "cpu":
            self._backend = _CpuBackend(kv_flat, host_flat, threads, integrity)
        else:
            raise ConfigError(f"kv_memory on device {kv_flat.device} is not supported (cpu or cuda)")

    def plan_runs(
        self,
        *,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        block_ids: IdsLike,
        chunk_ids: IdsLike,
    ) -> CopyRuns:
        """The coalesced runs a job would copy (validates like the submit calls)."""
        return build_copy_runs(
            self._layout,
            group_sizes=group_sizes,
            block_indices=block_indices,
            block_ids=block_ids,
            chunk_ids=chunk_ids,
            blocks_per_chunk=self._bpc,
            num_chunks=self._num_chunks,
            host_row_bytes=self._row_bytes,
            host_slot_offset=self._slot_offset,
        )

    def submit_store(
        self,
        job_id: int,
        *,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        block_ids: IdsLike,
        chunk_ids: IdsLike,
        chunk_tags: IdsLike | None = None,
    ) -> None:
        """Start copying engine blocks into host chunks (engine → host). Returns immediately.

        ``chunk_tags[i]`` is the key tag of ``chunk_ids[i]`` (:func:`~kvoffload.offload.integrity.key_tag`;
        omitted: untagged). A rank that does not write to a shared replicated pool completes the job with 0
        bytes and leaves the pool's integrity table to the writer.
        """
        self._submit(True, job_id, group_sizes, block_indices, block_ids, chunk_ids, chunk_tags)

    def submit_load(
        self,
        job_id: int,
        *,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        block_ids: IdsLike,
        chunk_ids: IdsLike,
        chunk_tags: IdsLike | None = None,
    ) -> None:
        """Start copying host chunks back into engine blocks (host → engine). Returns immediately.

        The job fails (``corrupt_chunk_ids`` set) when a sub-block it reads was not sealed by a completed
        store, holds another key than ``chunk_tags`` says, or (with checksums) has other bytes than stored.
        """
        self._submit(False, job_id, group_sizes, block_indices, block_ids, chunk_ids, chunk_tags)

    def _submit(
        self,
        is_store: bool,
        job_id: int,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        block_ids: IdsLike,
        chunk_ids: IdsLike,
        chunk_tags: IdsLike | None = None,
    ) -> None:
        if self._closed:
            raise InvalidStateError(f"job {job_id}: the copy engine is closed")
        if job_id in self._unpolled:
            raise InvalidStateError(f"job_id={job_id} is still in flight (or its result was not polled)")
        runs = self.plan_runs(
            group_sizes=group_sizes, block_indices=block_indices, block_ids=block_ids, chunk_ids=chunk_ids
        )
        if len(runs):
            # Guards the raw-pointer copies against a hand-built layout that does not fit the memory.
            for side, offsets, limit in (
                ("engine", runs.engine_offsets, self._kv_bytes),
                ("host", runs.host_offsets, self._host_bytes),
            ):
                low, high = int(offsets.min()), int((offsets + runs.lengths).max())
                if low < 0 or high > limit:
                    raise ConfigError(f"job {job_id}: runs reach {side} bytes [{low}, {high}) outside [0, {limit})")
        slots: BlockSlots | None = None
        if is_store and not self._writes:
            runs = CopyRuns.empty()
        else:
            slots = build_block_slots(
                self._layout,
                self._table,
                group_sizes=group_sizes,
                block_indices=block_indices,
                chunk_ids=chunk_ids,
                chunk_tags=chunk_tags,
                blocks_per_chunk=self._bpc,
                host_row_bytes=self._row_bytes,
                host_slot_offset=self._slot_offset,
            )
            if is_store:
                self._table.invalidate(slots)  # unusable until this store's copy has completed
        self._unpolled.add(job_id)
        self._backend.submit(job_id, is_store, runs, slots)

    @property
    def checksums(self) -> bool:
        """Whether stores record and loads verify content checksums (key tags always are)."""
        return self._checksums

    def poll(self) -> list[TransferResult]:
        """Finished jobs since the last call: stores then loads, each in submission order."""
        results = self._backend.poll()
        for result in results:
            self._unpolled.discard(result.job_id)
        return results

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until the given jobs have finished (their results stay for :meth:`poll`).

        Ids not in flight return at once. Raises :class:`TransferError` after ``timeout`` seconds.
        """
        ids = set(job_ids) & self._unpolled
        if ids and not self._backend.wait(ids, timeout):
            raise TransferError(f"jobs {sorted(ids)} did not finish within {timeout}s")

    def close(self) -> None:
        """Finish the submitted jobs and stop the threads/streams; results stay pollable."""
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
