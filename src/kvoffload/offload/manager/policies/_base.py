"""The cache-policy interface of the host block manager: what a replacement policy must answer.

A policy orders the chunks resident in the host pool and picks eviction victims; the manager owns chunk
ids, reference counts and events. Evictability contract shared by all policies: a key enters *pending*
(its write is in flight) and is not evictable; ``mark_evictable`` makes it ready and unpinned;
``mark_non_evictable`` withdraws it while loads pin it. Only evictable keys that are not ``protected`` are
ever returned by :meth:`CachePolicy.evict`, and eviction is all-or-nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from collections.abc import Set as AbstractSet
from typing import ClassVar

from kvoffload._ints import check_int
from kvoffload.errors import ConfigError
from kvoffload.offload.keys import OffloadKey

__all__ = ["CachePolicy", "check_evict_count"]


class CachePolicy(ABC):
    """Orders resident chunks and chooses eviction victims for a host pool of ``capacity`` chunks.

    Keys are :data:`~kvoffload.offload.keys.OffloadKey`; values are the manager's chunk ids. The manager calls
    the hooks at the same points as vLLM 0.33's ``CPUOffloadingManager`` so that policies see identical sequences.
    """

    __slots__ = ("capacity",)

    name: ClassVar[str] = ""
    """Registry name of the policy (``make_policy(name, ...)``)."""

    def __init__(self, capacity: int) -> None:
        """Create an empty policy for a pool of ``capacity`` chunks (also the ghost-list bound of ARC)."""
        self.capacity = check_int("capacity", capacity)

    @abstractmethod
    def __len__(self) -> int:
        """Return the number of resident keys (pending, ready or pinned)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Tell whether ``key`` is resident."""

    @abstractmethod
    def get(self, key: OffloadKey) -> int | None:
        """Return the chunk id of a resident key, or ``None``; never changes the order."""

    @abstractmethod
    def insert(self, key: OffloadKey, chunk_id: int) -> None:
        """Add ``key`` as the most recent entry, pending (not evictable until :meth:`mark_evictable`)."""

    def insert_many(self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int]) -> None:
        """Insert ``keys[i] -> chunk_ids[i]`` in order; the same result as repeated :meth:`insert`."""
        insert = self.insert
        for key, chunk_id in zip(keys, chunk_ids, strict=True):
            insert(key, chunk_id)

    @abstractmethod
    def remove(self, key: OffloadKey) -> int | None:
        """Drop a resident key without recording it as evicted; return its chunk id or ``None``."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record an access to ``keys``; the list is applied in reverse, so ``keys[0]`` ends most recent."""

    @abstractmethod
    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        """Remove and return exactly ``n`` evictable, unprotected ``(key, chunk_id)`` pairs in victim order.

        Returns ``None`` and changes nothing when fewer than ``n`` such keys exist (all-or-nothing).
        """

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and any learned state (the manager's ``reset``)."""

    @abstractmethod
    def mark_evictable(self, key: OffloadKey) -> None:
        """Declare ``key`` ready and unpinned: its store completed or its last load finished."""

    @abstractmethod
    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Declare ``key`` pinned by a load; it stays resident and is skipped by :meth:`evict`."""

    def mark_evictable_many(self, keys: Collection[OffloadKey]) -> None:
        """Apply :meth:`mark_evictable` to each key; order does not matter (batched for speed)."""
        mark = self.mark_evictable
        for key in keys:
            mark(key)

    def mark_non_evictable_many(self, keys: Collection[OffloadKey]) -> None:
        """Apply :meth:`mark_non_evictable` to each key; order does not matter (batched for speed)."""
        mark = self.mark_non_evictable
        for key in keys:
            mark(key)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        """Observe offered keys that were not resident (once per request); default: :meth:`touch`."""
        self.touch(keys)

    def on_request_finished(self, keys: Sequence[OffloadKey], reused: AbstractSet[OffloadKey]) -> None:
        """Observe a finished request's keys in prefix order; ``reused`` were hits, the rest its own stores.

        Default: :meth:`touch` the keys (what vLLM 0.33's LRU does when no key positions are known).
        """
        self.touch(keys)


def check_evict_count(n: int) -> None:
    """Reject a negative eviction count, which always means a caller bug."""
    if n < 0:
        raise ConfigError(f"number of chunks to evict must be >= 0, got {n}")
