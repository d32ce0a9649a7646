"""Integer helpers shared across kvoffload: ceiling division, rounding up, and validating int arguments.

One definition each, so every validation error reads the same way (field name and value, the allowed range)
and every ceiling division rounds the same way.
"""

from __future__ import annotations

from .errors import ConfigError

__all__ = ["cdiv", "check_int", "check_optional_int", "round_up"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division ``-(a // -b)``, as vLLM's ``cdiv``."""
    return -(a // -b)


def round_up(x: int, y: int) -> int:
    """``x`` rounded up to a multiple of ``y > 0``, as vLLM's ``round_up`` (also for negative ``x``)."""
    return cdiv(x, y) * y


def check_int(name: str, value: object, minimum: int = 0, maximum: int | None = None, *, where: str = "") -> int:
    """Return ``value`` if it is an int (a bool is not) in ``[minimum, maximum]``, else raise :class:`ConfigError`.

    The message names the field and the value (``{where}{name}={value!r} must be an int >= {minimum}``);
    ``where`` prefixes it with the component, e.g. ``"fs tier: "``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{where}{name}={value!r} must be an int {bound}")
    return value


def check_optional_int(name: str, value: object, minimum: int = 0, *, where: str = "") -> int | None:
    """:func:`check_int` that also accepts ``None`` (an absent limit), which it returns unchanged."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}{name}={value!r} must be an int >= {minimum} or None")
    return value
