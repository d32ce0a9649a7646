"""The cache-policy registry: the host block manager builds its policy by name ("lru", "arc", or registered).

Both built-in policies reproduce vLLM 0.33's victim order exactly for call sequences without per-request
position hints (vLLM only has those inside its connector): :class:`~kvoffload.offload.manager.policies.LRUPolicy`
is exact LRU by insertion/touch order, :class:`~kvoffload.offload.manager.policies.ARCPolicy` is vLLM's ARC. The
interface they implement is :class:`~kvoffload.offload.manager.policies.CachePolicy`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.errors import ConfigError
from kvoffload.offload.manager.policies._arc import ARCPolicy
from kvoffload.offload.manager.policies._base import CachePolicy
from kvoffload.offload.manager.policies._lru import LRUPolicy

__all__ = [
    "PolicyFactory",
    "available_policies",
    "make_policy",
    "register_policy",
]


PolicyFactory = Callable[[int], CachePolicy]
"""Anything that builds a policy from a capacity, typically a :class:`CachePolicy` subclass."""

_REGISTRY: dict[str, PolicyFactory] = {"lru": LRUPolicy, "arc": ARCPolicy}


def register_policy(name: str, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Make ``factory`` available to :func:`make_policy` as ``name``; an existing name needs ``replace``."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"policy name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise ConfigError(f"policy factory for {name!r} must be callable, got {factory!r}")
    if name in _REGISTRY and not replace:
        raise ConfigError(f"cache policy {name!r} is already registered")
    _REGISTRY[name] = factory


def available_policies() -> tuple[str, ...]:
    """Return the registered policy names, sorted."""
    return tuple(sorted(_REGISTRY))


def make_policy(name: str, capacity: int) -> CachePolicy:
    """Build the policy registered as ``name`` for ``capacity`` chunks.

    Unknown names raise :class:`ConfigError` (a ValueError) with vLLM's text, ``Unknown cache policy: ...``.
    """
    factory = _REGISTRY.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ConfigError(f"Unknown cache policy: {name!r} (known: {', '.join(available_policies())})")
    return factory(capacity)
