"""The cache-policy registry: the host block manager builds its policy by name ("lru", "arc", registered, or an
out-of-tree class named with a module path, vLLM's ``cache_policy_module_path``).

Both built-in policies reproduce vLLM 0.33's victim order exactly, with or without per-request position hints:
:class:`~kvoffload.offload.manager.policies.LRUPolicy` ranks keys logically (exact LRU by insertion/touch order
without positions), :class:`~kvoffload.offload.manager.policies.ARCPolicy` is vLLM's ARC. The interface they
implement is :class:`~kvoffload.offload.manager.policies.CachePolicy`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from kvoffload.errors import ConfigError, ConfigImportError
from kvoffload.offload.manager.policies._arc import ARCPolicy
from kvoffload.offload.manager.policies._base import CachePolicy
from kvoffload.offload.manager.policies._lru import LRUPolicy

__all__ = [
    "PolicyFactory",
    "available_policies",
    "make_policy",
    "policy_factory",
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


def policy_factory(name: str, module_path: str | None = None) -> PolicyFactory:
    """What builds the policy ``name`` selects (vLLM 0.33 ``CachePolicyFactory.get_cache_policy_cls``).

    A registered name wins; otherwise, with ``module_path`` (vLLM's ``cache_policy_module_path``), ``name`` is a
    :class:`CachePolicy` subclass imported from that module (an out-of-tree policy). Raises :class:`ConfigError`
    (a ValueError) for an unknown name without ``module_path`` (vLLM's text, ``Unknown cache policy: ...``) and
    for a module attribute that is missing or not a :class:`CachePolicy` subclass, each naming the key and the
    value; a module that cannot be imported raises :class:`~kvoffload.errors.ConfigImportError` (also an
    ImportError) chained to the import's own error.
    """
    factory = _REGISTRY.get(name) if isinstance(name, str) else None
    if factory is not None:
        return factory
    if module_path is None:
        raise ConfigError(
            f"Unknown cache policy: {name!r} (known: {', '.join(available_policies())}; for an out-of-tree policy, "
            "also set cache_policy_module_path)"
        )
    where = f"eviction_policy={name!r} with cache_policy_module_path={module_path!r}"
    if not isinstance(module_path, str) or not module_path:
        raise ConfigError(f"cache_policy_module_path must be a non-empty module path, got {module_path!r}")
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"{where}: eviction_policy must name a class of the module, got {name!r}")
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ConfigImportError(f"{where}: cannot import the module: {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, name, None)
    if cls is None:
        raise ConfigError(f"{where}: module {module_path!r} has no {name!r}")
    if not isinstance(cls, type) or not issubclass(cls, CachePolicy):
        raise ConfigError(f"{where}: {module_path}.{name} is {cls!r}, not a kvoffload CachePolicy subclass")
    if getattr(cls, "__abstractmethods__", None):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ConfigError(f"{where}: {module_path}.{name} is abstract (it does not implement {missing})")
    return cls


def make_policy(name: str, capacity: int, module_path: str | None = None) -> CachePolicy:
    """Build the policy ``name`` selects (see :func:`policy_factory`) for ``capacity`` chunks.

    Unknown names raise :class:`ConfigError` (a ValueError) with vLLM's text, ``Unknown cache policy: ...``.
    """
    return policy_factory(name, module_path)(capacity)
