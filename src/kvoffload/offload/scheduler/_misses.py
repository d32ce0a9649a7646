"""Explainable misses: for a lookup, which wanted chunks were not loaded and why (one :class:`MissReason` each).

The scheduler calls :func:`explain_lookup` after every lookup that did not load everything it could have
wanted. A chunk is *wanted* when it lies between the request's computed tokens and its last token (the last
token is always recomputed) and has a key (only complete chunks are ever stored). Each wanted chunk that is not
part of the hit gets a reason, from the chunk's position first, then from the pool's memory of the key:

* ``outside_window``: a sliding-window group does not need it (it lies before the loaded window);
* ``load_limit``: it lies past the request's ``max_load_tokens``;
* the pool's answer (:meth:`HostBlockManager.miss_reason`): ``store_pending``, ``evicted``, ``store_failed``,
  ``corrupt``, ``tier_unavailable`` (as recorded by ``remove``), ``below_store_threshold`` or ``never_stored``;
* ``after_gap``: the chunk is stored and ready, but an earlier chunk (or another group) missed, so the hit
  stopped before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload._generated import MissReason
from kvoffload._ints import cdiv
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager import HostBlockManager

__all__ = ["ChunkMiss", "GroupKeys", "explain_lookup", "primary_reason"]

_SECONDARY = (MissReason.OUTSIDE_WINDOW, MissReason.AFTER_GAP)


@dataclass(frozen=True, slots=True)
class ChunkMiss:
    """One wanted chunk of a request that a lookup did not load, and why."""

    group_id: int
    """KV cache group id of the chunk's key."""
    chunk: int
    """Chunk index within the request (chunk ``i`` covers tokens ``[i * tpc, (i + 1) * tpc)``)."""
    start_token: int
    """First token the chunk covers."""
    key: OffloadKey
    """The chunk's offload key."""
    reason: MissReason
    """Why it was not loaded."""


@dataclass(frozen=True, slots=True)
class GroupKeys:
    """What :func:`explain_lookup` needs of one offloaded group of a request."""

    group_id: int
    tokens_per_chunk: int
    window_chunks: int | None
    keys: Sequence[OffloadKey]


def explain_lookup(
    manager: HostBlockManager,
    groups: Sequence[GroupKeys],
    *,
    num_computed: int,
    num_tokens: int,
    hit_end: int,
    max_load_tokens: int | None,
) -> list[ChunkMiss]:
    """Reasons for every wanted chunk of every group outside the hit ``[num_computed, hit_end)``.

    ``hit_end == num_computed`` means nothing was loaded. Reads the pool without changing its statistics.
    """
    misses: list[ChunkMiss] = []
    limit = None if max_load_tokens is None else num_computed + max_load_tokens
    wanted_end = max(num_tokens - 1, 0)
    miss_reason = manager.miss_reason
    for g in groups:
        tpc = g.tokens_per_chunk
        keys = g.keys
        first = num_computed // tpc
        last = min(len(keys), wanted_end // tpc)
        if hit_end > num_computed:
            hi = cdiv(hit_end, tpc)
            lo = first if g.window_chunks is None else max(first, hi - max(1, g.window_chunks))
        else:
            lo = hi = first
        for c in range(first, last):
            if lo <= c < hi:
                continue
            if c < lo:
                reason = MissReason.OUTSIDE_WINDOW
            elif limit is not None and (c + 1) * tpc > limit:
                reason = MissReason.LOAD_LIMIT
            else:
                reason = miss_reason(keys[c]) or MissReason.AFTER_GAP
            misses.append(ChunkMiss(g.group_id, c, c * tpc, keys[c], reason))
    return misses


def primary_reason(misses: Sequence[ChunkMiss]) -> MissReason:
    """The reason of a lookup that loaded nothing: its earliest chunk miss that is not a consequence of another.

    ``outside_window`` and ``after_gap`` only answer when nothing else does. With no wanted chunk at all (what
    is left to compute is shorter than one chunk, and partial chunks are never stored) it is ``never_stored``.
    """
    best: ChunkMiss | None = None
    fallback: ChunkMiss | None = None
    for miss in misses:
        if miss.reason in _SECONDARY:
            if fallback is None or miss.start_token < fallback.start_token:
                fallback = miss
        elif best is None or miss.start_token < best.start_token:
            best = miss
    chosen = best or fallback
    return MissReason.NEVER_STORED if chosen is None else chosen.reason
