"""The ``kvoffload`` command's flag values: sizes, seconds and endpoints, each checked against its bound.

Every numeric flag has a bound, checked before anything runs, and every refusal is a sentence that names the
flag and the value (argparse ``type`` functions raise :class:`argparse.ArgumentTypeError` with it; the others
raise :class:`~kvoffload.errors.ConfigError`), never an ``OverflowError`` or a silent wrap-around.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from kvoffload.errors import ConfigError

__all__ = [
    "MAX_SECONDS",
    "MAX_SIZE",
    "MAX_TRANSLATE_BYTES",
    "check_seconds",
    "events_endpoint",
    "parse_size",
    "shown",
    "size_flag",
]

_SIZE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
MAX_SIZE = 2**63 - 1
"""The largest size a size flag takes (8 EiB): byte counts and offsets are int64 everywhere below."""
MAX_TRANSLATE_BYTES = 1 << 30
"""The most ``kvoffload translate --max-bytes`` lets it read (1 GiB; real engines' snapshots are KBs)."""
MAX_SECONDS = 1e9
"""Bound of the seconds flags (``--worker-timeout``, ``--metrics-linger``): about 31 years."""


def parse_size(text: str, option: str = "--cpu-bytes") -> int:
    """``"256MiB"`` -> 268435456, ``"1G"`` -> 10**9, ``"4096"`` -> 4096, rounded down to whole bytes (exact
    decimal arithmetic); ConfigError naming the option and the text when it is not a size or over
    :data:`MAX_SIZE`."""
    try:
        return _size_of(text)
    except ValueError as exc:
        raise ConfigError(f"{option}={shown(text)} {exc}") from None


def _size_of(text: str) -> int:
    match = _SIZE.match(text)
    if match is None:
        raise ValueError("is not a size (e.g. 268435456, 256MiB, 1GiB)")
    whole = match.group(1).lstrip("0")
    # 40 decimals are exact: 10**40 is a multiple of every unit (up to 1024**4), so the floor cannot change.
    frac = (match.group(2) or "")[:40]
    unit = (match.group(3) or "").lower()
    if len(whole) > len(str(MAX_SIZE)):
        raise ValueError(f"is more than {MAX_SIZE} bytes (8 EiB), the largest size")
    factor: int = 1024 ** "bkmgt".index(unit[0]) if unit.endswith(("ib", "i")) else _UNITS[unit[:1]]
    scale: int = 10 ** len(frac)
    size: int = (int(whole or "0") * scale + int(frac or "0")) * factor // scale
    if size > MAX_SIZE:
        raise ValueError(f"is more than {MAX_SIZE} bytes (8 EiB), the largest size")
    return size


def shown(text: str) -> str:
    """``text`` quoted for an error line, cut short when long (a flag's value can be any length)."""
    return repr(text) if len(text) <= 40 else f"{text[:24]!r}... ({len(text)} characters)"


def size_flag(minimum: int, maximum: int = MAX_SIZE) -> Callable[[str], int]:
    """An argparse ``type`` for a size in ``[minimum, maximum]`` bytes; its errors are whole sentences."""

    def size(text: str) -> int:
        try:
            value = _size_of(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{shown(text)} {exc}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"{shown(text)} is {value} bytes: it must be from {minimum} to {maximum} bytes"
            )
        return value

    return size


def check_seconds(option: str, value: float, *, zero: bool) -> float:
    """``value`` if it is a finite number of seconds in ``[0, MAX_SECONDS)`` (``(0, ...)`` unless ``zero``)."""
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0) and value < MAX_SECONDS):
        low = "[0" if zero else "(0"
        raise ConfigError(f"{option}={value} must be a number of seconds in {low}, {MAX_SECONDS:.0f})")
    return value


def events_endpoint(text: str) -> str:
    """``--kv-events``: a ZMQ endpoint; a ``tcp://`` one needs a port in 1..65535 or ``*`` (any free port).

    ZMQ itself would bind a port over 65535 modulo 65536, somewhere nobody listens."""
    if text.startswith("tcp://"):
        host, sep, port = text[len("tcp://") :].rpartition(":")
        if not sep or not host:
            raise ConfigError(f"--kv-events={shown(text)} needs a host and a port: tcp://HOST:PORT")
        if port != "*" and not (re.fullmatch(r"[0-9]{1,5}", port) and 1 <= int(port) <= 65535):
            raise ConfigError(
                f"--kv-events={shown(text)}: port {shown(port)} must be from 1 to 65535 (or * for any free port)"
            )
    return text
