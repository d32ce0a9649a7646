"""The wire envelope: round trips, header validation, the compatible path, fuzzing and the handshake."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codegen.loader import load_schema_text
from codegen.materialize import MaterializedSchema, materialize
from kvoffload import (
    SCHEMA_FINGERPRINT,
    SCHEMA_VERSION,
    BlockRemoved,
    BlockStored,
    Heartbeat,
    Hello,
    JobResult,
    KVEventBatch,
    Medium,
    PeerRole,
    SchemaMismatchError,
    Shutdown,
    StepPlan,
    TransferJob,
    WireError,
    WorkerFailure,
    WorkerReport,
    codecs,
    wire,
)
from kvoffload._generated.types import MESSAGE_TYPES, Message
from kvoffload._packed import pack_int32, pack_int64, unpack_int64
from kvoffload.translate import load_snapshot

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_TEXT = (ROOT / "schema" / "kvoffload.toml").read_text()
MAJOR, MINOR = (int(part) for part in SCHEMA_VERSION.split("."))
LOCAL_FP = bytes.fromhex(SCHEMA_FINGERPRINT)


def job(job_id: int, blocks: int = 3, *, sync: bool = False) -> TransferJob:
    return TransferJob(
        job_id=job_id,
        req_id=f"req-{job_id}",
        group_sizes=pack_int32([blocks]),
        block_indices=pack_int32([0]),
        block_ids=pack_int64(range(100 + job_id, 100 + job_id + blocks)),
        chunk_ids=pack_int64([2**40 + job_id]),
        sync=sync,
    )


SAMPLES: dict[str, Message] = {
    "hello": Hello(
        schema_version=SCHEMA_VERSION,
        fingerprint=SCHEMA_FINGERPRINT,
        role=PeerRole.WORKER,
        rank=1,
        world_size=2,
        engine_id="engine-0",
        pid=123,
    ),
    "step_plan": StepPlan(
        step=7, load_jobs=(job(1, sync=True),), store_jobs=(job(2), job(3, 0)), flush=pack_int64([1, 2])
    ),
    "empty_step_plan": StepPlan(step=0, load_jobs=(), store_jobs=()),
    "worker_report": WorkerReport(
        rank=1,
        step=7,
        results=(
            JobResult(job_id=1, success=True, is_store=False, num_bytes=4096, seconds=0.25),
            JobResult(job_id=2, success=False, is_store=True, num_bytes=0, seconds=0.0),
        ),
    ),
    "shutdown": Shutdown(reason="bye"),
    "default_shutdown": Shutdown(),
    "kv_event_batch": KVEventBatch(
        ts=1700000000.5,
        events=(
            BlockStored(
                block_hashes=(b"\x01" * 8, b"\x02" * 8),
                parent_block_hash=b"\x00" * 8,
                token_ids=pack_int32(range(32)),
                block_size=16,
                group_idx=1,
                medium=Medium.CPU,
            ),
            BlockRemoved(block_hashes=(b"\x01" * 8,), medium=Medium.STORAGE),
        ),
    ),
    "worker_failure": WorkerFailure(rank=1, error_type="ConfigError", message="bad value", step=3),
    "heartbeat": Heartbeat(rank=1, seq=42),
}


def frame_bytes(msg: Message) -> bytes:
    return bytes(wire.encode(msg)[0])


def with_header(body: bytes, **changes: int | bytes) -> bytes:
    """A frame 0 with a hand-made header: defaults describe a local StepPlan of `body`."""
    fields: dict[str, int | bytes] = {
        "major": MAJOR,
        "minor": MINOR,
        "flags": 0,
        "kind": StepPlan.MESSAGE_ID,
        "fingerprint": LOCAL_FP,
        "body_len": len(body),
        "attachments": 0,
    }
    fields.update(changes)
    return wire.Header(**fields).to_bytes() + body  # type: ignore[arg-type]


# -- round trips ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_every_sample(name: str) -> None:
    msg = SAMPLES[name]
    frames = wire.encode(msg)
    assert len(frames) == 1
    decoded = wire.decode(frames)
    assert decoded.message == msg
    assert type(decoded.message) is type(msg)
    assert decoded.header.kind == type(msg).MESSAGE_ID
    assert decoded.header.version == SCHEMA_VERSION
    assert decoded.attachments == ()
    assert not decoded.compatible
    # Frames copied into plain bytes (what a socket delivers) decode the same.
    assert wire.decode([bytes(f) for f in frames]).message == msg


def test_every_message_kind_is_sampled() -> None:
    assert {type(m) for m in SAMPLES.values()} == set(MESSAGE_TYPES.values())


def test_header_layout() -> None:
    frame = frame_bytes(SAMPLES["shutdown"])
    assert wire.HEADER_SIZE == 24
    assert frame[:4] == wire.MAGIC
    assert frame[4] == MAJOR and frame[5] == MINOR and frame[6] == 0
    assert frame[7] == Shutdown.MESSAGE_ID
    assert frame[8:16] == LOCAL_FP
    body = codecs.encode(SAMPLES["shutdown"])
    assert int.from_bytes(frame[16:20], "little") == len(body)
    assert frame[wire.HEADER_SIZE :] == body
    header = wire.parse_header(frame)
    assert header == wire.Header(MAJOR, MINOR, 0, Shutdown.MESSAGE_ID, LOCAL_FP, len(body), 0)


def test_attachments_travel_as_separate_frames_without_copies() -> None:
    tensor_bytes = bytes(range(256)) * 64
    scratch = bytearray(b"\x07" * 100)
    frames = wire.encode(SAMPLES["step_plan"], [tensor_bytes, scratch, memoryview(b"")])
    assert len(frames) == 4
    assert frames[1] is tensor_bytes  # bytes pass through untouched
    assert isinstance(frames[2], memoryview) and frames[2].obj is scratch
    assert len(frames[0]) < 1000  # the body never inlines the payload
    decoded = wire.decode(frames)
    assert decoded.message == SAMPLES["step_plan"]
    assert [bytes(a) for a in decoded.attachments] == [tensor_bytes, bytes(scratch), b""]
    assert decoded.attachments[0].obj is tensor_bytes  # zero-copy views of the received frames


def test_decoded_message_does_not_alias_the_frame() -> None:
    frame = bytearray(frame_bytes(SAMPLES["step_plan"]))
    decoded = wire.decode([frame])
    frame[wire.HEADER_SIZE :] = b"\x00" * (len(frame) - wire.HEADER_SIZE)
    assert decoded.message == SAMPLES["step_plan"]


def test_encode_refuses_non_messages_and_non_buffers() -> None:
    with pytest.raises(TypeError, match="TransferJob is not a wire message"):
        wire.encode(job(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="attachment 1 is a str"):
        wire.encode(SAMPLES["shutdown"], [b"ok", "text"])  # type: ignore[list-item]


def test_expect_checks_the_kind() -> None:
    decoded = wire.decode(wire.encode(SAMPLES["shutdown"]))
    assert decoded.expect(Shutdown) == SAMPLES["shutdown"]
    with pytest.raises(WireError, match="expected a StepPlan message, got Shutdown"):
        decoded.expect(StepPlan)


# -- header validation ---------------------------------------------------------------------------------


def test_no_frames() -> None:
    with pytest.raises(WireError, match="no frames"):
        wire.decode([])


@pytest.mark.parametrize("size", [0, 1, 23])
def test_truncated_header(size: int) -> None:
    frame = frame_bytes(SAMPLES["shutdown"])[:size]
    with pytest.raises(WireError, match=f"truncated header: frame 0 has {size} bytes, the header needs 24"):
        wire.decode([frame])


def test_bad_magic() -> None:
    frame = b"XXXX" + frame_bytes(SAMPLES["shutdown"])[4:]
    with pytest.raises(WireError, match=r"bad magic b'XXXX' \(expected b'KVOW'\)"):
        wire.decode([frame])


def test_other_major_is_a_schema_mismatch_naming_both_versions() -> None:
    body = codecs.encode(SAMPLES["step_plan"])
    frame = with_header(body, major=MAJOR + 1, minor=4)
    with pytest.raises(SchemaMismatchError) as info:
        wire.decode([frame])
    err = info.value
    assert isinstance(err, WireError)
    assert err.local_version == SCHEMA_VERSION
    assert err.remote_version == f"{MAJOR + 1}.4"
    assert SCHEMA_VERSION in str(err) and f"{MAJOR + 1}.4" in str(err)


def test_unknown_kind() -> None:
    frame = with_header(b"\x90", kind=200)
    with pytest.raises(WireError, match="unknown message kind 200"):
        wire.decode([frame])


def test_unknown_critical_flag_is_refused_and_advisory_flags_are_ignored() -> None:
    body = codecs.encode(SAMPLES["step_plan"])
    with pytest.raises(WireError, match="unsupported header flags 0x04"):
        wire.decode([with_header(body, flags=0x04)])
    assert wire.decode([with_header(body, flags=0x30)]).message == SAMPLES["step_plan"]


def test_truncated_body_and_stray_bytes() -> None:
    frame = frame_bytes(SAMPLES["step_plan"])
    body_len = len(frame) - wire.HEADER_SIZE
    with pytest.raises(WireError, match=f"truncated body: header announces {body_len} bytes, frame 0 holds"):
        wire.decode([frame[:-1]])
    with pytest.raises(WireError, match="frame 0 has 3 stray bytes after the"):
        wire.decode([frame + b"abc"])


def test_oversized_body() -> None:
    frame = frame_bytes(SAMPLES["step_plan"])
    with pytest.raises(WireError, match="exceeds max_body_bytes=16"):
        wire.decode([frame], max_body_bytes=16)
    # A lying header is refused before anything is read from the body.
    huge = with_header(b"", body_len=2**32 - 1)
    with pytest.raises(WireError, match="exceeds max_body_bytes"):
        wire.decode([huge])


def test_attachment_count_mismatch() -> None:
    frames = wire.encode(SAMPLES["shutdown"], [b"a", b"b"])
    with pytest.raises(WireError, match=r"header announces 2 attachment frame\(s\), received 1"):
        wire.decode(frames[:2])
    with pytest.raises(WireError, match=r"header announces 0 attachment frame\(s\), received 1"):
        wire.decode([frame_bytes(SAMPLES["shutdown"]), b"extra"])


def test_corrupted_body() -> None:
    with pytest.raises(WireError, match="corrupted StepPlan body from schema"):
        wire.decode([with_header(b"\xc1\xc1\xc1")])  # 0xc1 is never valid msgpack
    # Well-formed msgpack of the wrong shape: a WorkerReport body under the StepPlan kind.
    body = codecs.encode(SAMPLES["worker_report"])
    with pytest.raises(WireError, match="corrupted StepPlan body"):
        wire.decode([with_header(body)])
    # A packed int64 array whose length is not a multiple of 8.
    plan = SAMPLES["step_plan"]
    assert isinstance(plan, StepPlan)
    good = codecs.encode(plan)
    flush = plan.flush
    bad = good.replace(b"\xc4\x10" + flush, b"\xc4\x0f" + flush[:-1])
    assert bad != good
    # Packed arrays decode natively as bytes; their length is checked when they are viewed.
    decoded = wire.decode([with_header(bad)]).expect(StepPlan)
    with pytest.raises(WireError, match="multiple of 8"):
        unpack_int64(decoded.flush)


def test_frames_must_be_bytes_like() -> None:
    with pytest.raises(WireError, match="frame 0 is not a contiguous bytes-like object"):
        wire.decode(["text"])  # type: ignore[list-item]
    frames = wire.encode(SAMPLES["shutdown"], [b"x"])
    with pytest.raises(WireError, match="attachment frame 1 is not a contiguous bytes-like object"):
        wire.decode([frames[0], 42])  # type: ignore[list-item]


def test_header_to_bytes_refuses_values_that_do_not_fit() -> None:
    with pytest.raises(WireError, match="does not fit"):
        wire.Header(MAJOR, 256, 0, 1, LOCAL_FP, 0, 0).to_bytes()
    with pytest.raises(WireError, match="fingerprint must be 8 bytes, got 3"):
        wire.Header(MAJOR, MINOR, 0, 1, b"abc", 0, 0).to_bytes()


# -- the compatible path -------------------------------------------------------------------------------

FUTURE_MINOR = MINOR + 1
FUTURE_VERSION = f"{MAJOR}.{FUTURE_MINOR}"


_FLUSH_TIERS = (
    '{ name = "flush_tiers", type = "bool", default = false, since = "1.4", doc = "The host pool was reset: finish '
    'every tier job in flight before anything else this step (their host rows may be reused)." }'
)


def future_schema() -> MaterializedSchema:
    """The current schema plus a future minor's appended fields (each with `since` and a default)."""
    text = SCHEMA_TEXT.replace(f'version = "{SCHEMA_VERSION}"', f'version = "{FUTURE_VERSION}"', 1)
    since = f'since = "{FUTURE_VERSION}"'
    # Append after StepPlan's last field (flush_tiers, 1.4).
    text = text.replace(
        f"{_FLUSH_TIERS},",
        '{ name = "flush_tiers", type = "bool", default = false, since = "1.4", doc = "Reset." },\n'
        f'  {{ name = "priority", type = "int", default = 0, {since}, doc = "New in the future." }},\n'
        f'  {{ name = "tags", type = "list<str>", default = "empty", {since}, doc = "New too." }},',
    )
    text = text.replace(
        '{ name = "pid", type = "int", ge = 0, default = 0, doc = "Sender\'s process id, for diagnostics." },',
        '{ name = "pid", type = "int", ge = 0, default = 0, doc = "Pid." },\n'
        f'  {{ name = "hostname", type = "str", default = "", {since}, doc = "New in the future." }},',
    )
    schema = load_schema_text(text, file="future.toml")
    assert [f.name for f in schema.structs["StepPlan"].fields][-2:] == ["priority", "tags"]
    assert schema.structs["Hello"].fields[-1].name == "hostname"
    return materialize(schema)


