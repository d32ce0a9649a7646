"""Copy runs of one job, shared by the CPU and the CUDA backends, and the sub-blocks it touches.

:func:`build_copy_runs` turns one job (groups, logical block indices, engine block ids, host chunk ids) into
coalesced byte runs, with vLLM 0.33's sub-block rule: chunk row sub-block ``j`` holds engine block ``j`` of
the chunk, and a partly covered first chunk is entered at sub-block ``block_index % blocks_per_chunk``.
:func:`build_block_slots` names the sub-blocks a job touches (same index math) so that stores seal and loads
verify them in the pool's integrity table (:mod:`kvoffload.offload.pool._integrity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload._ints import cdiv, check_int
from kvoffload._placement import TransferLayout
from kvoffload.errors import ConfigError
from kvoffload.offload.pool import BlockSlots, IntegrityTable

__all__ = ["CopyRuns", "IdsLike", "JobBlocks", "build_block_slots", "build_copy_runs", "check_job_ids"]

IdsLike = Sequence[int] | torch.Tensor | np.ndarray
"""Block or chunk ids: a sequence of ints, a 1-D integer tensor or a 1-D integer numpy array."""


@dataclass(frozen=True)
class JobBlocks:
    """The blocks of one job in job order (the order of its sub-block slots): the group of each, its engine
    block id and the host byte where its sub-block starts. A backend may copy block by block instead of run
    by run."""

    groups: np.ndarray  # int64
    engine_blocks: np.ndarray  # int64
    host_blocks: np.ndarray  # int64


@dataclass(frozen=True)
class CopyRuns:
    """Coalesced byte runs of one job: ``lengths[i]`` bytes between engine byte ``engine_offsets[i]`` and
    host byte ``host_offsets[i]`` (offsets into the flat engine allocation and the flat host rows), and the
    job's blocks they come from."""

    engine_offsets: torch.Tensor
    host_offsets: torch.Tensor
    lengths: torch.Tensor
    num_bytes: int
    blocks: JobBlocks | None = None

    @staticmethod
    def empty() -> CopyRuns:
        """No bytes to move."""
        none = torch.zeros(0, dtype=torch.int64)
        return CopyRuns(none, none, none, 0)

    def __len__(self) -> int:
        return int(self.lengths.numel())


_INT_KINDS = frozenset("iu")


def _as_ids(ids: IdsLike, field: str) -> np.ndarray:
    """``ids`` as a 1-D int64 numpy array (a CPU int64 tensor's memory is shared, not copied)."""
    if isinstance(ids, torch.Tensor):
        try:
            shared = ids.numpy()  # a CPU tensor's memory (raises for other devices or a tensor that needs grad)
        except (TypeError, RuntimeError):
            shared = None
        if shared is not None and shared.ndim == 1 and shared.dtype == np.int64:
            return shared
        # anything else goes through torch's checks and conversion below
    else:
        try:
            array = np.asarray(ids)
        except (TypeError, ValueError, OverflowError):
            array = None
        if array is not None and array.ndim == 1 and array.dtype.kind in _INT_KINDS and array.dtype != np.uint64:
            return array.astype(np.int64, copy=False)
        # anything else goes through torch's conversion, whose refusals name the problem
    try:
        tensor = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{field} must be a sequence of ints or an integer tensor: {exc}") from exc
    if tensor.dim() != 1:
        raise ConfigError(f"{field} must be one-dimensional, got shape {tuple(tensor.shape)}")
    if tensor.numel() and tensor.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ConfigError(f"{field} must hold integers, got dtype {tensor.dtype}")
    out: np.ndarray = tensor.to(device="cpu", dtype=torch.int64).numpy()
    return out


def _check_range(ids: np.ndarray, field: str, limit: int, limit_name: str) -> None:
    if ids.size == 0 or int(ids.view(np.uint64).max()) < limit:  # one pass: a negative id wraps past any limit
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise ConfigError(f"{field} contains {bad}, outside [0, {limit_name}={limit})")


