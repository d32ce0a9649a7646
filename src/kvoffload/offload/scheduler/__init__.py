"""The offload scheduler: per-request lookup, load and store decisions, one ``StepPlan`` per engine step.

Scheduler side, torch-free. :class:`OffloadScheduler` composes its parts: the request and job book
(``_state``), lookups (``_lookups``, on the per-group scans of ``_scan`` and the miss reasons of ``_misses``),
transfer planning (``_transfers``) and report handling (``_reports``). Features below the host pool (tiers)
plug in through :class:`SchedulerExtension`; :class:`TierFilter` (``_tier_filter``) says which of them a request's
loads may come from.
"""

from kvoffload.offload._direction import Direction
from kvoffload.offload.scheduler._extension import LookupAdvice, SchedulerExtension
from kvoffload.offload.scheduler._misses import ChunkMiss
from kvoffload.offload.scheduler._results import ExtensionFigures, ReportOutcome, SchedulerStats, TierStatsRow
from kvoffload.offload.scheduler._scan import maximal_prefix_lookup, sliding_window_lookup
from kvoffload.offload.scheduler._scheduler import OffloadScheduler
from kvoffload.offload.scheduler._tier_filter import Locality, TierFilter, TierMatcher, parse_load_tiers

__all__ = [
    "ChunkMiss",
    "Direction",
    "ExtensionFigures",
    "Locality",
    "LookupAdvice",
    "OffloadScheduler",
    "ReportOutcome",
    "SchedulerExtension",
    "SchedulerStats",
    "TierFilter",
    "TierMatcher",
    "TierStatsRow",
    "maximal_prefix_lookup",
    "parse_load_tiers",
    "sliding_window_lookup",
]