def past_schema() -> MaterializedSchema:
    """The current schema as an older build that did not have StepPlan.flush (nor the later tier_jobs) yet."""
    text = (
        SCHEMA_TEXT.replace(
            '  { name = "flush", type = "array<int64>", default = "empty", doc = "Jobs to finish before this '
            "step's blocks are reused.\" },\n",
            "",
        )
        .replace(
            '  { name = "tier_jobs", type = "list<TierJob>", default = "empty", since = "1.3", doc = "Secondary-tier '
            'cascades and promotions to start (tiering)." },\n',
            "",
        )
        .replace(f"  {_FLUSH_TIERS},\n", "")
    )
    schema = load_schema_text(text, file="past.toml")
    assert "flush" not in {f.name for f in schema.structs["StepPlan"].fields}
    return materialize(schema)


def test_future_minor_with_extra_trailing_fields_decodes() -> None:
    future = future_schema()
    plan_cls = future.struct("StepPlan")
    job_cls = future.struct("TransferJob")
    current = SAMPLES["step_plan"]
    assert isinstance(current, StepPlan)
    jobs = tuple(job_cls(**msgspec.structs.asdict(j)) for j in current.load_jobs)
    newer = plan_cls(step=current.step, load_jobs=jobs, store_jobs=(), flush=current.flush, priority=9, tags=("a",))
    body = codecs.encode(newer)
    fingerprint = bytes.fromhex(future.schema.fingerprint)
    decoded = wire.decode([with_header(body, minor=FUTURE_MINOR, fingerprint=fingerprint)])
    assert decoded.compatible
    assert decoded.header.version == FUTURE_VERSION
    assert decoded.message == StepPlan(
        step=current.step, load_jobs=current.load_jobs, store_jobs=(), flush=current.flush
    )


