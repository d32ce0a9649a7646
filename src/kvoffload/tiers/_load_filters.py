"""Which tiers each request may load from (``kv_load_tiers``), and each tier's medium and locality.

The built-in tiers are ``STORAGE``: a disk tier is ``LOCAL``, a Valkey tier ``REMOTE`` (a server on the network),
unless their config's ``locality`` (vLLM's key) says otherwise.
An out-of-tree tier declares its place with class attributes ``medium`` (a :class:`~kvoffload.Medium`) and
``locality`` (a :class:`~kvoffload.offload.scheduler.Locality`), as vLLM's tiers do; one that does not is matched by
any filter entry that allows some tier (vLLM's wildcard for an unknown medium or locality).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload._generated import FsTierConfig, Medium, ObjTierConfig, SecondaryTierConfig, ValkeyTierConfig
from kvoffload.errors import ConfigError
from kvoffload.offload.scheduler import Locality, TierFilter
from kvoffload.tiers._registry import BuiltinTierConfig

__all__ = ["LoadFilters", "configured_locality", "tier_place"]


def configured_locality(config: SecondaryTierConfig) -> Locality | None:
    """The ``locality`` a built-in tier's config sets (None: unset, or an out-of-tree tier)."""
    if isinstance(config, BuiltinTierConfig) and config.locality is not None:
        if config.locality.upper() not in Locality.__members__:
            raise ConfigError(f"tier locality={config.locality!r} is not LOCAL or REMOTE")
        return Locality(config.locality.upper())
    return None


def tier_place(config: SecondaryTierConfig, tier: object) -> tuple[Medium | None, Locality | None]:
    """The medium and locality of the tier ``config`` describes (``tier``: an instance of it)."""
    if isinstance(config, FsTierConfig):
        return Medium.STORAGE, configured_locality(config) or Locality.LOCAL
    if isinstance(config, ValkeyTierConfig | ObjTierConfig):
        return Medium.STORAGE, configured_locality(config) or Locality.REMOTE
    medium, locality = getattr(tier, "medium", None), getattr(tier, "locality", None)
    return (
        medium if isinstance(medium, Medium) else None,
        locality if isinstance(locality, Locality) else None,
    )


class LoadFilters:
    """Per request, which of the tiers (config order) its loads may come from; every tier unless told."""

    def __init__(self, places: Sequence[tuple[Medium | None, Locality | None]]) -> None:
        self.places = tuple(places)
        self._all = tuple(True for _ in self.places)
        self._allowed: dict[str, tuple[bool, ...]] = {}

    def set(self, req_id: str, load_tiers: TierFilter) -> None:
        """The request's loads may come from the tiers ``load_tiers`` allows."""
        allowed = tuple(load_tiers.allows(medium, locality) for medium, locality in self.places)
        if allowed == self._all:
            self._allowed.pop(req_id, None)
        else:
            self._allowed[req_id] = allowed

    def allowed(self, req_id: str) -> tuple[bool, ...]:
        """Per tier, whether the request may load from it."""
        return self._allowed.get(req_id, self._all)

    def forget(self, req_id: str) -> None:
        """The request finished."""
        self._allowed.pop(req_id, None)
