"""A loaded host, on demand: ``--contend N`` starts N busy processes for the length of a benchmark.

A serving box shares its cores with other work; a benchmark that only runs on an idle machine measures a machine
nobody serves from. Each busy process spins on arithmetic in a tight loop (one core's worth of demand) until the
benchmark ends; they are started before the first measurement and killed (never left running) when it ends,
including on an error or Ctrl-C. ``2 x os.cpu_count()`` is the condition the benchmarks report beside 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["add_contend_argument", "contended", "median_range"]

_SPIN = "import os\nos.nice(0)\nx = 0\nwhile True:\n    x = (x * 1103515245 + 12345) & 0xFFFFFFFF\n"


def add_contend_argument(parser: argparse.ArgumentParser) -> None:
    """``--contend N`` (busy processes) and ``--repeat K`` (runs, reported as median and range)."""
    parser.add_argument(
        "--contend",
        type=int,
        default=0,
        metavar="N",
        help=f"N busy processes for the whole run: a loaded host (this one has {os.cpu_count()} cores; "
        "report 0 and 2x the cores)",
    )
    parser.add_argument("--repeat", type=int, default=1, metavar="K", help="runs; figures are median [min-max]")


@contextmanager
def contended(n: int) -> Iterator[list[int]]:
    """Keep ``n`` busy processes running inside the block; yields their pids."""
    if n < 0:
        raise ValueError(f"--contend must be >= 0, got {n}")
    procs = [
        subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL, start_new_session=True)
        for _ in range(n)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()


def median_range(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    """``median [min-max]`` of ``values`` (the median alone for one value)."""
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"
