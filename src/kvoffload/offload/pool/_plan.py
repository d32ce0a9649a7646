"""Sizing of the host pool (:func:`plan_host_pool`): how many chunk rows fit the host budget, and where each
rank's slot lives in a row.

A row holds one chunk: for every worker sharing the row a *slot* of ``worker_kv_bytes_per_block *
blocks_per_chunk`` bytes, where sub-block ``j`` of the slot holds engine block ``j`` of the chunk. Sizing
follows vLLM 0.33's CPU offloading spec.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload._ints import check_int, round_up
from kvoffload.errors import ConfigError, HostMemoryError

if TYPE_CHECKING:
    from kvoffload._generated import OffloadingConfig

__all__ = [
    "PAGE_SIZE",
    "TABLE_FIELDS",
    "HostPoolPlan",
    "plan_host_pool",
    "plan_host_pool_from_config",
    "table_bytes",
    "table_entries",
]

PAGE_SIZE = mmap.PAGESIZE
"""Plan rows are rounded up to this many bytes (the OS page size, vLLM's ``BLOCK_SIZE_ALIGNMENT``)."""

TABLE_FIELDS = 3
"""Fields of one integrity-table entry (key tag, checksum, state), each an int64."""


def table_entries(num_chunks: int, slots: int, blocks_per_chunk: int) -> int:
    """Number of metadata entries of a pool: one per (chunk, slot, sub-block)."""
    return num_chunks * slots * blocks_per_chunk


def table_bytes(num_chunks: int, slots: int, blocks_per_chunk: int) -> int:
    """Bytes of the metadata table of a pool (three int64 per entry)."""
    return table_entries(num_chunks, slots, blocks_per_chunk) * TABLE_FIELDS * 8


@dataclass(frozen=True)
class HostPoolPlan:
    """How big the host pool is and where this rank's slot lives in each chunk row.

    ``slot_bytes`` is the per-worker slot (``worker_kv_bytes_per_block * blocks_per_chunk``); ``row_bytes``
    is the page-rounded width of a row holding ``copies`` slots back to back; ``num_chunks`` rows fit in the
    total budget ``cpu_bytes_to_use`` (shared by all workers). ``slot_offset`` is where this rank's slot
    starts inside a row of a shared region; ``writes`` says whether this rank writes stores into a shared
    region (when the offload is replicated only rank 0 does, every rank reads).
    """

    worker_kv_bytes_per_block: int
    blocks_per_chunk: int
    world_size: int
    rank: int
    replicated: bool
    cpu_bytes_to_use: int
    copies: int
    slot_bytes: int
    row_bytes: int
    num_chunks: int
    slot_offset: int
    writes: bool

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole (shared) pool: ``num_chunks * row_bytes``."""
        return self.num_chunks * self.row_bytes

    @property
    def shared_file_bytes(self) -> int:
        """Size of the shared-memory file: the rows, then the integrity table (0 when there are no rows)."""
        if self.total_bytes == 0:
            return 0
        return self.total_bytes + table_bytes(self.num_chunks, self.copies, self.blocks_per_chunk)

    def slot_offset_of(self, rank: int) -> int:
        """Byte offset of ``rank``'s slot inside a shared row (0 for every rank when replicated)."""
        _check_rank(rank, self.world_size)
        return 0 if self.replicated else rank * self.slot_bytes


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} must be in [0, world_size={world_size})")


