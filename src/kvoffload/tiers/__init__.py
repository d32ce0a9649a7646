"""Secondary tiers below the host pool (disk, Valkey) with vLLM 0.33's tiering semantics.

``TieredScheduler`` (scheduler side) cascades stored chunks and promotes tier hits; ``TierWorker`` (one per
rank) runs the tier jobs on the rank's host rows; ``FsTier`` and ``ValkeyTier`` are the built-in tiers, both
on :class:`~kvoffload.tiers.TierBase`; the config types are generated from the schema (1.3).
"""

from __future__ import annotations

from kvoffload._generated import (
    BackpressureConfig,
    CustomTierConfig,
    FsTierConfig,
    SecondaryTierConfig,
    TieringConfig,
    TierJob,
    TierJobResult,
    ValkeyTierConfig,
)
from kvoffload.tiers._backpressure import BackpressureSettings, EMABackpressureDetector, resolve_backpressure
from kvoffload.tiers._base import SecondaryTier, TierBase, TierIOResult, TierStats
from kvoffload.tiers._cascade import TieredScheduler, TierStatsRow, start_embedded_servers
from kvoffload.tiers._config import open_tier, tier_from_cli, tiering_config_from_extra
from kvoffload.tiers._fs import FsTier
from kvoffload.tiers._namespace import Namespace, namespace_for, namespaces_for_all_ranks
from kvoffload.tiers._valkey import EmbeddedValkey, ValkeyTier
from kvoffload.tiers._worker import TierWorker

__all__ = [
    "BackpressureConfig",
    "BackpressureSettings",
    "CustomTierConfig",
    "EMABackpressureDetector",
    "EmbeddedValkey",
    "FsTier",
    "FsTierConfig",
    "Namespace",
    "SecondaryTier",
    "SecondaryTierConfig",
    "TierBase",
    "TierIOResult",
    "TierJob",
    "TierJobResult",
    "TierStats",
    "TierStatsRow",
    "TierWorker",
    "TieredScheduler",
    "TieringConfig",
    "ValkeyTier",
    "ValkeyTierConfig",
    "namespace_for",
    "namespaces_for_all_ranks",
    "open_tier",
    "resolve_backpressure",
    "start_embedded_servers",
    "tier_from_cli",
    "tiering_config_from_extra",
]
