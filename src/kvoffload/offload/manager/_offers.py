"""What the manager remembers about offers and departures: the store-threshold tracker, each request's store
misses, and why keys left the pool (so a later miss can say so)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload._generated import MissReason
from kvoffload.offload.keys import OffloadKey

__all__ = ["DepartureLog", "OfferTracker"]


class OfferTracker:
    """vLLM 0.33.0's store threshold: keys are stored only once offered ``store_threshold`` times (``>= 2``).

    Offers are counted in an LRU tracker of ``max_tracker_size`` keys. Also remembers, per request, which keys
    the policy already saw as store misses (vLLM observes each once per request context).
    """

    __slots__ = ("_counts", "_max_tracker_size", "_store_misses", "skipped", "threshold")

    def __init__(self, store_threshold: int, max_tracker_size: int) -> None:
        self.threshold = store_threshold
        self._max_tracker_size = max_tracker_size
        self._counts: OrderedDict[OffloadKey, int] | None = OrderedDict() if store_threshold >= 2 else None
        self._store_misses: dict[str, set[OffloadKey]] = {}  # request id -> keys already reported
        self.skipped = 0
        """Offered keys left unstored because they were below the threshold, since the last take."""

    @property
    def counts(self) -> dict[OffloadKey, int]:
        """A copy of the offer counts (oldest first); empty when the threshold is off."""
        return dict(self._counts) if self._counts is not None else {}

    def filter(self, keys: Sequence[OffloadKey], to_store: list[OffloadKey]) -> list[OffloadKey]:
        """Count this offer of ``keys``; the keys of ``to_store`` that reached the threshold."""
        counts = self._counts
        if counts is None:
            return to_store
        self._record(keys, counts)
        if not to_store:
            return to_store
        threshold = self.threshold
        get = counts.get
        kept = [key for key in to_store if get(key, 0) >= threshold]
        self.skipped += len(to_store) - len(kept)
        return kept

    def _record(self, keys: Sequence[OffloadKey], counts: OrderedDict[OffloadKey, int]) -> None:
        """Count one offer of each key in the tracker without dropping offered keys.

        Known keys move to the recent end; a new key evicts the oldest tracked key that is not part of
        this offer, or is not tracked when only offered keys remain (vLLM 0.33.0 ``_record_accesses``).
        """
        protected: set[OffloadKey] = set()
        move = counts.move_to_end
        for key in keys:
            count = counts.get(key)
            if count is not None:
                move(key)
                counts[key] = count + 1
                protected.add(key)
        unprotected = len(counts) - len(protected)
        limit = self._max_tracker_size
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= limit:
                if unprotected <= 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    def below_threshold(self, key: OffloadKey) -> bool:
        """Whether ``key`` was offered, but fewer times than the threshold."""
        counts = self._counts
        return counts is not None and 0 < counts.get(key, 0) < self.threshold

    def new_store_misses(self, request_id: str | None, keys: list[OffloadKey]) -> list[OffloadKey]:
        """The keys of ``keys`` this request has not reported as store misses yet (all without a request)."""
        if request_id is None:
            return keys
        seen = self._store_misses.get(request_id)
        if seen is None:
            seen = self._store_misses[request_id] = set()
        new = [key for key in keys if key not in seen]
        seen.update(new)
        return new

    def forget_request(self, request_id: str) -> None:
        self._store_misses.pop(request_id, None)

    def forget_requests(self) -> None:
        self._store_misses.clear()

    def take_skipped(self) -> int:
        skipped, self.skipped = self.skipped, 0
        return skipped


class DepartureLog:
    """Why keys left the pool (evicted, store failed, corrupt, ...), the ``max_departures`` most recent ones."""

    __slots__ = ("_departed", "_max")

    def __init__(self, max_departures: int) -> None:
        self._max = max_departures
        self._departed: OrderedDict[OffloadKey, MissReason] = OrderedDict()

    def remember(self, keys: Sequence[OffloadKey], reason: MissReason) -> None:
        """Record why ``keys`` left the pool (or are unavailable), forgetting the oldest beyond the bound."""
        departed = self._departed
        again = departed.keys() & keys
        if again:  # keys that left before move to the recent end, in order
            for key in [key for key in keys if key in again]:
                departed.move_to_end(key)
        departed.update(dict.fromkeys(keys, reason))
        while len(departed) > self._max:
            departed.popitem(last=False)

    def reason(self, key: OffloadKey) -> MissReason | None:
        return self._departed.get(key)
