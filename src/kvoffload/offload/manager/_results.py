"""What the host block manager answers: lookup results, store plans, pool events and usage statistics."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvoffload._generated import Medium
from kvoffload.offload.keys import OffloadKey

__all__ = ["LookupResult", "ManagerStats", "OffloadEvent", "StorePlan"]


class LookupResult(enum.Enum):
    """Where a key stands in the host pool, as answered by :meth:`HostBlockManager.lookup`."""

    MISS = "miss"
    """Not in the pool."""
    HIT = "hit"
    """Stored and readable now."""
    HIT_PENDING = "hit_pending"
    """Allocated but its write is still in flight: ask again later instead of recomputing."""


@dataclass(frozen=True, slots=True)
class StorePlan:
    """What :meth:`HostBlockManager.prepare_store` decided: copy ``keys_to_store[i]`` into ``chunk_ids[i]``.

    ``evicted_keys`` were dropped from the pool to make room (their chunks may be among ``chunk_ids``).
    Keys of the offer that are not listed are already stored, in flight, or below the store threshold.
    """

    keys_to_store: list[OffloadKey]
    chunk_ids: list[int]
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True, slots=True)
class OffloadEvent:
    """A change of the pool's contents, for KV-cache event publishers (vLLM ``OffloadingEvent``).

    ``removed`` is False for keys whose store completed and True for evictions; ``metadata_only``
    removals undo a failed store that was never announced as stored, so publishers emit nothing for them.
    """

    keys: tuple[OffloadKey, ...]
    removed: bool
    medium: Medium = Medium.CPU
    metadata_only: bool = False


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """A snapshot of pool usage and activity, as returned by :meth:`HostBlockManager.stats`.

    ``usage`` counts chunks that cannot be evicted (pending or pinned) over ``num_chunks``, like vLLM's
    ``cpu_cache_usage_perc``; ``write_usage`` is the pending share and ``read_usage`` the rest.
    ``allocation_sizes`` and ``stores_skipped`` cover the time since the previous ``stats()`` call; the
    other counters are totals since construction (``reset`` keeps them): ``hits`` includes HIT_PENDING
    answers, ``stored`` counts completed stores, ``evicted`` evicted keys, ``load_pins`` keys pinned by
    ``prepare_load``.
    """

    num_chunks: int
    usage: float
    write_usage: float
    read_usage: float
    allocation_sizes: tuple[int, ...]
    stores_skipped: int
    lookups: int
    hits: int
    misses: int
    stored: int
    evicted: int
    load_pins: int
    dropped: int = 0
    """Keys dropped because their chunk was found corrupt (:meth:`HostBlockManager.drop`), since construction."""