def test_future_minor_hello_with_an_unknown_key_decodes() -> None:
    future = future_schema()
    hello = SAMPLES["hello"]
    newer = future.struct("Hello")(**msgspec.structs.asdict(hello), hostname="node-7")
    body = codecs.encode(newer)
    frame = with_header(body, minor=FUTURE_MINOR, kind=Hello.MESSAGE_ID, fingerprint=b"\xff" * 8)
    assert wire.decode([frame]).message == hello


def test_older_build_without_a_trailing_field_gets_the_default() -> None:
    past = past_schema()
    plan = past.struct("StepPlan")(step=3, load_jobs=(), store_jobs=())
    body = codecs.encode(plan)
    assert body == b"\x93\x03\x90\x90"  # three positions: step, load_jobs, store_jobs
    frame = with_header(body, fingerprint=bytes.fromhex(past.schema.fingerprint))
    decoded = wire.decode([frame])
    assert decoded.compatible
    assert decoded.message == StepPlan(step=3, load_jobs=(), store_jobs=(), flush=pack_int64([]))


def test_unknown_kind_from_a_future_minor_names_the_peer_version() -> None:
    frame = with_header(b"\x90", minor=FUTURE_MINOR, kind=99)
    with pytest.raises(WireError, match=f"unknown message kind 99 \\(peer schema {FUTURE_VERSION}"):
        wire.decode([frame])


