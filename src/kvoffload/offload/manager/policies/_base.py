"""The cache-policy interface of the host block manager: what a replacement policy must answer.

A policy orders the chunks resident in the host pool and picks eviction victims; the manager owns chunk
ids, reference counts and events. Evictability contract shared by all policies: a key enters *pending*
(its write is in flight) and is not evictable; ``mark_evictable`` makes it ready and unpinned;
``mark_non_evictable`` withdraws it while loads pin it. Only evictable keys that are not ``protected`` are
ever returned by :meth:`CachePolicy.evict`, and eviction is all-or-nothing.

Request-scoped hooks (vLLM 0.33): ``insert``, ``touch`` and ``on_store_miss`` take the request's
:class:`~kvoffload.offload.manager.policies.RequestContext` (``None`` outside a request), ``on_request_access``
sees the keys a request loads or finds stored when offering, and ``on_request_finished`` its keys per KV-cache
group, split into the ones it only inserted and the ones it reused. The context carries each key's end-token
position; without positions every built-in policy orders exactly as by insertion and touch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from collections.abc import Set as AbstractSet
from typing import ClassVar, cast

from kvoffload._ints import check_int
from kvoffload.errors import ConfigError
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager.policies._context import RequestContext

__all__ = ["CachePolicy", "check_evict_count", "request_finished_args"]


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
    def insert(self, key: OffloadKey, chunk_id: int, ctx: RequestContext | None = None) -> None:
        """Add ``key`` as the most recent entry, pending (not evictable until :meth:`mark_evictable`).

        ``ctx`` is the request that stores it (vLLM's LRU ranks a key with a recorded position by it)."""

    def insert_many(
        self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int], ctx: RequestContext | None = None
    ) -> None:
        """Insert ``keys[i] -> chunk_ids[i]`` in order; the same result as repeated :meth:`insert`."""
        insert = self.insert
        for key, chunk_id in zip(keys, chunk_ids, strict=True):
            if ctx is None:
                insert(key, chunk_id)  # a policy written for 1.4 takes no context
            else:
                insert(key, chunk_id, ctx)

    @abstractmethod
    def remove(self, key: OffloadKey) -> int | None:
        """Drop a resident key without recording it as evicted; return its chunk id or ``None``."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
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

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        """Observe offered keys that were not resident (once per request), before they are inserted;
        default: :meth:`touch` (vLLM 0.33)."""
        if ctx is None:
            self.touch(keys)  # a policy written for 1.4 takes no context
        else:
            self.touch(keys, ctx)

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: RequestContext | None = None) -> None:
        """Observe a request's access to ``keys``: the keys it loads, and the keys of its offers that are stored
        or about to be (vLLM 0.33 ``on_request_access``); default: nothing."""
        return

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]] | Sequence[OffloadKey],
        insertion_only: AbstractSet[OffloadKey],
        reused: AbstractSet[OffloadKey] | None = None,
        ctx: RequestContext | None = None,
    ) -> None:
        """Observe a finished request (vLLM 0.33): ``key_groups`` are its keys per KV-cache group, each head to
        tail; ``insertion_only`` the keys it stored and did not reuse, ``reused`` the stored keys it loaded or
        found stored when offering.

        Default: :meth:`touch` each group. The two-argument form ``(keys, reused)`` of kvoffload 1.4 is still
        accepted: the keys form one group and those not in ``reused`` are insertion-only.
        """
        groups, _, _ = request_finished_args(key_groups, insertion_only, reused)
        for keys in groups:
            if ctx is None:
                self.touch(keys)
            else:
                self.touch(keys, ctx)


def check_evict_count(n: int) -> None:
    """Reject a negative eviction count, which always means a caller bug."""
    if n < 0:
        raise ConfigError(f"number of chunks to evict must be >= 0, got {n}")


def request_finished_args(
    key_groups: Sequence[Sequence[OffloadKey]] | Sequence[OffloadKey],
    insertion_only: AbstractSet[OffloadKey],
    reused: AbstractSet[OffloadKey] | None,
) -> tuple[Sequence[Sequence[OffloadKey]], AbstractSet[OffloadKey], AbstractSet[OffloadKey]]:
    """``on_request_finished``'s arguments as ``(key_groups, insertion_only, reused)``; the 1.4 form ``(keys,
    reused)`` (``reused`` left out) becomes one group whose keys not in ``reused`` are insertion-only."""
    if reused is not None:
        return cast("Sequence[Sequence[OffloadKey]]", key_groups), insertion_only, reused
    keys = cast("Sequence[OffloadKey]", key_groups)
    return (keys,), {key for key in keys if key not in insertion_only}, insertion_only