def _checked_ids(
    layout: TransferLayout,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    block_ids: IdsLike,
    chunk_ids: IdsLike,
    bpc: int,
    num_chunks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """A job's block and chunk ids as int64 arrays, once the counts and the id ranges are checked."""
    check_int("blocks_per_chunk", bpc, 1, value_first=True)
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
            needed_chunks += cdiv(n + b % bpc, bpc)
    blocks = _as_ids(block_ids, "block_ids")
    chunks = _as_ids(chunk_ids, "chunk_ids")
    needed_blocks = sum(group_sizes)
    if blocks.size != needed_blocks or chunks.size != needed_chunks:
        raise ConfigError(
            f"group_sizes={list(group_sizes)} with block_indices={list(block_indices)} and "
            f"blocks_per_chunk={bpc} consume {needed_blocks} block_ids and {needed_chunks} chunk_ids, "
            f"but the job has {blocks.size} block_ids and {chunks.size} chunk_ids"
        )
    _check_range(blocks, "block_ids", layout.num_blocks, "num_blocks")
    _check_range(chunks, "chunk_ids", num_chunks, "num_chunks")

    return blocks, chunks


def check_job_ids(
    layout: TransferLayout,
    *,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    block_ids: IdsLike,
    chunk_ids: IdsLike,
    blocks_per_chunk: int,
    num_chunks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`build_copy_runs` checks first, without building the runs: the counts a job consumes and the
    range of every id (:class:`ConfigError` names the first problem). Returns its block and chunk ids as int64
    arrays."""
    return _checked_ids(layout, group_sizes, block_indices, block_ids, chunk_ids, blocks_per_chunk, num_chunks)


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
    """Byte runs moving one job's pages (the same runs serve stores and loads).

    Group ``g`` moves ``group_sizes[g]`` engine blocks, taken in order from ``block_ids``; its first block
    has logical index ``block_indices[g]``, so it starts at sub-block ``skip = block_indices[g] %
    blocks_per_chunk`` of its first chunk and uses the next ``cdiv(n + skip, blocks_per_chunk)`` ids of
    ``chunk_ids``. Engine block ``i`` of the group lands in host chunk ``chunk[(skip+i) // bpc]`` at
    sub-block ``(skip+i) % bpc``, i.e. host byte ``chunk*host_row_bytes + host_slot_offset +
    sub*worker_kv_bytes_per_block + page host offset``. Raises :class:`ConfigError` when the counts are not
    consumed exactly or an id is out of range.
    """
    bpc = blocks_per_chunk
    blocks, chunks = _checked_ids(layout, group_sizes, block_indices, block_ids, chunk_ids, bpc, num_chunks)

    wkb = layout.worker_kv_bytes_per_block
    engine_parts: list[np.ndarray] = []
    host_parts: list[np.ndarray] = []
    length_parts: list[np.ndarray] = []
    block_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    num_bytes = 0
    block_pos = chunk_pos = 0
    for g, (n, b) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if n == 0:
            continue
        group = layout.groups[g]
        skip = b % bpc
        count = cdiv(n + skip, bpc)
        engine_blocks = blocks[block_pos : block_pos + n]
        group_chunks = chunks[chunk_pos : chunk_pos + count]
        block_pos += n
        chunk_pos += count
        num_bytes += n * group.bytes_per_block
        chunk_of_block, sub_block = _block_positions(group_chunks, skip, n, bpc)
        host_block = chunk_of_block * host_row_bytes + sub_block * wkb + host_slot_offset
        block_parts.append((np.full(n, g, dtype=np.int64), engine_blocks, host_block))
        seg = group.segment_table
        if not seg.size:
            continue
        # Segment-major order: consecutive blocks of one segment sit next to each other, so runs of
        # consecutive engine blocks landing in consecutive sub-blocks coalesce.
        engine_parts.append((seg[:, 0:1] + seg[:, 1:2] * engine_blocks).reshape(-1))
        host_parts.append((seg[:, 3:4] + host_block).reshape(-1))
        length_parts.append(np.repeat(seg[:, 2], n))
    if not engine_parts:
        return CopyRuns.empty()
    (engine, host), length = merge_runs(
        (np.concatenate(engine_parts), np.concatenate(host_parts)), np.concatenate(length_parts)
    )
    job_blocks = JobBlocks(
        groups=np.concatenate([p[0] for p in block_parts]),
        engine_blocks=np.concatenate([p[1] for p in block_parts]),
        host_blocks=np.concatenate([p[2] for p in block_parts]),
    )
    return CopyRuns(torch.from_numpy(engine), torch.from_numpy(host), torch.from_numpy(length), num_bytes, job_blocks)


def _block_positions(group_chunks: np.ndarray, skip: int, n: int, bpc: int) -> tuple[np.ndarray, np.ndarray]:
    """Host chunk id and sub-block of each of a group's ``n`` blocks entered at sub-block ``skip``.

    Block ``i`` lands in chunk ``(skip+i) // bpc`` of the group's chunks, at sub-block ``(skip+i) % bpc``.
    """
    if bpc == 1:
        return group_chunks, np.zeros(n, dtype=np.int64)
    sub = np.arange(skip, skip + n, dtype=np.int64)
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
    tags = np.zeros_like(chunks) if chunk_tags is None else _as_ids(chunk_tags, "chunk_tags")
    if tags.size == 0:
        tags = np.zeros_like(chunks)
    if tags.size != chunks.size:
        raise ConfigError(f"chunk_tags has {tags.size} entries but the job has {chunks.size} chunk_ids")
    wkb = layout.worker_kv_bytes_per_block
    chunk_parts: list[np.ndarray] = []
    sub_parts: list[np.ndarray] = []
    tag_parts: list[np.ndarray] = []
    length_parts: list[np.ndarray] = []
    chunk_pos = 0
    for g, (n, b) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if n == 0:
            continue
        skip = b % bpc
        count = cdiv(n + skip, bpc)
        chunk_of_block, sub_block = _block_positions(chunks[chunk_pos : chunk_pos + count], skip, n, bpc)
        tag_of_block, _ = _block_positions(tags[chunk_pos : chunk_pos + count], skip, n, bpc)
        chunk_pos += count
        chunk_parts.append(chunk_of_block)
        sub_parts.append(sub_block)
        tag_parts.append(tag_of_block)
        length_parts.append(np.full(n, layout.groups[g].bytes_per_block, dtype=np.int64))
    if not chunk_parts:
        none = np.zeros(0, dtype=np.int64)
        return BlockSlots(none, none, none, none, none)
    chunk_of = np.concatenate(chunk_parts)
    sub_of = np.concatenate(sub_parts)
    host = chunk_of * host_row_bytes + sub_of * wkb + host_slot_offset
    return BlockSlots(
        entries=table.entry_index(chunk_of, sub_of),
        chunk_ids=chunk_of,
        host_offsets=host,
        lengths=np.concatenate(length_parts),
        tags=np.concatenate(tag_parts),
    )


def merge_runs(offsets: tuple[np.ndarray, ...], length: np.ndarray) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Merge neighbouring runs whose every offset continues where the previous run ended."""
    m = length.size
    if m <= 1:
        return offsets, length
    joins = np.ones(m - 1, dtype=bool)
    for off in offsets:
        joins &= off[1:] == off[:-1] + length[:-1]
    if not joins.any():
        return offsets, length
    starts = np.ones(m, dtype=bool)
    starts[1:] = ~joins
    first = np.flatnonzero(starts)
    last = np.append(first[1:] - 1, m - 1)
    total = np.cumsum(length)
    merged = total[last] - total[first] + length[first]
    return tuple(off[first] for off in offsets), merged
