"""Backpressure drop policies: what a tier under pressure does with the next cascade (vLLM 0.33's policies).

A policy is a class with three hooks, named as vLLM's ``BackpressurePolicy`` names them (:class:`DropPolicy`):
``should_store(detector)`` is asked for each cascade while the tier is under pressure (False drops it),
``on_store_skipped(num_chunks)`` hears of every dropped cascade (the policy's own and the cooldown's), and
``reset()`` forgets what the policy learned, called when pressure clears and on ``reset_cache``. The detector
keeps the drop counters. Built-ins: :class:`ThrottledDropPolicy` (the default: a share of the stores that grows
with the overshoot) and :class:`DropStorePolicy` (every store). ``policy_cls`` names one of them (or ``throttled``
/ ``drop``), a name given to :func:`register_drop_policy`, or an out-of-tree class as ``package.module.Class``
(imported; an unimportable one is a :class:`~kvoffload.errors.ConfigImportError`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvoffload.errors import ConfigError, ConfigImportError

if TYPE_CHECKING:
    from kvoffload.tiers._backpressure import EMABackpressureDetector

__all__ = [
    "DropPolicy",
    "DropStorePolicy",
    "ThrottledDropPolicy",
    "drop_policy_class",
    "drop_policy_names",
    "make_drop_policy",
    "register_drop_policy",
]

_HOOKS = ("should_store", "on_store_skipped", "reset")


@runtime_checkable
class DropPolicy(Protocol):
    """What a drop policy implements (vLLM's ``BackpressurePolicy`` hooks; see the module docstring)."""

    def should_store(self, detector: EMABackpressureDetector) -> bool:
        """Whether the next cascade into the pressured tier is kept (False: it is dropped)."""
        ...

    def on_store_skipped(self, num_chunks: int) -> None:
        """A cascade of ``num_chunks`` chunks was dropped (by this policy or by the cooldown after pressure)."""
        ...

    def reset(self) -> None:
        """Forget what the policy learned: pressure cleared, or the cache was reset."""
        ...


class ThrottledDropPolicy:
    """Drops a share of the stores that grows with the overshoot: ``min(1, (ema - high) / high / ramp_factor)``
    (with the default ramp of 2: none at the high water mark, all at 3 times it); an accumulator spreads the
    drops evenly (a rate of 0.25 drops exactly every 4th store)."""

    def __init__(self, ramp_factor: float = 2.0) -> None:
        if isinstance(ramp_factor, bool) or not isinstance(ramp_factor, int | float) or not ramp_factor > 0:
            raise ConfigError(f"ThrottledDropPolicy: ramp_factor must be a number > 0, got {ramp_factor!r}")
        self.ramp_factor = float(ramp_factor)
        self._accumulator = 0.0

    def drop_rate(self, detector: EMABackpressureDetector) -> float:
        """Share of the stores dropped now."""
        high = detector.settings.high_water_s
        if not detector.under_pressure or detector.ema is None:
            return 0.0
        return min(1.0, max(0.0, detector.ema - high) / high / self.ramp_factor)

    def should_store(self, detector: EMABackpressureDetector) -> bool:
        self._accumulator += self.drop_rate(detector)
        if self._accumulator >= 1.0 - 1e-9:  # a rate of 0.25 must drop exactly every 4th store
            self._accumulator -= 1.0
            return False
        return True

    def on_store_skipped(self, num_chunks: int) -> None:
        return None

    def reset(self) -> None:
        self._accumulator = 0.0


class DropStorePolicy:
    """Drops every store while the tier is under pressure."""

    def drop_rate(self, detector: EMABackpressureDetector) -> float:
        """Share of the stores dropped now: all of them under pressure."""
        return 1.0 if detector.under_pressure and detector.ema is not None else 0.0

    def should_store(self, detector: EMABackpressureDetector) -> bool:
        return not detector.under_pressure

    def on_store_skipped(self, num_chunks: int) -> None:
        return None

    def reset(self) -> None:
        return None


_BUILTIN: dict[str, type] = {
    "ThrottledDropPolicy": ThrottledDropPolicy,
    "throttled": ThrottledDropPolicy,
    "DropStorePolicy": DropStorePolicy,
    "drop": DropStorePolicy,
}
_REGISTERED: dict[str, type] = {}


def register_drop_policy(name: str, cls: type) -> None:
    """Make ``policy_cls=name`` select ``cls`` (a class with the :class:`DropPolicy` hooks, built with no
    arguments). A name taken already is refused, as vLLM refuses it: ``Drop policy 'X' is already registered.``"""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a drop policy name must be a non-empty string, got {name!r}")
    if name in _BUILTIN or name in _REGISTERED:
        raise ConfigError(f"Drop policy '{name}' is already registered.")
    _check_class(name, cls)
    _REGISTERED[name] = cls


def drop_policy_names() -> list[str]:
    """The names ``policy_cls`` takes without importing anything: built-ins, then registered ones."""
    return [*_BUILTIN, *_REGISTERED]


def _check_class(name: str, cls: object) -> type:
    if not isinstance(cls, type) or not all(callable(getattr(cls, hook, None)) for hook in _HOOKS):
        raise ConfigError(
            f"drop policy {name!r} must be a class with should_store(detector), on_store_skipped(num_chunks) "
            f"and reset(), got {cls!r}"
        )
    return cls


def drop_policy_class(name: str) -> tuple[str, type]:
    """The canonical name and class ``policy_cls=name`` selects; ConfigError for an unknown name, and
    :class:`~kvoffload.errors.ConfigImportError` for a ``package.module.Class`` that cannot be imported."""
    builtin = _BUILTIN.get(name)
    if builtin is not None:
        return builtin.__name__, builtin
    registered = _REGISTERED.get(name)
    if registered is not None:
        return name, registered
    module_path, _, class_name = name.rpartition(".")
    if not module_path or not class_name:
        raise ConfigError(
            f"policy_cls={name!r} is not one of {', '.join(dict.fromkeys(c.__name__ for c in _BUILTIN.values()))}"
            f"{''.join(', ' + n for n in _REGISTERED)} (an out-of-tree policy: package.module.ClassName)"
        )
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ConfigImportError(f"policy_cls={name!r}: cannot import module {module_path!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigImportError(f"policy_cls={name!r}: module {module_path!r} has no {class_name!r}")
    return name, _check_class(name, cls)


def make_drop_policy(name: str, ramp_factor: float) -> DropPolicy:
    """A new policy of the class ``name`` selects (``ThrottledDropPolicy`` gets ``ramp_factor``)."""
    _, cls = drop_policy_class(name)
    policy = cls(ramp_factor=ramp_factor) if cls is ThrottledDropPolicy else cls()
    if not isinstance(policy, DropPolicy):
        raise ConfigError(f"drop policy {name!r} built {policy!r}, which lacks the DropPolicy hooks")
    return policy
