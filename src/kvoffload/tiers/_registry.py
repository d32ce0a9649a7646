"""Tier types by name: the built-ins (``fs``, ``valkey``, ``obj``), classes registered with
:func:`register_tier_type`, and out-of-tree classes imported from a ``module_path`` (vLLM's ``SecondaryTierFactory``).

``register_tier_type("mytier", MyTier)`` makes ``{"type": "mytier", ...}`` open ``MyTier`` with the entry's
other keys as keyword arguments (and ``namespace=``), no ``module_path`` needed. The entry is kept as a
``custom`` config naming the class's module too, so a process that did not register the name (a spawned
worker) imports it from there. The texts of the errors are vLLM's: ``Tier 'fs' is already registered.``,
``Unknown secondary tier type: 'x'. Supported types: [...]``.
"""

from __future__ import annotations

import importlib

from kvoffload._generated import FsTierConfig, ObjTierConfig, ValkeyTierConfig
from kvoffload.errors import ConfigClassError, ConfigError, ConfigImportError, ConfigModuleNotFoundError
from kvoffload.tiers._base import SecondaryTier, TierBase

__all__ = [
    "BUILTIN_TIER_TYPES",
    "BuiltinTierConfig",
    "check_tier_class",
    "import_tier_class",
    "register_tier_type",
    "registered_tier_class",
    "tier_type_names",
]

BUILTIN_TIER_TYPES = ("fs", "valkey", "obj", "custom")
"""The ``type`` tags of the schema's tier configs (``custom``: an out-of-tree class by ``module_path``)."""

BuiltinTierConfig = FsTierConfig | ValkeyTierConfig | ObjTierConfig
"""The configs of the built-in kinds: each has vLLM's ``locality`` and ``enable_kv_events`` keys and a
``max_bytes`` bound (what an out-of-tree tier takes is in its own ``options``)."""

_REGISTERED: dict[str, type] = {}


def check_tier_class(cls: object, what: str) -> type:
    """``cls`` if it is a tier class: deriving from :class:`TierBase` or declaring :class:`SecondaryTier` (having
    the right attribute names is not enough, a mock has them all: vLLM checks the base class too); else a
    :class:`ConfigClassError`, an ``AssertionError`` as vLLM's ``assert issubclass`` raises."""
    if not isinstance(cls, type) or not (issubclass(cls, TierBase) or SecondaryTier in cls.__mro__):
        raise ConfigClassError(
            f"custom tier {what} must be a class deriving from kvoffload.tiers.TierBase "
            f"(or declaring kvoffload.tiers.SecondaryTier), got {cls!r}"
        )
    return cls


def register_tier_type(name: str, cls: type) -> None:
    """Make ``{"type": name, ...}`` in ``secondary_tiers`` open ``cls`` (a tier class, see
    :func:`check_tier_class`), built with ``namespace=`` and the entry's other keys as keyword arguments.

    A name taken already (a built-in or an earlier registration) raises ``Tier 'name' is already registered.``
    (a :class:`ConfigError`, a ``ValueError`` as vLLM raises)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a tier type name must be a non-empty string, got {name!r}")
    if name in BUILTIN_TIER_TYPES or name in _REGISTERED:
        raise ConfigError(f"Tier '{name}' is already registered.")
    _REGISTERED[name] = check_tier_class(cls, f"{name!r} ({cls!r})")


def registered_tier_class(name: str) -> type | None:
    """The class registered under ``name`` in this process, or None."""
    return _REGISTERED.get(name)


def tier_type_names() -> list[str]:
    """Every ``type`` a tier entry takes without ``module_path``: the built-ins, then the registered ones."""
    return [*BUILTIN_TIER_TYPES, *_REGISTERED]


def import_tier_class(module_path: str, class_name: str, where: str) -> type:
    """``class_name`` from ``module_path``, checked to be a tier class. An import that fails raises
    :class:`ConfigImportError` (a ConfigError and an ImportError; :class:`ConfigModuleNotFoundError`, also a
    ``ModuleNotFoundError``, when the module does not exist, as in vLLM) naming ``where`` and the module, chained
    to the import's own error."""
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        error = ConfigModuleNotFoundError if isinstance(exc, ModuleNotFoundError) else ConfigImportError
        raise error(
            f"{where}: cannot import {class_name!r} from module_path={module_path!r}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        cls = getattr(module, class_name)
    except AttributeError as exc:
        raise ConfigImportError(f"{where}: module_path={module_path!r} has no {class_name!r}") from exc
    return check_tier_class(cls, f"{module_path}.{class_name}")