# -- fuzzing: bad bytes give WireError or a complete, valid message ---------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID_FRAMES = [frame_bytes(m) for m in SAMPLES.values()]


def decode_or_wire_error(frames: Sequence[bytes]) -> None:
    """Decoding either raises WireError or returns a whole message that re-encodes to an equal one."""
    try:
        decoded = wire.decode(frames)
    except WireError:
        return
    msg = decoded.message
    assert type(msg) in MESSAGE_TYPES.values()
    again = wire.decode(wire.encode(msg, [bytes(a) for a in decoded.attachments]))
    assert again.message == msg


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    decode_or_wire_error([data])


@FUZZ
@given(st.sampled_from(range(len(SAMPLES))), st.binary(max_size=120))
def test_fuzz_random_body_under_a_valid_header(index: int, body: bytes) -> None:
    kind = list(SAMPLES.values())[index].MESSAGE_ID
    decode_or_wire_error([with_header(body, kind=kind)])


@FUZZ
@given(
    st.sampled_from(VALID_FRAMES),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(0, 10_000) | st.none(),
    st.binary(max_size=8),
)
def test_fuzz_mutated_valid_frames(frame: bytes, flips: list[tuple[int, int]], cut: int | None, tail: bytes) -> None:
    data = bytearray(frame)
    for position, value in flips:
        data[position % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    decode_or_wire_error([bytes(data) + tail])


@FUZZ
@given(
    st.sampled_from(VALID_FRAMES),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
)
def test_fuzz_mutated_bodies_with_a_consistent_header(frame: bytes, flips: list[tuple[int, int]]) -> None:
    """Corrupt only the body and keep the header honest, so msgspec sees the damage."""
    body = bytearray(frame[wire.HEADER_SIZE :])
    for position, value in flips:
        if body:
            body[position % len(body)] = value
    decode_or_wire_error([frame[: wire.HEADER_SIZE] + bytes(body)])


# -- handshake -----------------------------------------------------------------------------------------


def test_make_hello() -> None:
    hello = wire.make_hello("worker", 1, 2, "engine-0")
    assert hello.schema_version == SCHEMA_VERSION
    assert hello.fingerprint == SCHEMA_FINGERPRINT
    assert hello.role is PeerRole.WORKER
    assert (hello.rank, hello.world_size, hello.engine_id) == (1, 2, "engine-0")
    assert hello.pid > 0
    assert wire.make_hello(PeerRole.SCHEDULER, 0, 4, "e").role is PeerRole.SCHEDULER


def test_engine_id_of_a_snapshot_or_the_default() -> None:
    snapshot = load_snapshot(ROOT / "examples" / "llama-3.1-8b-tp2.json")
    assert wire.engine_id_of(snapshot) == "llama-8b-tp2-dp0"
    transfer = snapshot.engine_config.kv_transfer_config
    assert transfer is not None
    for unnamed in (None, msgspec.structs.replace(transfer, engine_id=None)):
        bare = msgspec.structs.replace(snapshot.engine_config, kv_transfer_config=unnamed)
        assert wire.engine_id_of(msgspec.structs.replace(snapshot, engine_config=bare)) == "kvoffload"
    assert wire.DEFAULT_ENGINE_ID == "kvoffload"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("boss", 0, 1, "e"), "role 'boss' is not one of"),
        (("worker", -1, 1, "e"), "rank must be an int >= 0"),
        (("worker", 0, 0, "e"), "world_size must be an int >= 1"),
        (("worker", 2, 2, "e"), "worker rank 2 is outside world_size 2"),
        (("worker", 0, 1, ""), "engine_id must be a non-empty str"),
    ],
)
def test_make_hello_validates(args: tuple[str, int, int, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wire.make_hello(*args)


def scheduler() -> Hello:
    return wire.make_hello("scheduler", 0, 2, "engine-0")


def worker(**changes: object) -> Hello:
    hello = wire.make_hello("worker", 1, 2, "engine-0")
    return msgspec.structs.replace(hello, **changes)


def test_check_hello_fast_and_compatible() -> None:
    result = wire.check_hello(scheduler(), worker())
    assert result.mode == "fast"
    assert result.remote_version == SCHEMA_VERSION
    newer = worker(schema_version=FUTURE_VERSION, fingerprint="0123456789abcdef")
    assert wire.check_hello(scheduler(), newer).mode == "compatible"
    # Same version string but another build of the schema: still only compatible.
    assert wire.check_hello(scheduler(), worker(fingerprint="fedcba9876543210")).mode == "compatible"


def test_check_hello_major_mismatch_names_both_versions() -> None:
    other = f"{MAJOR + 1}.0"
    with pytest.raises(SchemaMismatchError) as info:
        wire.check_hello(scheduler(), worker(schema_version=other, fingerprint="0" * 16))
    assert info.value.local_version == SCHEMA_VERSION
    assert info.value.remote_version == other
    assert SCHEMA_VERSION in str(info.value) and other in str(info.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"engine_id": "engine-1"}, "engine id mismatch: this process serves 'engine-0', peer 'engine-1'"),
        ({"role": PeerRole.SCHEDULER, "rank": 0}, "both peers are schedulers"),
        ({"world_size": 3}, "world size mismatch: this process expects 2, peer 3"),
        ({"schema_version": "one"}, "malformed schema version 'one'"),
    ],
)
def test_check_hello_refusals(changes: dict[str, object], message: str) -> None:
    with pytest.raises(WireError, match=message) as info:
        wire.check_hello(scheduler(), worker(**changes))
    assert not isinstance(info.value, SchemaMismatchError)


