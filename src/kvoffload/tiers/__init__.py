"""Secondary tiers below the host pool (disk, Valkey, object store) with vLLM 0.33's tiering semantics.

``Tiering`` (scheduler side) cascades stored chunks and promotes tier hits; ``TierWorker`` (one per
rank) runs the tier jobs on the rank's host rows; ``FsTier``, ``ValkeyTier`` and ``ObjTier`` (S3) are the
built-in tiers, all on :class:`~kvoffload.tiers.TierBase`; the config types are generated from the schema;
``compare_with_raw`` times a tier against its medium moving the same records without it.

Tier types are registered by name (:func:`register_tier_type`), drop policies are classes (:class:`DropPolicy`,
:func:`register_drop_policy`), and a request's ``kv_load_tiers`` (:class:`TierFilter`) says which tiers its loads may
come from.

Importing this package loads neither torch, valkey, obstore nor pyzmq: the config types, namespaces, backpressure and
drop policies, the tier protocol, base and registry, the disk tier and the config helpers are light; ``Tiering`` and
``TierStatsRow``, ``start_embedded_servers``, ``EmbeddedValkey``, ``ValkeyTier`` and the raw baselines (valkey),
``ObjTier`` (obstore) and ``TierWorker`` (torch) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._generated import (
    BackpressureConfig,
    CustomTierConfig,
    FsTierConfig,
    ObjStoreConfig,
    ObjTierConfig,
    SecondaryTierConfig,
    TieringConfig,
    TierJob,
    TierJobResult,
    ValkeyTierConfig,
)
from kvoffload._lazy import lazy_getattr as _lazy_getattr
from kvoffload.offload.scheduler import Locality, TierFilter, TierMatcher, parse_load_tiers
from kvoffload.tiers._backpressure import BackpressureSettings, EMABackpressureDetector, resolve_backpressure
from kvoffload.tiers._base import SecondaryTier, TierBase, TierIOResult, TierStats
from kvoffload.tiers._config import open_tier, tier_from_cli, tiering_config_from_extra
from kvoffload.tiers._fs import FsTier
from kvoffload.tiers._namespace import Namespace, namespace_for, namespaces_for_all_ranks
from kvoffload.tiers._policies import DropPolicy, DropStorePolicy, ThrottledDropPolicy, register_drop_policy
from kvoffload.tiers._registry import register_tier_type

if TYPE_CHECKING:
    from kvoffload.tiers._cascade import Tiering, TierStatsRow
    from kvoffload.tiers._embedded import EmbeddedValkey, start_embedded_servers
    from kvoffload.tiers._obj import ObjTier
    from kvoffload.tiers._raw import RawThroughput, TierVsRaw, compare_with_raw, raw_throughput
    from kvoffload.tiers._valkey import ValkeyTier
    from kvoffload.tiers._worker import TierWorker

_LAZY = {
    "Tiering": "kvoffload.tiers._cascade",
    "TierStatsRow": "kvoffload.tiers._cascade",
    "start_embedded_servers": "kvoffload.tiers._embedded",
    "EmbeddedValkey": "kvoffload.tiers._embedded",
    "ValkeyTier": "kvoffload.tiers._valkey",
    "ObjTier": "kvoffload.tiers._obj",
    "TierWorker": "kvoffload.tiers._worker",
    "RawThroughput": "kvoffload.tiers._raw",
    "raw_throughput": "kvoffload.tiers._raw",
    "compare_with_raw": "kvoffload.tiers._raw",
    "TierVsRaw": "kvoffload.tiers._raw",
}


__getattr__ = _lazy_getattr(__name__, _LAZY, globals())


__all__ = [
    "BackpressureConfig",
    "BackpressureSettings",
    "CustomTierConfig",
    "DropPolicy",
    "DropStorePolicy",
    "EMABackpressureDetector",
    "EmbeddedValkey",
    "FsTier",
    "FsTierConfig",
    "Locality",
    "Namespace",
    "ObjStoreConfig",
    "ObjTier",
    "ObjTierConfig",
    "RawThroughput",
    "SecondaryTier",
    "SecondaryTierConfig",
    "ThrottledDropPolicy",
    "TierBase",
    "TierFilter",
    "TierIOResult",
    "TierJob",
    "TierJobResult",
    "TierMatcher",
    "TierStats",
    "TierStatsRow",
    "TierVsRaw",
    "TierWorker",
    "Tiering",
    "TieringConfig",
    "ValkeyTier",
    "ValkeyTierConfig",
    "compare_with_raw",
    "namespace_for",
    "namespaces_for_all_ranks",
    "open_tier",
    "parse_load_tiers",
    "raw_throughput",
    "register_drop_policy",
    "register_tier_type",
    "resolve_backpressure",
    "start_embedded_servers",
    "tier_from_cli",
    "tiering_config_from_extra",
]
