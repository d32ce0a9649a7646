"""Which tiers a request's loads may come from: vLLM 0.33's per-request ``kv_load_tiers`` (``TierFilter``).

``kv_transfer_params["kv_load_tiers"]`` is a list of ``{"medium": "cpu" | "storage", "locality": "local" |
"remote"}`` (case-insensitive; a missing key matches any value). A tier is allowed when some entry matches its
medium and locality. ``[]`` allows none; a list whose entries are all invalid allows all (:data:`TierFilter.ALL`),
as does a value that is not a list (both with a warning). As in vLLM, the filter applies to the tiers below the
host pool: a chunk already in the host pool is loaded whatever the filter says, and a request whose filter
allows no tier is never promoted from one (it loads host hits only).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from kvoffload._generated import Medium

__all__ = ["Locality", "TierFilter", "TierMatcher", "parse_load_tiers"]

_log = logging.getLogger(__name__)


class Locality(enum.Enum):
    """Where a tier is, seen from this engine (vLLM's ``Locality``)."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


@dataclass(frozen=True, slots=True)
class TierMatcher:
    """One ``kv_load_tiers`` entry: a medium and a locality, None matching any (on either side)."""

    medium: Medium | None = None
    locality: Locality | None = None

    def matches(self, medium: Medium | None, locality: Locality | None) -> bool:
        """Whether a tier of ``medium`` and ``locality`` (None: unknown, matched by anything) is matched."""
        return (self.medium is None or medium is None or self.medium is medium) and (
            self.locality is None or locality is None or self.locality is locality
        )


@dataclass(frozen=True, slots=True)
class TierFilter:
    """The tiers a request may load from: those some matcher matches (``TierFilter(())`` allows none)."""

    matchers: tuple[TierMatcher, ...] = ()

    ALL: ClassVar[TierFilter]
    """Every tier (vLLM's ``TierFilter.ALL``): the default, and what an unusable ``kv_load_tiers`` means."""

    def allows(self, medium: Medium | None, locality: Locality | None) -> bool:
        """Whether a tier of ``medium`` and ``locality`` may serve the request's loads."""
        if self is TierFilter.ALL:
            return True
        return any(m.matches(medium, locality) for m in self.matchers)


TierFilter.ALL = TierFilter((TierMatcher(),))

_MEDIA = {"cpu": Medium.CPU, "storage": Medium.STORAGE}
_LOCALITIES = {"local": Locality.LOCAL, "remote": Locality.REMOTE}


def _matcher(entry: object) -> TierMatcher | None:
    """The matcher of one entry, or None when it is invalid."""
    if not isinstance(entry, Mapping) or not set(entry) <= {"medium", "locality"}:
        return None
    medium, locality = entry.get("medium"), entry.get("locality")
    if medium is not None and not (isinstance(medium, str) and medium.lower() in _MEDIA):
        return None
    if locality is not None and not (isinstance(locality, str) and locality.lower() in _LOCALITIES):
        return None
    return TierMatcher(
        None if medium is None else _MEDIA[medium.lower()],
        None if locality is None else _LOCALITIES[locality.lower()],
    )


def parse_load_tiers(value: object, *, log: logging.Logger | None = None) -> TierFilter:
    """The :class:`TierFilter` of a ``kv_load_tiers`` value (see the module docstring; None: ALL).

    Invalid entries are skipped with a warning on ``log``; never raises (a request is never refused for it).
    """
    log = _log if log is None else log
    if value is None:
        return TierFilter.ALL
    if not isinstance(value, list | tuple):
        log.warning("kvoffload: ignoring kv_transfer_params['kv_load_tiers']=%r (not a list): loading from all", value)
        return TierFilter.ALL
    if not value:
        return TierFilter(())
    matchers: list[TierMatcher] = []
    for entry in value:
        matcher = _matcher(entry)
        if matcher is None:
            log.warning(
                "kvoffload: ignoring kv_load_tiers entry %r (expected {'medium': 'cpu'|'storage', "
                "'locality': 'local'|'remote'})",
                entry,
            )
        else:
            matchers.append(matcher)
    return TierFilter(tuple(matchers)) if matchers else TierFilter.ALL
