"""Engine snapshots on disk: strict loading of the ``{engine_config, kv_cache_config}`` documents.

A snapshot is what ``kvoffload translate`` reads (JSON or TOML with vLLM's own attribute names); live engines
produce one through their integration (``kvoffload.integrations.vllm.snapshot_from_vllm``) and write it with
``kvoffload.codecs.encode(snapshot, format="json")``. Loading never trusts the file: its size is capped before
reading on, a document nested too deeply is refused, and every failure is one
:class:`~kvoffload.errors.ConfigError` line that names the file, the field path and the bad value.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import BinaryIO

import msgspec

from kvoffload._generated import codecs
from kvoffload._generated.types import EngineSnapshot
from kvoffload._ints import check_int
from kvoffload.errors import ConfigError

__all__ = ["DEFAULT_MAX_SNAPSHOT_BYTES", "load_snapshot", "with_value"]

_PATH_RE = re.compile(r" - at `(\$[^`]*)`$")
_TOKEN_RE = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


DEFAULT_MAX_SNAPSHOT_BYTES = 16 * 1024 * 1024
"""Largest snapshot file :func:`load_snapshot` reads unless told otherwise (real engines' snapshots are KBs)."""

_READ_CHUNK = 1 << 20


def load_snapshot(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES) -> EngineSnapshot:
    """Read an engine snapshot from a JSON or TOML file (by suffix; otherwise JSON when it starts with ``{``).

    Decoding is strict (unknown fields, wrong types and out-of-range values are rejected). Any failure is a
    ConfigError whose one-line message names the file, the field path and, when present, the bad value. At
    most ``max_bytes`` bytes are read (a larger input, e.g. ``/dev/zero``, is refused without reading on; the
    memory held grows with what was read, not with ``max_bytes``), and a document nested too deeply to decode is
    refused instead of raising RecursionError.
    """
    check_int("max_bytes", max_bytes, 1, value_first=True)
    file = Path(path)
    try:
        with file.open("rb") as handle:
            raw = _read_capped(handle, max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) > max_bytes:
        raise ConfigError(f"{file}: larger than max_bytes={max_bytes}: not an engine snapshot (raise the limit?)")
    try:
        return _decode_snapshot(file, raw)
    except RecursionError:
        raise ConfigError(f"{file}: nested too deeply to decode (not an engine snapshot)") from None


def _read_capped(handle: BinaryIO, limit: int) -> bytes:
    """At most ``limit`` bytes of ``handle``, read in chunks (one ``read(limit)`` would allocate ``limit`` bytes)."""
    chunks: list[bytes] = []
    total = 0
    while total < limit:
        chunk = handle.read(min(_READ_CHUNK, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _decode_snapshot(file: Path, raw: bytes) -> EngineSnapshot:
    is_toml = file.suffix.lower() == ".toml" or (file.suffix.lower() != ".json" and not raw.lstrip().startswith(b"{"))
    document: object = None
    if is_toml:
        try:
            document = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: invalid TOML: {exc}") from exc
        try:
            raw = msgspec.json.encode(document)
        except (TypeError, msgspec.EncodeError) as exc:  # pragma: no cover - tomllib yields JSON-able values
            raise ConfigError(f"{file}: unsupported TOML value: {exc}") from exc
    try:
        return codecs.decode(raw, EngineSnapshot, format="json")
    except msgspec.ValidationError as exc:
        if document is None:
            try:
                document = json.loads(raw)
            except ValueError:  # pragma: no cover - msgspec already parsed it
                document = None
        raise ConfigError(f"{file}: {with_value(str(exc), document)}") from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{file}: invalid JSON: {exc}") from exc


def with_value(message: str, document: object) -> str:
    """Append the offending value to a msgspec validation message (it names the path, not the value)."""
    match = _PATH_RE.search(message)
    if match is None:
        return message
    found, value = _lookup(document, match.group(1))
    if not found or isinstance(value, (dict, list)):
        return message
    return f"{message} (got {json.dumps(value)})"


def _lookup(document: object, path: str) -> tuple[bool, object]:
    node = document
    for key, index in _TOKEN_RE.findall(path[1:]):
        if key and isinstance(node, dict) and key in node:
            node = node[key]
        elif index and isinstance(node, list) and int(index) < len(node):
            node = node[int(index)]
        else:
            return False, None
    return True, node
