"""The benchmarks' ``--contend N`` (N busy processes for the whole run, :func:`kvoffload.demo.contend.contended`)
and their median-and-range figures."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence

from kvoffload.demo.contend import contended

__all__ = ["add_contend_argument", "contended", "median_range"]


def add_contend_argument(parser: argparse.ArgumentParser) -> None:
    """``--contend N``: busy processes for the whole run."""
    parser.add_argument(
        "--contend",
        type=int,
        default=0,
        metavar="N",
        help=f"N busy processes for the whole run: a loaded host (this one has {os.cpu_count()} cores; "
        "report 0 and 2x the cores)",
    )


def median_range(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    """``median [min-max]`` of ``values`` (the median alone for one value)."""
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"
