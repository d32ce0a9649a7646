"""The translator: an engine's KV-cache metadata -> :class:`~kvoffload.OffloadingConfig`, exactly as vLLM 0.33.

This package re-implements vLLM 0.33's ``build_offloading_config`` rule for rule on the generated types, explains
every decision it takes, loads engine snapshots from disk and checks that a translated snapshot can run. Its
surface is ``__all__``; every module is private:

* ``_translate``: :func:`build_offloading_config` (one named function per rule, in vLLM's order),
  :func:`explain_offloading_config`, :func:`translate_snapshot`, :func:`explain_snapshot`;
* ``_gates``: the ``replicated_layout`` / ``is_parallelism_agnostic`` / canonical-certification gates;
* ``_rules``: block-size resolution (``tokens_per_hash``) and windows measured in chunks;
* ``_spec_math``: pure page-size and spec formulas of every spec kind (:func:`real_page_size_bytes`, ...),
  on the generated types only;
* ``_explain``: the decision sink and recorder, :class:`Decision`, :class:`Explanation`, :func:`describe_error`;
* ``_snapshot``: :func:`load_snapshot`, strict and size-capped loading of snapshot files (JSON/TOML);
* ``_runnable``: :func:`validate_runnable`, what the translator (like vLLM's) lets through but cannot run. It
  loads on first use (it sizes the host pool), so importing the translator stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.translate._explain import Decision, Explanation, describe_error
from kvoffload.translate._snapshot import DEFAULT_MAX_SNAPSHOT_BYTES, load_snapshot
from kvoffload.translate._spec_math import real_page_size_bytes
from kvoffload.translate._translate import (
    build_offloading_config,
    explain_offloading_config,
    explain_snapshot,
    translate_snapshot,
)

if TYPE_CHECKING:
    from kvoffload.translate._runnable import validate_runnable

__all__ = [
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "Decision",
    "Explanation",
    "build_offloading_config",
    "describe_error",
    "explain_offloading_config",
    "explain_snapshot",
    "load_snapshot",
    "real_page_size_bytes",
    "translate_snapshot",
    "validate_runnable",
]


def __getattr__(name: str) -> object:
    """Load :func:`validate_runnable` on first use."""
    if name != "validate_runnable":
        raise AttributeError(f"module 'kvoffload.translate' has no attribute {name!r}")
    from kvoffload.translate._runnable import validate_runnable

    globals()[name] = validate_runnable
    return validate_runnable
