"""Wire compatibility across released versions.

Backward: golden frames written by each released version (tests/golden/<version>/, frozen) decode with
the current code. Forward: messages encoded by the current code decode with readers materialized from
every history schema of the same major (what a peer still running that release would see).
"""

from __future__ import annotations

import importlib.util
import json
import struct
from functools import cache
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

from codegen.loader import load_schema, parse_version
from codegen.materialize import MaterializedSchema, materialize
from kvoffload import SCHEMA_FINGERPRINT, SCHEMA_VERSION, SchemaMismatchError, codecs, wire
from kvoffload._generated.types import MESSAGE_TYPES

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
HISTORY = {p.stem: p for p in sorted((ROOT / "schema" / "history").glob("*.toml"))}
GOLDEN_VERSIONS = sorted(p.name for p in GOLDEN.iterdir() if (p / "manifest.json").exists())
CURRENT_MAJOR = parse_version(SCHEMA_VERSION)[0]
HEADER_FORMAT = "<4sBBBB8sIHH"  # pinned here on purpose: released frames must keep this layout


@cache
def reader(version: str) -> MaterializedSchema:
    return materialize(HISTORY[version])


def manifest(version: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((GOLDEN / version / "manifest.json").read_text())
    return data


def golden_entries() -> list[tuple[str, dict[str, object]]]:
    out: list[tuple[str, dict[str, object]]] = []
    for version in GOLDEN_VERSIONS:
        messages = manifest(version)["messages"]
        assert isinstance(messages, list)
        out.extend((version, entry) for entry in messages)
    return out


def frames_of(version: str, entry: dict[str, object]) -> list[bytes]:
    files = entry["frames"]
    assert isinstance(files, list)
    return [(GOLDEN / version / str(name)).read_bytes() for name in files]


def load_make_golden() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the golden set itself -------------------------------------------------------------------------------


def test_every_released_version_with_messages_has_golden_frames() -> None:
    with_messages = [v for v, path in HISTORY.items() if load_schema(path).messages]
    assert with_messages, "at least one released version defines wire messages"
    assert with_messages == GOLDEN_VERSIONS


@pytest.mark.parametrize("version", GOLDEN_VERSIONS)
def test_golden_manifest_matches_its_frozen_schema(version: str) -> None:
    data = manifest(version)
    schema = load_schema(HISTORY[version])
    assert data["schema_version"] == version
    assert data["fingerprint"] == schema.fingerprint
    messages = data["messages"]
    assert isinstance(messages, list)
    assert {entry["kind"] for entry in messages} == {s.message_id for s in schema.messages}


def test_make_golden_reproduces_the_current_version(tmp_path: Path) -> None:
    make_golden = load_make_golden()
    assert make_golden.main(["--out", str(tmp_path)]) == 0
    assert make_golden.main(["--out", str(tmp_path)]) == 1  # frozen: never overwritten
    frozen = GOLDEN / SCHEMA_VERSION
    if not frozen.exists() or manifest(SCHEMA_VERSION)["fingerprint"] != SCHEMA_FINGERPRINT:
        pytest.skip(f"schema {SCHEMA_VERSION} is not released yet; run tests/golden/make_golden.py")
    written = sorted(p.name for p in (tmp_path / SCHEMA_VERSION).iterdir())
    assert written == sorted(p.name for p in frozen.iterdir() if p.suffix in (".bin", ".json"))
    for name in written:
        assert (tmp_path / SCHEMA_VERSION / name).read_bytes() == (frozen / name).read_bytes(), name


# -- backward: old frames, current code --------------------------------------------------------------------


@pytest.mark.parametrize(("version", "entry"), golden_entries(), ids=[f"{v}-{e['name']}" for v, e in golden_entries()])
def test_golden_frames_decode_with_current_code(version: str, entry: dict[str, object]) -> None:
    frames = frames_of(version, entry)
    if parse_version(version)[0] != CURRENT_MAJOR:
        with pytest.raises(SchemaMismatchError):
            wire.decode(frames)
        return
    decoded = wire.decode(frames)
    cls = MESSAGE_TYPES[int(str(entry["kind"]))]
    assert type(decoded.message).__name__ == entry["type"]
    expected = msgspec.json.decode(json.dumps(entry["json"]), type=cls)
    assert decoded.message == expected
    assert decoded.header.version == version
    assert decoded.compatible == (manifest(version)["fingerprint"] != SCHEMA_FINGERPRINT)
    assert [bytes(a) for a in decoded.attachments] == frames[1:]


@pytest.mark.parametrize(("version", "entry"), golden_entries(), ids=[f"{v}-{e['name']}" for v, e in golden_entries()])
def test_golden_bodies_decode_with_their_own_materialized_reader(version: str, entry: dict[str, object]) -> None:
    """The materialized readers agree with the code that wrote the goldens (so they are fair stand-ins)."""
    materialized = reader(version)
    frame = frames_of(version, entry)[0]
    magic, _major, _minor, _flags, kind, _fp, body_len, _count, _ = struct.unpack_from(HEADER_FORMAT, frame)
    assert magic == b"KVOW"
    body = frame[wire.HEADER_SIZE : wire.HEADER_SIZE + body_len]
    decoded = materialized.decode_message(kind, body)
    expected = materialized.json_decoder(str(entry["type"])).decode(json.dumps(entry["json"]))
    assert decoded == expected
    assert json.loads(codecs.encode(decoded, format="json")) == entry["json"]


# -- forward: current frames, readers of released versions --------------------------------------------------

SAME_MAJOR = [v for v in HISTORY if parse_version(v)[0] == CURRENT_MAJOR]


def current_messages() -> list[tuple[str, object]]:
    make_golden = load_make_golden()
    return [(name, msg) for name, msg, _ in make_golden.golden_messages()]


def reads_as(old: object, new: object, path: str = "$") -> None:
    """`old` (what a released reader decoded) is `new` minus fields appended after that release."""
    if isinstance(old, dict):
        assert isinstance(new, dict), path
        for key, value in old.items():
            assert key in new, f"{path}.{key}"
            reads_as(value, new[key], f"{path}.{key}")
    elif isinstance(old, list):
        # Array-layout structs may have gained trailing fields; real lists keep their length either way.
        assert isinstance(new, list) and len(old) <= len(new), path
        for i, (a, b) in enumerate(zip(old, new, strict=False)):
            reads_as(a, b, f"{path}[{i}]")
    else:
        assert old == new, path


@pytest.mark.parametrize("version", SAME_MAJOR)
def test_current_messages_decode_with_released_readers(version: str) -> None:
    materialized = reader(version)
    checked: set[int] = set()
    for name, msg in current_messages():
        assert isinstance(msg, msgspec.Struct)
        kind = type(msg).MESSAGE_ID  # type: ignore[attr-defined]
        old_cls = materialized.messages.get(kind)
        if old_cls is None:
            assert version != SCHEMA_VERSION, f"{name}: the current release must know its own messages"
            continue  # the message appeared after this release; peers negotiate before sending it
        assert old_cls.__name__ == type(msg).__name__
        frames = wire.encode(msg)  # type: ignore[arg-type]
        frame = bytes(frames[0])
        old = materialized.decode_message(kind, frame[wire.HEADER_SIZE :])
        reads_as(json.loads(codecs.encode(old, format="json")), json.loads(codecs.encode(msg, format="json")), name)
        checked.add(kind)
    # Every message of the release was exercised (none for releases that predate the wire messages).
    assert checked == set(materialized.messages)


def test_forward_compatibility_is_exercised() -> None:
    assert any(reader(v).messages for v in SAME_MAJOR)
