"""The offload scheduler's lookups: the longest loadable hit of a request over all its groups, pinned until
its blocks are allocated, and the reason for every wanted chunk it does not load."""

from __future__ import annotations

from kvoffload._generated import MissReason
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.scheduler._misses import ChunkMiss, GroupKeys, explain_lookup, primary_reason
from kvoffload.offload.scheduler._scan import maximal_prefix_lookup, sliding_window_lookup
from kvoffload.offload.scheduler._state import RequestState, SchedulerState

__all__ = ["SchedulerLookup"]


class SchedulerLookup(SchedulerState):
    """The lookup part of the offload scheduler: which chunks a request can load now, and why others miss."""

    def lookup(self, req_id: str, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from the host, or None to ask again later.

        The hit is chunk-aligned, leaves at least the last token to compute, and its chunks are pinned
        until ``on_blocks_allocated`` turns them into a load job (or the next lookup/abort releases them).
        ``None`` means a needed chunk is still being written or loaded, or the request has a job in flight.
        """
        req = self._request(req_id)
        self._counters["lookups"] += 1
        self._release_pins(req)
        req.misses = ()
        if req.jobs:
            self._counters["lookups_deferred"] += 1
            return None
        max_hit = req.num_tokens - 1
        if req.max_load_tokens is not None:
            max_hit = min(max_hit, num_computed_tokens + req.max_load_tokens)
        hit = self._lookup_groups(req, num_computed_tokens, max_hit)
        if hit is None:
            self._counters["lookups_deferred"] += 1
            self._explain(req, num_computed_tokens, num_computed_tokens, pending_only=True)
            return None
        if hit <= 0:
            self._counters["lookup_misses"] += 1
            self._explain(req, num_computed_tokens, num_computed_tokens)
            return 0
        max_hit = num_computed_tokens + hit
        keys = self._hit_keys(req, num_computed_tokens, max_hit)
        if any(k in self._loading for k in keys):
            # Another request is loading these chunks into engine blocks; the engine's prefix cache will
            # serve them once it finishes (vLLM waits for the same reason).
            self._counters["lookups_deferred"] += 1
            return None
        self.manager.prepare_load(keys)
        self.manager.touch(keys)
        req.pinned = keys
        req.hit_start, req.hit_end = num_computed_tokens, max_hit
        self._counters["lookup_hits"] += 1
        self._explain(req, num_computed_tokens, max_hit)
        return max_hit - num_computed_tokens

    def _explain(self, req: RequestState, num_computed: int, hit_end: int, *, pending_only: bool = False) -> None:
        """Record why the wanted chunks outside ``[num_computed, hit_end)`` were not loaded (stats + per request)."""
        groups = [GroupKeys(g.group_id, g.tokens_per_chunk, g.window_chunks, req.keys[g.index]) for g in self._groups]
        misses = explain_lookup(
            self.manager,
            groups,
            num_computed=num_computed,
            num_tokens=req.num_tokens,
            hit_end=hit_end,
            max_load_tokens=req.max_load_tokens,
        )
        if pending_only:
            misses = [m for m in misses if m.reason is MissReason.STORE_PENDING]
        req.misses = tuple(misses)
        counts = self._chunk_misses
        for miss in misses:
            counts[miss.reason] = counts.get(miss.reason, 0) + 1
        if hit_end <= num_computed and (misses or not pending_only):
            reason = MissReason.STORE_PENDING if pending_only else primary_reason(misses)
            self._lookup_misses[reason] = self._lookup_misses.get(reason, 0) + 1

    def lookup_misses(self, req_id: str) -> tuple[ChunkMiss, ...]:
        """The chunks the request's last lookup wanted but did not load, each with its :class:`MissReason`.

        Empty before the first lookup, after a full hit, and for a lookup deferred for another reason than a
        pending store (the request has a job in flight, or another request is loading the chunks).
        """
        return self._request(req_id).misses

    def forget_chunk(self, key: OffloadKey, reason: MissReason) -> bool:
        """Drop one chunk from the pool for ``reason`` and remember it, so later misses on it say why.

        The hook for features that find a chunk unusable: a tier that cannot serve it
        (``MissReason.TIER_UNAVAILABLE``), or a checksum mismatch found elsewhere than in a load report
        (``MissReason.CORRUPT``; corrupt chunks named by worker reports are dropped already). Returns True when
        the chunk was resident and is dropped (a chunk pinned by loads is never served again and is freed at
        its last unpin); an absent one only has its reason remembered. A chunk whose store is in flight raises
        :class:`InvalidStateError`.
        """
        dropped = bool(self.manager.remove([key], reason))
        self._removed[reason] = self._removed.get(reason, 0) + 1
        return dropped

    def _lookup_groups(self, req: RequestState, num_computed: int, max_hit: int) -> int | None:
        """Tokens beyond ``num_computed`` that every group can load, or None to defer (vLLM's ``_lookup``).

        Groups are visited full attention first, then sliding windows by decreasing window; each tightens
        ``max_hit`` to its chunk granularity. A group that defers does not stop the others (a later group
        may still answer "no hit"); when a later group shrinks the hit, a deferral is re-checked by
        visiting every group again, and earlier sliding windows are re-checked at the new end.
        Unlike vLLM, hit ends stay chunk-aligned (the scan ends at the last chunk wholly below ``max_hit``).
        """
        lookup = self.manager.lookup
        hit = 0
        defer = False
        to_visit = self._lookup_order
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
                        to_visit = self._lookup_order
                    elif looked_up_window and not to_visit:
                        to_visit = self._window_groups
                looked_up_window = looked_up_window or g.window_chunks is not None
                hit = new_hit
        return None if defer else hit

    def _hit_keys(self, req: RequestState, start: int, end: int) -> list[OffloadKey]:
        return [
            key for g in self._groups for key in self._chunk_keys_of_blocks(req, g, *self._load_range(g, start, end))
        ]