class Pipe:
    """One direction of an in-memory transport."""

    def __init__(self) -> None:
        self.queue: queue.Queue[list[bytes]] = queue.Queue()

    def send(self, frames: list[bytes]) -> None:
        assert all(type(f) is bytes for f in frames)
        self.queue.put(frames)

    def recv(self, timeout: float) -> list[bytes]:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"nothing within {timeout}s") from None


def test_handshake_between_two_threads_takes_the_fast_path() -> None:
    a_to_b, b_to_a = Pipe(), Pipe()
    results: dict[str, wire.HandshakeResult] = {}

    def run_worker() -> None:
        results["worker"] = wire.handshake(b_to_a.send, a_to_b.recv, worker(), timeout=5.0)

    thread = threading.Thread(target=run_worker)
    thread.start()
    results["scheduler"] = wire.handshake(a_to_b.send, b_to_a.recv, scheduler(), timeout=5.0)
    thread.join(5.0)
    assert results["scheduler"].mode == results["worker"].mode == "fast"
    assert results["scheduler"].remote.role is PeerRole.WORKER
    assert results["worker"].remote.role is PeerRole.SCHEDULER


def test_handshake_with_a_future_minor_is_compatible() -> None:
    future = future_schema()
    hello = worker(schema_version=FUTURE_VERSION, fingerprint=future.schema.fingerprint)
    remote = future.struct("Hello")(**msgspec.structs.asdict(hello), hostname="h")
    body = codecs.encode(remote)
    inbox = Pipe()
    fingerprint = bytes.fromhex(future.schema.fingerprint)
    inbox.send([with_header(body, minor=FUTURE_MINOR, kind=Hello.MESSAGE_ID, fingerprint=fingerprint)])
    sent: list[list[bytes]] = []
    result = wire.handshake(sent.append, inbox.recv, scheduler(), timeout=1.0)
    assert result.mode == "compatible"
    assert result.remote_version == FUTURE_VERSION
    assert wire.decode(sent[0]).message == scheduler()


