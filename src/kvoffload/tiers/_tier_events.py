"""KV events of the tiers' records: what a KV-aware router needs to know is on disk or in Valkey (medium STORAGE).

A tier whose config sets ``enable_kv_events`` (vLLM's key of the fs tier; default False) announces its records as
the host pool announces its chunks: a chunk whose cascade completed on every rank is ``stored`` on ``STORAGE``, and
a record a worker found bad (damaged, of another namespace, not authenticated) and deleted is ``removed``. The
scheduler's :meth:`~kvoffload.offload.scheduler.OffloadScheduler.take_events` publishes them after the host
pool's. Records a tier drops on its own are not announced: a tier's ``max_bytes`` evictions happen in the
workers' instances, which report how much they hold but not which keys went, and a Valkey server's LRU evictions in
the server.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload._generated import Medium, SecondaryTierConfig
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager import OffloadEvent
from kvoffload.tiers._registry import BuiltinTierConfig

__all__ = ["TierEvents"]


class TierEvents:
    """The events of the tiers that announce their records, collected until :meth:`take`."""

    def __init__(self, configs: Sequence[SecondaryTierConfig]) -> None:
        self.enabled = tuple(isinstance(c, BuiltinTierConfig) and c.enable_kv_events for c in configs)
        self._events: list[OffloadEvent] = []

    def stored(self, tier: int, keys: Sequence[OffloadKey]) -> None:
        """``keys`` now have a record in tier ``tier`` (in every rank's namespace)."""
        if keys and self.enabled[tier]:
            self._events.append(OffloadEvent(tuple(keys), False, Medium.STORAGE))

    def removed(self, tier: int, keys: Sequence[OffloadKey]) -> None:
        """The records of ``keys`` in tier ``tier`` were deleted."""
        if keys and self.enabled[tier]:
            self._events.append(OffloadEvent(tuple(keys), True, Medium.STORAGE))

    def take(self) -> list[OffloadEvent]:
        """The events since the last call."""
        events, self._events = self._events, []
        return events
