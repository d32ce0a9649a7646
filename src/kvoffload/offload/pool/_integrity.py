"""Integrity of host chunks: a key tag and a content checksum per stored sub-block, verified on every load.

A corrupted or mislabelled host chunk must never reach the engine as if it were good KV. Every sub-block a
store writes (one engine block of one chunk, in this rank's slot) gets a metadata entry: the **tag** of the
offload key the chunk holds (:func:`key_tag`, a 64-bit xxh3 of the full key, computed by the scheduler and
carried in ``TransferJob.chunk_tags``), the **checksum** (xxh3_64) of the bytes the store wrote, and a
**state** (``INVALID``, ``TAGGED`` without a checksum, ``SEALED`` with one). A store invalidates its entries
when it is submitted and seals them only once its copy has completed; a load verifies the tag, and the
checksum unless checksums are turned off, and fails (naming the chunks) on any mismatch or missing entry.

Entries are kept per (chunk, slot, sub-block): with ``blocks_per_chunk > 1`` a job may write or read only
some sub-blocks of a chunk (partial first/last chunks), and in a shared pool several ranks own slots of one
row. The table lives beside the rows: a private pool holds it in its own memory, a shared pool at the end of
the shared file, so that every rank of a replicated layout verifies what rank 0 wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvoffload.offload.pool._plan import TABLE_FIELDS

__all__ = [
    "INVALID",
    "SEALED",
    "TAGGED",
    "BlockSlots",
    "Digests",
    "IntegrityTable",
]

INVALID = 0
"""No usable entry: never written, or a store into it is in flight."""
TAGGED = 1
"""The key tag is valid; the store ran with checksums turned off."""
SEALED = 2
"""The key tag and the content checksum are valid."""

_FIELDS = TABLE_FIELDS
_TAG, _SUM, _STATE = range(_FIELDS)
_hash = xxhash.xxh3_64_intdigest

Digests = list[int] | np.ndarray
"""xxh3_64 digests of a job's slots, in slot order: Python ints, or a uint64 array (what the native kernel
writes)."""


@dataclass(frozen=True)
class BlockSlots:
    """The sub-blocks one job touches: table entry, chunk id, host byte range and expected key tag of each.

    ``host_offsets`` and ``lengths`` are lists of ints or int64 arrays (what the copy engine builds: the native
    kernel takes them as they are)."""

    entries: np.ndarray  # int64 index into the table
    chunk_ids: np.ndarray  # int64
    host_offsets: list[int] | np.ndarray  # into the flat host rows
    lengths: list[int] | np.ndarray
    tags: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.lengths)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Host offsets and lengths as contiguous int64 arrays (views when they are already)."""
        offsets = np.ascontiguousarray(self.host_offsets, dtype=np.int64)
        lengths = np.ascontiguousarray(self.lengths, dtype=np.int64)
        return offsets, lengths

    def ranges(self) -> tuple[list[int], list[int]]:
        """Host offsets and lengths as lists of ints (for loops in Python)."""
        offsets, lengths = self.host_offsets, self.lengths
        return (
            offsets.tolist() if isinstance(offsets, np.ndarray) else offsets,
            lengths.tolist() if isinstance(lengths, np.ndarray) else lengths,
        )


class IntegrityTable:
    """Per-pool metadata: ``(tag, checksum, state)`` for every (chunk, slot, sub-block), as int64.

    ``storage`` is a 1-D int64 tensor of :func:`table_entries` x 3 values (private memory or a view of the
    shared pool file); ``slot`` is the slot this rank reads and writes (its rank in a shared non-replicated
    pool, else 0). Writers seal an entry by writing tag and checksum before the state.
    """

    def __init__(self, storage: torch.Tensor, *, num_chunks: int, slots: int, slot: int, blocks_per_chunk: int):
        self._storage = storage  # keeps the memory alive
        self._meta = storage.numpy().reshape(-1, _FIELDS)
        self.num_chunks = num_chunks
        self.slots = slots
        self.slot = slot
        self.blocks_per_chunk = blocks_per_chunk

    @property
    def storage(self) -> torch.Tensor:
        """The raw table (for tests and tools)."""
        return self._storage

    @property
    def address(self) -> int:
        """Where the table's rows start: per entry three int64, the tag, the checksum and the state, in that
        order (the native copy kernel seals and verifies in its copy call; it writes the state last)."""
        return int(self._meta.ctypes.data)

    @staticmethod
    def state_for(checksums: bool) -> int:
        """The state a completed store writes and a load needs: :data:`SEALED` with checksums, else
        :data:`TAGGED`."""
        return SEALED if checksums else TAGGED

    @staticmethod
    def bad_chunks(slots: BlockSlots, bad: np.ndarray) -> list[int]:
        """Chunk ids (sorted, unique) of the slots flagged in ``bad`` (one flag per slot)."""
        return sorted({int(c) for c in slots.chunk_ids[bad.astype(bool, copy=False)]})

    def entry_index(self, chunk_ids: np.ndarray, sub_blocks: np.ndarray | int) -> np.ndarray:
        """Table entries of this rank's ``sub_blocks`` of ``chunk_ids``."""
        entries: np.ndarray = (chunk_ids * self.slots + self.slot) * self.blocks_per_chunk + sub_blocks
        return entries

    def states(self, slots: BlockSlots) -> np.ndarray:
        """Current state of each entry of ``slots``."""
        states: np.ndarray = self._meta[slots.entries, _STATE].copy()
        return states

    def invalidate(self, slots: BlockSlots) -> None:
        """Mark the entries unusable: a store into them has started."""
        self._meta[slots.entries, _STATE] = INVALID

    def seal(self, slots: BlockSlots, host: memoryview, *, checksums: bool, sums: Digests | None = None) -> None:
        """Record the tags (and checksums of the host bytes) of a completed store, then mark them valid.

        ``sums`` are the xxh3_64 digests of the slots' bytes when the caller already computed them.
        """
        meta = self._meta
        idx = slots.entries
        meta[idx, _TAG] = slots.tags
        if checksums:
            meta[idx, _SUM] = _checksums(host, slots) if sums is None else _as_int64(sums)
        meta[idx, _STATE] = SEALED if checksums else TAGGED

    def verify(self, slots: BlockSlots, host: memoryview, *, checksums: bool, sums: Digests | None = None) -> list[int]:
        """Chunk ids (sorted, unique) of ``slots`` whose entry is missing, has another tag or another checksum.

        ``sums`` are the xxh3_64 digests of the slots' bytes when the caller already computed them.
        """
        if not len(slots):
            return []
        rows = self._meta[slots.entries]
        ok = (rows[:, _STATE] >= (SEALED if checksums else TAGGED)) & (rows[:, _TAG] == slots.tags)
        if checksums:
            ok &= rows[:, _SUM] == (_checksums(host, slots) if sums is None else _as_int64(sums))
        if bool(ok.all()):
            return []
        return self.bad_chunks(slots, ~ok)


def _checksums(host: memoryview, slots: BlockSlots) -> np.ndarray:
    """xxh3_64 of each host byte range, as int64."""
    return _as_int64([_hash(host[o : o + n]) for o, n in zip(*slots.ranges(), strict=True)])


def _as_int64(digests: Digests) -> np.ndarray:
    """The digests as the table's int64 (same bits); a uint64 array is viewed, not copied."""
    values: np.ndarray = np.asarray(digests, dtype=np.uint64).view(np.int64)
    return values
