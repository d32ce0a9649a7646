"""A loaded host, on demand: busy processes for the length of a run (``kvoffload demo --contend N``, and the
benchmarks' ``--contend N``).

A serving box shares its cores with other work; a figure that only holds on an idle machine holds on a machine
nobody serves from. Each busy process spins on arithmetic (one core's worth of demand) until the run ends: they
are started before the run and killed when it ends, including on an error or Ctrl-C, and each exits by itself
once the process that started it is gone, so none is ever left running. ``2 x os.cpu_count()`` is the loaded
condition the benchmarks report beside 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from kvoffload.errors import ConfigError

__all__ = ["contended"]

_SPIN = """
import os, sys
parent, x = int(sys.argv[1]), 0  # not getppid(): the starter may be gone before this line runs
while os.getppid() == parent:
    for _ in range(100_000):
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
"""


@contextmanager
def contended(n: int) -> Iterator[list[int]]:
    """Keep ``n`` busy processes running inside the block; yields their pids."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"--contend must be an integer >= 0, got {n!r}")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _SPIN, str(os.getpid())], stdin=subprocess.DEVNULL, start_new_session=True
                )
            )
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
