"""A small TOML writer (``tomllib`` only reads): what ``kvoffload translate --format toml`` prints.

:func:`dumps_toml` renders a mapping of JSON-like values (what ``msgspec.to_builtins`` makes of a config) as a
TOML document: nested mappings become ``[tables]``, non-empty lists of mappings ``[[arrays of tables]]``, other
lists inline arrays; keys that are not bare are quoted and escaped. TOML has no null, so None values are
omitted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

__all__ = ["dumps_toml"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def dumps_toml(data: Mapping[str, object]) -> str:
    """Render a mapping of JSON-like values as a TOML document.

    Nested mappings become ``[tables]``, lists of mappings ``[[arrays of tables]]``, other lists inline
    arrays.
    TOML has no null, so None values are omitted (also inside arrays and inline tables).
    """
    lines: list[str] = []
    _toml_table(lines, (), data)
    return "\n".join(lines).strip("\n") + "\n"


def _toml_table(lines: list[str], path: tuple[str, ...], table: Mapping[str, object]) -> None:
    for key, value in table.items():
        if value is None or isinstance(value, Mapping) or _is_table_array(value):
            continue
        lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in table.items():
        sub = (*path, key)
        if isinstance(value, Mapping):
            lines.extend(("", f"[{_dotted(sub)}]"))
            _toml_table(lines, sub, value)
        elif isinstance(value, (list, tuple)) and _is_table_array(value):
            for item in value:
                lines.extend(("", f"[[{_dotted(sub)}]]"))
                _toml_table(lines, sub, item)


def _is_table_array(value: object) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(_toml_key(p) for p in path)


def _toml_key(key: object) -> str:
    text = str(key)
    return text if _BARE_KEY.fullmatch(text) else _toml_string(text)


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, Mapping):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None)
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value if v is not None) + "]"
    return _toml_string(str(value))
