"""What each tier did for the scheduler, and whether it is available as the scheduler sees it.

A tier goes down when a lookup could not ask it (a fault, a back-off, a query hung past
``tier_lookup_timeout_s``) and comes back when every rank's instance answered again. Each change is logged once
for the tier (one WARNING going down, one INFO coming back), never once per rank namespace or per failed
operation, and counted in its :class:`TierStatsRow` (``outages``, ``available``), which the scheduler metrics read.
"""

from __future__ import annotations

import logging
import time

from kvoffload._generated import FsTierConfig, ObjTierConfig, SecondaryTierConfig, TieringConfig, ValkeyTierConfig
from kvoffload.errors import TierUnusableError
from kvoffload.offload.scheduler import TierStatsRow
from kvoffload.tiers._base import SecondaryTier, TierBase
from kvoffload.tiers._record import SECRET_ENV, record_secret

__all__ = ["TierHealth", "TierStatsRow", "shared_without_secret", "tier_is_healthy", "tier_type", "unusable_reason"]


def tier_type(config: SecondaryTierConfig) -> str:
    """The kind of a tier config: ``fs``, ``valkey``, ``obj``, the name a custom tier was registered under, or its class
    name (vLLM names an out-of-tree tier after its ``type``, the class name)."""
    if isinstance(config, FsTierConfig):
        return "fs"
    if isinstance(config, ValkeyTierConfig):
        return "valkey"
    if isinstance(config, ObjTierConfig):
        return "obj"
    return config.tier_type or config.class_name


def unusable_reason(tier: SecondaryTier) -> str | None:
    """Why ``tier`` cannot be used now (None: it can): a built-in tier probes its medium, any other tier is
    asked whether it is available."""
    if isinstance(tier, TierBase):
        return tier.probe()
    return None if tier.available else "the tier reports itself unavailable"


def shared_without_secret(config: SecondaryTierConfig) -> bool:
    """Whether ``config`` is a tier others can write (a Valkey server that is not this engine's private
    embedded one) while this process has no record secret: its records are then not authenticated."""
    if record_secret() is not None:
        return False
    if isinstance(config, ObjTierConfig):
        return True
    if not isinstance(config, ValkeyTierConfig):
        return False
    from kvoffload.tiers._embedded import is_embedded_url

    return not (config.url and is_embedded_url(config.url))


def tier_is_healthy(tier: SecondaryTier) -> bool:
    """The cheap check of the lookup path (no IO): a built-in tier's :meth:`TierBase.is_healthy`, any other tier's
    ``available``."""
    return tier.is_healthy() if isinstance(tier, TierBase) else tier.available


class TierHealth:
    """The availability of each tier in ``rows`` (config order), changed and logged on the scheduler's thread."""

    def __init__(self, rows: list[TierStatsRow], log: logging.Logger) -> None:
        self._rows = rows
        self._log = log
        self._down_since = [0.0] * len(rows)

    def check_at_start(self, tiering: TieringConfig, lookup_tiers: list[list[SecondaryTier]]) -> list[str | None]:
        """Refuse to start on a tier that cannot be used now (a mistyped path, a server that is not there), in
        one line naming it (:class:`TierUnusableError`, a ConfigError and an OSError as vLLM raises), unless
        ``start_degraded`` asks to start anyway (a WARNING; it is retried later).
        A shared tier without a record secret gets a WARNING too (see :func:`shared_without_secret`).
        Returns why each tier (config order) was unusable at start, None for a usable one."""
        reasons: list[str | None] = []
        for i, (config, per_rank) in enumerate(zip(tiering.secondary_tiers, lookup_tiers, strict=True)):
            reason = unusable_reason(per_rank[0]) if per_rank else None
            reasons.append(reason)
            if reason is not None:
                what = f"secondary_tiers[{i}] ({tier_type(config)}) is unusable: {reason}"
                if not tiering.start_degraded:
                    raise TierUnusableError(f"{what} (set start_degraded to start without it)")
                self._log.warning("%s; starting degraded (start_degraded), it is retried later", what)
                self.down(i, reason, logged=True)
            if shared_without_secret(config):
                self._log.warning(
                    "kvoffload: secondary_tiers[%d] (%s) is shared and its records are not authenticated: %s is "
                    "unset, so whoever can write the server can plant records this engine loads; set the same "
                    "secret in every process that reads or writes the tier",
                    i,
                    tier_type(config),
                    SECRET_ENV,
                )
        return reasons

    def down(self, tier: int, reason: str, *, logged: bool = False) -> None:
        """Tier ``tier`` could not be asked for ``reason``: a WARNING and an outage when it was available.

        ``logged``: the caller already logged it (the start-up line of ``start_degraded``).
        """
        row = self._rows[tier]
        row.unavailable_reason = reason
        if not row.available:
            return
        row.available = False
        row.outages += 1
        self._down_since[tier] = time.monotonic()
        if not logged:
            self._log.warning(
                "kvoffload: secondary_tiers[%d] (%s) is unavailable: %s; lookups miss it (tier_unavailable) "
                "until it answers again",
                tier,
                row.name,
                reason,
            )

    def up(self, tier: int) -> None:
        """Every rank's instance of tier ``tier`` answered: an INFO when it was down."""
        row = self._rows[tier]
        if row.available:
            return
        row.available = True
        self._log.info(
            "kvoffload: secondary_tiers[%d] (%s) is available again after %.1f s",
            tier,
            row.name,
            time.monotonic() - self._down_since[tier],
        )

    def apply(self, faults: tuple[str | None, ...]) -> None:
        """A query's outcome per tier: why it could not be asked, or None when it answered."""
        for tier, fault in enumerate(faults):
            if fault is None:
                self.up(tier)
            else:
                self.down(tier, fault)

    def is_down(self, tier: int) -> bool:
        """Whether tier ``tier`` is unavailable as the scheduler sees it."""
        return not self._rows[tier].available

    def any_down(self) -> bool:
        """Whether some tier is unavailable."""
        return any(not row.available for row in self._rows)
