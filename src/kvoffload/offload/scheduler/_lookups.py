"""The offload scheduler's lookups: the longest loadable hit of a request over all its groups, pinned until
its blocks are allocated, and the reason for every wanted chunk it does not load."""

from __future__ import annotations

from kvoffload._generated import MissReason
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.scheduler._misses import GroupKeys, explain_lookup, primary_reason
from kvoffload.offload.scheduler._scan import maximal_prefix_lookup, sliding_window_lookup
from kvoffload.offload.scheduler._state import RequestState, SchedulerBook

__all__ = ["Lookups"]


class Lookups:
    """The lookup part of the offload scheduler: which chunks a request can load now, and why others miss."""

    def __init__(self, book: SchedulerBook) -> None:
        self._book = book
        self._stats = book.stats
        self._manager = book.manager

    def lookup(self, req_id: str, num_computed_tokens: int) -> int | None:
        """The host-pool lookup of :meth:`OffloadScheduler.lookup`."""
        req = self._book.request(req_id)
        self._stats.lookups += 1
        self._book.release_pins(req)
        req.misses = ()
        if req.jobs:
            self._stats.lookups_deferred += 1
            return None
        max_hit = req.num_tokens - 1
        if req.max_load_tokens is not None:
            max_hit = min(max_hit, num_computed_tokens + req.max_load_tokens)
        hit = self._lookup_groups(req, num_computed_tokens, max_hit)
        if hit is None:
            self._stats.lookups_deferred += 1
            self._explain(req, num_computed_tokens, num_computed_tokens, pending_only=True)
            return None
        if hit <= 0:
            self._stats.lookup_misses += 1
            self._explain(req, num_computed_tokens, num_computed_tokens)
            return 0
        max_hit = num_computed_tokens + hit
        keys = self._hit_keys(req, num_computed_tokens, max_hit)
        if any(k in self._book.loading for k in keys):
            # Another request is loading these chunks into engine blocks; the engine's prefix cache will
            # serve them once it finishes (vLLM waits for the same reason).
            self._stats.lookups_deferred += 1
            return None
        self._manager.prepare_load(keys)
        self._manager.touch(keys)
        req.pinned = keys
        req.hit_start, req.hit_end = num_computed_tokens, max_hit
        self._stats.lookup_hits += 1
        self._explain(req, num_computed_tokens, max_hit)
        return max_hit - num_computed_tokens

    def _explain(self, req: RequestState, num_computed: int, hit_end: int, *, pending_only: bool = False) -> None:
        """Record why the wanted chunks outside ``[num_computed, hit_end)`` were not loaded (stats + per request)."""
        groups = [
            GroupKeys(g.group_id, g.tokens_per_chunk, g.window_chunks, req.keys[g.index]) for g in self._book.groups
        ]
        misses = explain_lookup(
            self._manager,
            groups,
            num_computed=num_computed,
            num_tokens=req.num_tokens,
            hit_end=hit_end,
            max_load_tokens=req.max_load_tokens,
        )
        if pending_only:
            misses = [m for m in misses if m.reason is MissReason.STORE_PENDING]
        req.misses = tuple(misses)
        stats = self._stats
        for miss in misses:
            stats.count(stats.chunk_miss_reasons, miss.reason)
        if hit_end <= num_computed and (misses or not pending_only):
            reason = MissReason.STORE_PENDING if pending_only else primary_reason(misses)
            stats.count(stats.lookup_miss_reasons, reason)

    def forget_chunk(self, key: OffloadKey, reason: MissReason) -> bool:
        """Drop one chunk for ``reason`` and count it (see :meth:`OffloadScheduler.forget_chunk`)."""
        dropped = bool(self._manager.remove([key], reason))
        self._stats.count(self._stats.chunks_removed, reason)
        return dropped

    def _lookup_groups(self, req: RequestState, num_computed: int, max_hit: int) -> int | None:
        """Tokens beyond ``num_computed`` that every group can load, or None to defer (vLLM's ``_lookup``).

        Groups are visited full attention first, then sliding windows by decreasing window; each tightens
        ``max_hit`` to its chunk granularity. A group that defers does not stop the others (a later group
        may still answer "no hit"); when a later group shrinks the hit, a deferral is re-checked by
        visiting every group again, and earlier sliding windows are re-checked at the new end.
        Unlike vLLM, hit ends stay chunk-aligned (the scan ends at the last chunk wholly below ``max_hit``).
        """
        lookup = self._manager.lookup
        hit = 0
        defer = False
        to_visit = self._book.lookup_order
        while to_visit:
            looked_up_window = False
            visiting, to_visit = to_visit, ()
            for g in visiting:
                tpc = g.tokens_per_chunk
                keys = req.keys[g.index]
                max_hit = min(max_hit, len(keys) * tpc)
                if max_hit - num_computed < tpc:
                    return 0
                start = num_computed // tpc
                scanned = keys[start : max_hit // tpc]
                if g.window_chunks is None:
                    chunks = maximal_prefix_lookup(lookup, scanned)
                else:
                    chunks = sliding_window_lookup(lookup, scanned, max(1, g.window_chunks))
                if chunks == 0:
                    return 0
                if chunks is None:
                    defer = True
                else:
                    max_hit = min(max_hit, (start + chunks) * tpc)
                new_hit = max_hit - num_computed
                if new_hit < tpc:
                    return 0
                if new_hit < hit:
                    if defer:
                        defer = False
                        to_visit = self._book.lookup_order
                    elif looked_up_window and not to_visit:
                        to_visit = self._book.window_groups
                looked_up_window = looked_up_window or g.window_chunks is not None
                hit = new_hit
        return None if defer else hit

    def _hit_keys(self, req: RequestState, start: int, end: int) -> list[OffloadKey]:
        return [
            key
            for g in self._book.groups
            for key in self._book.chunk_keys_of_blocks(req, g, *self._book.load_range(g, start, end))
        ]
