"""The offload scheduler's lookups: the longest loadable hit of a request over all its groups, pinned until
its blocks are allocated, and the reason for every wanted chunk it does not load."""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import replace

from kvoffload._generated import MissReason
from kvoffload._ints import cdiv
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager import LookupResult
from kvoffload.offload.scheduler._misses import GroupKeys, explain_lookup, primary_reason
from kvoffload.offload.scheduler._scan import prefix_run, sliding_window_lookup
from kvoffload.offload.scheduler._state import RequestState, SchedulerBook

__all__ = ["Lookups"]

_TIER_COULD_HOLD = (MissReason.NEVER_STORED, MissReason.EVICTED)
"""Pool reasons of a miss that a tier might have served (another engine stored it, or it was cascaded first)."""


class Lookups:
    """The lookup part of the offload scheduler: which chunks a request can load now, and why others miss.

    ``max_recompute_pending_tokens`` (0: off) bounds the wait for chunks whose store is in flight: when the run
    from the first pending chunk to the end of a full-attention hit is at most that many tokens (whole chunks),
    the hit is cut before it and those tokens are recomputed (vLLM PR 57959). ``sync_load_budget_bytes`` (0:
    off) is vLLM 0.33's per-step budget of hits loaded inside the step: a hit of ``n`` tokens costs ``n`` times
    the KV bytes of one token on one worker; it loads in-step while the step's budget covers it.
    """

    def __init__(
        self, book: SchedulerBook, *, max_recompute_pending_tokens: int = 0, sync_load_budget_bytes: int = 0
    ) -> None:
        self._book = book
        self._stats = book.stats
        self._manager = book.manager
        self._recompute_pending = max_recompute_pending_tokens
        self._sync_budget = sync_load_budget_bytes
        self._sync_left = sync_load_budget_bytes
        # KV bytes of one token on one worker: a block's bytes over its tokens (the smallest block of the groups:
        # an upper bound when the groups' blocks differ).
        self._block_bytes = book.config.worker_kv_bytes_per_block
        self._tokens_per_block = min(g.tokens_per_block for g in book.groups)

    def new_step(self) -> None:
        """A step plan was built: the next step's sync-load budget starts full."""
        self._sync_left = self._sync_budget

    def lookup(
        self,
        req_id: str,
        num_computed_tokens: int,
        unavailable: Set[OffloadKey] = frozenset(),
        early: Set[OffloadKey] = frozenset(),
    ) -> int | None:
        """The host-pool lookup of :meth:`OffloadScheduler.lookup`; ``unavailable``: host misses a tier could not
        be asked for (they miss as ``tier_unavailable``); ``early``: pending chunks whose write this step's plan
        runs before its loads (a chained promotion: hits, pinned early). Counts a final answer as a lookup, None
        as a re-ask."""
        req = self._book.request(req_id)
        self._book.release_pins(req)
        req.misses = ()
        req.sync_load = False
        if req.jobs:
            self._stats.lookups_deferred += 1
            return None
        max_hit = req.num_tokens - 1
        if req.max_load_tokens is not None:
            max_hit = min(max_hit, num_computed_tokens + req.max_load_tokens)
        align = self._book.mamba_align
        if align is not None:  # an align-mode Mamba group: hits end on its chunk boundaries (vLLM 0.33 §5.5)
            max_hit = max_hit // align * align
        hit, recomputes_pending = self._lookup_groups(req, num_computed_tokens, max_hit, early)
        if hit is None:
            self._stats.lookups_deferred += 1
            self._explain(req, num_computed_tokens, num_computed_tokens, pending_only=True)
            return None
        if recomputes_pending:
            self._stats.pending_recomputes += 1
        if hit <= 0:
            self._stats.lookups += 1
            self._stats.lookup_misses += 1
            self._explain(req, num_computed_tokens, num_computed_tokens, unavailable=unavailable)
            return 0
        max_hit = num_computed_tokens + hit
        # Chunks another request is loading right now are hits too: the host copy is ready and stays pinned by
        # both loads, so this request loads them into its own blocks at once instead of waiting for the other
        # load to land (vLLM 0.33 waits here: the convoy of vLLM issue 44294). See Transfers: shared loads.
        keys = self._hit_keys(req, num_computed_tokens, max_hit)
        self._manager.prepare_load(keys, request_id=req.req_id, pending_ok=early)  # the policy sees the access
        req.pinned = keys
        req.hit_start, req.hit_end = num_computed_tokens, max_hit
        req.sync_load = self._fits_sync_budget(req, hit)
        self._stats.lookups += 1
        self._stats.lookup_hits += 1
        self._explain(req, num_computed_tokens, max_hit, unavailable=unavailable)
        return max_hit - num_computed_tokens

    def _fits_sync_budget(self, req: RequestState, hit: int) -> bool:
        """Whether a hit of ``hit`` tokens loads inside this step (vLLM 0.33's rule); takes it from the budget."""
        if not self._sync_budget or req.hit_end >= req.num_tokens:  # at least one token left to compute
            return False
        cost = cdiv(hit * self._block_bytes, self._tokens_per_block)
        if cost > self._sync_left:
            return False
        self._sync_left -= cost
        return True

    def _explain(
        self,
        req: RequestState,
        num_computed: int,
        hit_end: int,
        *,
        pending_only: bool = False,
        unavailable: Set[OffloadKey] = frozenset(),
    ) -> None:
        """Record why the wanted chunks outside ``[num_computed, hit_end)`` were not loaded (stats + per request).

        A chunk the pool never held or evicted, that a tier could not be asked for (``unavailable``), misses as
        ``tier_unavailable``."""
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
        elif unavailable:
            misses = [
                replace(m, reason=MissReason.TIER_UNAVAILABLE)
                if m.reason in _TIER_COULD_HOLD and m.key in unavailable
                else m
                for m in misses
            ]
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

    def _lookup_groups(
        self, req: RequestState, num_computed: int, max_hit: int, early: Set[OffloadKey] = frozenset()
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed`` that every group can load, or None to defer (vLLM's ``_lookup``), and
        whether pending chunks were cut off to be recomputed (``max_recompute_pending_tokens``).

        Groups are visited full attention first, then sliding windows by decreasing window; each tightens
        ``max_hit`` to its chunk granularity. A group that defers does not stop the others (a later group
        may still answer "no hit"); when a later group shrinks the hit, a deferral is re-checked by
        visiting every group again, and earlier sliding windows are re-checked at the new end.
        Unlike vLLM, hit ends stay chunk-aligned (the scan ends at the last chunk wholly below ``max_hit``).

        EAGLE groups (vLLM 0.33 §5.5) scan one chunk past the hit end (a window group wants a window one chunk
        longer) and drop the last chunk they found, so the hit stops one chunk before the end of what the
        group holds. A group drops once per hit end: re-checked at an end it or another EAGLE group set, it
        scans up to that end only; when a non-EAGLE group moves the end down, each EAGLE group that is visited
        again drops a chunk at the new end (vLLM's convergence: the groups re-run until the hit settles).
        """
        lookup = self._manager.lookup
        if early:
            base = lookup

            def lookup(key: OffloadKey) -> LookupResult:
                result = base(key)
                return LookupResult.HIT if result is LookupResult.HIT_PENDING and key in early else result

        hit = 0
        defer = False
        cuts: dict[int, bool] = {}  # group index -> its last scan cut pending chunks off
        dropped: set[int] = set()  # EAGLE groups that dropped their extra chunk at the current hit end
        to_visit = self._book.lookup_order
        while to_visit:
            looked_up_window = False
            visiting, to_visit = to_visit, ()
            for g in visiting:
                tpc = g.tokens_per_chunk
                keys = req.keys[g.index]
                max_hit = min(max_hit, len(keys) * tpc)
                if max_hit - num_computed < tpc:
                    return 0, any(cuts.values())
                start = num_computed // tpc
                end = max_hit // tpc
                # An EAGLE group asks for one chunk more than the hit may reach, then drops the last chunk of
                # what it found: its trailing chunk is recomputed (vLLM 0.33 §5.5).
                extra = g.eagle and g.index not in dropped
                scanned = keys[start : min(end + 1, len(keys)) if extra else end]
                chunks: int | None
                if g.window_chunks is None:
                    chunks, cuts[g.index] = self._prefix_chunks(lookup, scanned, tpc)
                else:
                    chunks = sliding_window_lookup(lookup, scanned, max(1, g.window_chunks) + int(extra))
                if chunks == 0:
                    return 0, any(cuts.values())
                if chunks is None:
                    defer = True
                else:
                    if extra:
                        chunks -= 1
                        dropped.add(g.index)
                    max_hit = min(max_hit, (start + chunks) * tpc)
                new_hit = max_hit - num_computed
                if new_hit < tpc:
                    return 0, any(cuts.values())
                if new_hit < hit:
                    if not g.eagle:  # a new end no EAGLE group dropped a chunk at: each drops one again
                        dropped.clear()
                    if defer:
                        defer = False
                        to_visit = self._book.lookup_order
                    elif looked_up_window and not to_visit:
                        to_visit = self._book.window_groups
                looked_up_window = looked_up_window or g.window_chunks is not None
                hit = new_hit
        return (None, False) if defer else (hit, any(cuts.values()))

    def _prefix_chunks(
        self, lookup: Callable[[OffloadKey], LookupResult], keys: Sequence[OffloadKey], tokens_per_chunk: int
    ) -> tuple[int | None, bool]:
        """A full-attention group's hit in chunks (None: defer), and whether pending chunks were cut off.

        vLLM 0.33 waits while any chunk of the hit is still being stored; with ``max_recompute_pending_tokens``
        a short enough pending run (first pending chunk to the end of the hit) is cut off and recomputed."""
        chunks, first_pending, retry = prefix_run(lookup, keys)
        if retry:
            return None, False
        if first_pending is None:
            return chunks, False
        if (chunks - first_pending) * tokens_per_chunk <= self._recompute_pending:
            return first_pending, True
        return None, False

    def _hit_keys(self, req: RequestState, start: int, end: int) -> list[OffloadKey]:
        return [
            key
            for g in self._book.groups
            for key in self._book.chunk_keys_of_blocks(req, g, *self._book.load_range(g, start, end))
        ]
