"""Secondary tiers below the host pool (disk, Valkey) with vLLM 0.33's tiering semantics.

``Tiering`` (scheduler side) cascades stored chunks and promotes tier hits; ``TierWorker`` (one per
rank) runs the tier jobs on the rank's host rows; ``FsTier`` and ``ValkeyTier`` are the built-in tiers, both
on :class:`~kvoffload.tiers.TierBase`; the config types are generated from the schema (1.3).

Importing this package loads neither torch, valkey nor pyzmq: the config types, namespaces, backpressure, the
tier protocol and base, the disk tier and the config helpers are light; ``Tiering``, ``TierStatsRow`` and
``start_embedded_servers`` (valkey, through the embedded server), ``EmbeddedValkey`` and ``ValkeyTier``
(valkey) and ``TierWorker`` (torch) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
from kvoffload._lazy import lazy_getattr as _lazy_getattr
from kvoffload.tiers._backpressure import BackpressureSettings, EMABackpressureDetector, resolve_backpressure
from kvoffload.tiers._base import SecondaryTier, TierBase, TierIOResult, TierStats
from kvoffload.tiers._config import open_tier, tier_from_cli, tiering_config_from_extra
from kvoffload.tiers._fs import FsTier
from kvoffload.tiers._namespace import Namespace, namespace_for, namespaces_for_all_ranks

if TYPE_CHECKING:
    from kvoffload.tiers._cascade import Tiering, TierStatsRow, start_embedded_servers
    from kvoffload.tiers._valkey import EmbeddedValkey, ValkeyTier
    from kvoffload.tiers._worker import TierWorker

_LAZY = {
    "Tiering": "kvoffload.tiers._cascade",
    "TierStatsRow": "kvoffload.tiers._cascade",
    "start_embedded_servers": "kvoffload.tiers._cascade",
    "EmbeddedValkey": "kvoffload.tiers._valkey",
    "ValkeyTier": "kvoffload.tiers._valkey",
    "TierWorker": "kvoffload.tiers._worker",
}


__getattr__ = _lazy_getattr(__name__, _LAZY, globals())


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
    "Tiering",
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
