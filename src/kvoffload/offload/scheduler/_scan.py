"""The two per-group chunk scans of a scheduler lookup (maximal prefix, sliding window), as vLLM 0.33 scans.

Both take the manager's ``lookup`` and the group's chunk keys from the first chunk not computed locally,
and return a number of chunks (from that first chunk) or ``None`` to ask again later. ``HIT_PENDING``
(present, write in flight) counts as present but defers; any other answer that is neither ``HIT`` nor
``MISS`` (a tier's ``RETRY``: location not known yet) defers without counting. Scans keep asking the
manager past a deferring answer, so that a tiered manager can start every lookup it needs at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager import LookupResult

__all__ = ["maximal_prefix_lookup", "prefix_run", "sliding_window_lookup"]

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_HIT_PENDING = LookupResult.HIT_PENDING

Lookup = Callable[[OffloadKey], LookupResult]


def maximal_prefix_lookup(lookup: Lookup, keys: Sequence[OffloadKey]) -> int | None:
    """Chunks present from the start of ``keys`` up to the first MISS, or None if any answer deferred.

    The scan stops at the first MISS only: it goes on past HIT_PENDING (counted) and RETRY (not counted).
    """
    count, first_pending, retry = prefix_run(lookup, keys)
    return None if retry or first_pending is not None else count


def prefix_run(lookup: Lookup, keys: Sequence[OffloadKey]) -> tuple[int, int | None, bool]:
    """The scan of :func:`maximal_prefix_lookup`, unresolved: ``(chunks, first_pending, retry)``.

    ``chunks`` counts the present chunks (HIT or HIT_PENDING) before the first MISS; ``first_pending`` is the
    index of the first HIT_PENDING among them (None: none); ``retry`` is True when some answer was neither.
    """
    count = 0
    first_pending: int | None = None
    retry = False
    for key in keys:
        result = lookup(key)
        if result is _HIT:
            count += 1
        elif result is _HIT_PENDING:
            if first_pending is None:
                first_pending = count
            count += 1
        elif result is _MISS:
            break
        else:
            retry = True
    return count, first_pending, retry


def sliding_window_lookup(
    lookup: Lookup, keys: Sequence[OffloadKey], window: int, initial_window: int | None = None
) -> int | None:
    """End (in ``keys``) of the rightmost run of ``window`` present chunks, scanning from the right.

    The run that ends at the right edge must be ``initial_window`` chunks long (default ``window``; one more
    when the hit end is not chunk-aligned). A MISS or RETRY restarts the run, and a HIT_PENDING defers only
    if it is inside the run that is returned: a pending chunk beyond a gap does not hold back a complete
    window to its left. A RETRY anywhere defers. Without a complete window the run that reaches the left
    edge is returned (0 when the first key is missing). None means ask again later.
    """
    need = window if initial_window is None else initial_window
    run = 0
    pending = False
    retry = False
    for index in range(len(keys) - 1, -1, -1):
        result = lookup(keys[index])
        if result is _HIT or result is _HIT_PENDING:
            run += 1
            pending = pending or result is _HIT_PENDING
            if run == need:
                return None if pending or retry else index + run
        else:
            retry = retry or result is not _MISS
            run = 0
            pending = False
            need = window
    return None if pending or retry else run
