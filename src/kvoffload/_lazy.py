"""Names a package exports but loads on first use (torch, valkey, Prometheus or ZMQ behind them)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: Mapping[str, str], namespace: dict[str, object]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports ``table[name]`` on first use and caches the name in
    the package's ``namespace`` (its ``globals()``), so later lookups never come back here."""

    def __getattr__(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
