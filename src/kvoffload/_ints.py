"""Integer helpers shared across kvoffload: ceiling division, rounding up, and validating int arguments.

One definition each, so every validation error reads the same way (field name and value, the allowed range)
and every ceiling division rounds the same way.
"""

from __future__ import annotations

from kvoffload.errors import ConfigError

__all__ = ["cdiv", "check_int", "check_optional_int", "round_up"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division ``-(a // -b)``, as vLLM's ``cdiv``."""
    return -(a // -b)


def round_up(x: int, y: int) -> int:
    """``x`` rounded up to a multiple of ``y > 0``, as vLLM's ``round_up`` (also for negative ``x``)."""
    return cdiv(x, y) * y


def check_int(
    name: str,
    value: object,
    minimum: int = 0,
    maximum: int | None = None,
    *,
    where: str = "",
    value_first: bool = False,
) -> int:
    """Return ``value`` if it is an int (a bool is not) in ``[minimum, maximum]``, else raise :class:`ConfigError`.

    The message names the field and the value: ``{where}{name} must be an int >= {minimum}, got {value!r}``
    (``in [minimum, maximum]`` with a maximum); ``where`` prefixes the component, e.g. ``"fs tier: "``.
    ``value_first`` writes it as an assignment instead, ``{name}={value!r} must be >= {minimum}`` (``must be an
    int >= ...`` when it is not an int), for fields whose messages quote the value as it was given.
    """
    is_int = not isinstance(value, bool) and isinstance(value, int)
    if isinstance(value, int) and is_int and minimum <= value and (maximum is None or value <= maximum):
        return value
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if value_first:
        raise ConfigError(f"{where}{name}={value!r} must be {bound if is_int else 'an int ' + bound}")
    raise ConfigError(f"{where}{name} must be an int {bound}, got {value!r}")


def check_optional_int(name: str, value: object, minimum: int = 0, *, where: str = "") -> int | None:
    """:func:`check_int` that also accepts ``None`` (an absent limit), which it returns unchanged."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}{name} must be an int >= {minimum} or None, got {value!r}")
    return value
