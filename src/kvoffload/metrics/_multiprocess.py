"""prometheus_client's multiprocess mode for spawned workers: the directory they write to, and reading it back."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from kvoffload.errors import ConfigError

__all__ = ["MULTIPROC_ENV", "add_worker_collector", "mark_worker_dead", "multiprocess_env"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""The environment variable prometheus_client's multiprocess mode reads when it is imported."""


@contextlib.contextmanager
def multiprocess_env(path: str | os.PathLike[str]) -> Iterator[None]:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` to ``path`` while processes are spawned, then restore it.

    A spawned child inherits the variable, so its prometheus_client starts in multiprocess mode and writes its
    values under ``path``; this process's own metrics are unaffected (the mode is fixed when prometheus_client
    is imported).
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise ConfigError(f"metrics directory {directory!r} does not exist")
    old = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = directory
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = old


def add_worker_collector(registry: CollectorRegistry, path: str | os.PathLike[str]) -> MultiProcessCollector:
    """Make ``registry`` also expose the metrics worker processes write under ``path`` (summed over workers)."""
    return MultiProcessCollector(registry, path=os.fspath(path))  # type: ignore[no-untyped-call]


def mark_worker_dead(pid: int, path: str | os.PathLike[str]) -> None:
    """Tell prometheus_client that worker ``pid`` exited: its live gauges go, its counters stay counted."""
    mark_process_dead(pid, os.fspath(path))  # type: ignore[no-untyped-call]