def test_handshake_with_another_major_raises_schema_mismatch() -> None:
    inbox = Pipe()
    body = codecs.encode(worker())
    inbox.send([with_header(body, major=MAJOR + 1, minor=0, kind=Hello.MESSAGE_ID)])
    with pytest.raises(SchemaMismatchError) as info:
        wire.handshake(lambda frames: None, inbox.recv, scheduler(), timeout=1.0)
    assert info.value.remote_version == f"{MAJOR + 1}.0"


def test_handshake_refuses_other_messages_and_inconsistent_versions() -> None:
    inbox = Pipe()
    inbox.send([bytes(f) for f in wire.encode(Shutdown())])
    with pytest.raises(WireError, match="expected a Hello message, got Shutdown"):
        wire.handshake(lambda frames: None, inbox.recv, scheduler(), timeout=1.0)
    inbox.send([bytes(f) for f in wire.encode(worker(schema_version=FUTURE_VERSION))])
    with pytest.raises(WireError, match=f"peer Hello says schema {FUTURE_VERSION} but its envelope says"):
        wire.handshake(lambda frames: None, inbox.recv, scheduler(), timeout=1.0)


def test_handshake_timeout_comes_from_the_transport() -> None:
    with pytest.raises(TimeoutError):
        wire.handshake(lambda frames: None, Pipe().recv, scheduler(), timeout=0.01)


@pytest.mark.parametrize("version", ["²0", "².0", "1.²", "٣.1", "9" * 5000 + ".0", "1.0.0", " 1.0", ""])
def test_check_hello_malformed_versions_raise_wire_error(version: str) -> None:
    with pytest.raises(WireError, match="malformed schema version") as info:
        wire.check_hello(scheduler(), worker(schema_version=version))
    assert len(str(info.value)) < 200  # a 5000-digit version is shortened, not echoed whole


def test_library_raises_its_own_errors_for_bad_arguments() -> None:
    from kvoffload import ArgumentTypeError, Int32Array, ValueOverflowError

    with pytest.raises(ValueOverflowError, match="2147483648"):
        Int32Array([2**31])
    with pytest.raises(ArgumentTypeError, match="integers only"):
        Int32Array(["x"])  # type: ignore[list-item]
    with pytest.raises(ArgumentTypeError, match="not a wire message"):
        wire.encode(job(1))  # type: ignore[arg-type]
    with pytest.raises(WireError, match="attachments exceed"):
        wire.encode(Shutdown(), [b""] * 70000)
