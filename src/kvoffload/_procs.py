"""Whether a process named by its pid still runs: how leftovers of dead owners (pool files, server directories,
temporary records, memory reservations) are told from those of live ones."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """True unless ``pid`` is certainly gone: another user's process, or a pid that cannot be asked about, counts as
    alive (its leftovers are kept; a reused pid only keeps a stale leftover longer)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return pid > 0