def plan_host_pool(
    *,
    worker_kv_bytes_per_block: int,
    world_size: int,
    blocks_per_chunk: int,
    cpu_bytes_to_use: int,
    replicated: bool,
    rank: int,
) -> HostPoolPlan:
    """Size the host pool from the TOTAL host budget ``cpu_bytes_to_use`` (all workers together).

    Exactly vLLM 0.33's rule: ``copies = 1 if replicated else world_size``; ``raw_chunk =
    worker_kv_bytes_per_block * copies * blocks_per_chunk``; ``slot_bytes = raw_chunk // copies``;
    ``row_bytes = round_up(raw_chunk, PAGE_SIZE)``; ``num_chunks = cpu_bytes_to_use // row_bytes``; all
    zero when ``worker_kv_bytes_per_block`` is 0. Raises :class:`ConfigError` for out-of-range inputs and
    :class:`HostMemoryError` when the budget cannot hold a single chunk row.
    """
    for name, value, low in (
        ("worker_kv_bytes_per_block", worker_kv_bytes_per_block, 0),
        ("world_size", world_size, 1),
        ("blocks_per_chunk", blocks_per_chunk, 1),
    ):
        check_int(name, value, low, value_first=True)
    _check_rank(rank, world_size)
    if cpu_bytes_to_use <= 0:
        raise ConfigError(
            f"cpu_bytes_to_use={cpu_bytes_to_use} must be > 0: it is the total host budget in bytes "
            f"across all {world_size} workers"
        )
    copies = 1 if replicated else world_size
    if worker_kv_bytes_per_block == 0:
        slot_bytes = row_bytes = num_chunks = 0
    else:
        raw_chunk = worker_kv_bytes_per_block * copies * blocks_per_chunk
        slot_bytes = raw_chunk // copies
        row_bytes = round_up(raw_chunk, PAGE_SIZE)
        num_chunks = cpu_bytes_to_use // row_bytes
        if num_chunks == 0:
            raise HostMemoryError(
                f"cpu_bytes_to_use={cpu_bytes_to_use} (the total host budget across all {world_size} "
                f"workers) is smaller than one chunk row of row_bytes={row_bytes} "
                f"(worker_kv_bytes_per_block={worker_kv_bytes_per_block} x copies={copies} x "
                f"blocks_per_chunk={blocks_per_chunk}, rounded up to {PAGE_SIZE})"
            )
    return HostPoolPlan(
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        blocks_per_chunk=blocks_per_chunk,
        world_size=world_size,
        rank=rank,
        replicated=replicated,
        cpu_bytes_to_use=cpu_bytes_to_use,
        copies=copies,
        slot_bytes=slot_bytes,
        row_bytes=row_bytes,
        num_chunks=num_chunks,
        slot_offset=0 if replicated else rank * slot_bytes,
        writes=not replicated or rank == 0,
    )


def host_budget(raw: object, field: str = "cpu_bytes_to_use") -> int:
    """The host budget ``raw`` (``kv_connector_extra_config["cpu_bytes_to_use"]``) as bytes, by vLLM's rule.

    vLLM's spec takes ``int(cpu_bytes_to_use)``, so ``268435456``, ``"268435456"`` and ``2.68e8`` are budgets; a
    bool, a non-number or a value <= 0 is a :class:`ConfigError` naming ``field`` and the value. The one place
    this rule lives: the connector's options, the runnability check and the pool plan all read it here.
    """
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ConfigError(f"{field}={raw!r} is not a number of bytes")
    try:
        budget = int(raw)
    except (ValueError, OverflowError):
        raise ConfigError(f"{field}={raw!r} is not a number of bytes") from None
    if budget <= 0:
        raise ConfigError(f"{field}={raw!r} must be > 0: it is the total host budget in bytes across all workers")
    return budget


def plan_host_pool_from_config(config: OffloadingConfig) -> HostPoolPlan:
    """:func:`plan_host_pool` for this worker of an :class:`OffloadingConfig`.

    The budget is ``extra_config["cpu_bytes_to_use"]``, the total host bytes across all workers (:func:`host_budget`).
    """
    raw = config.extra_config.get("cpu_bytes_to_use")
    if not raw:
        raise ConfigError(
            f"cpu_bytes_to_use={raw!r}: it must be specified in kv_connector_extra_config (the total host "
            f"budget in bytes across all {config.parallel.world_size} workers)"
        )
    return plan_host_pool(
        worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
        world_size=config.parallel.world_size,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        cpu_bytes_to_use=host_budget(raw),
        replicated=config.replicated_layout,
        rank=config.parallel.rank,
    )
