"""Write the golden wire frames of the current schema version: run once when a version is released.

    python tests/golden/make_golden.py            # writes tests/golden/<version>/ (refuses to overwrite)
    python tests/golden/make_golden.py --out DIR  # writes DIR/<version>/ (tests check it is reproducible)

Each version directory holds `manifest.json` (schema version, fingerprint, and per message: name, type,
kind, frame files and the message as JSON) and the frames as `<name>.<index>.bin`. Golden directories are
frozen like `schema/history/`: later code must keep decoding them (tests/test_wire_versions.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvoffload import (
    SCHEMA_FINGERPRINT,
    SCHEMA_VERSION,
    BlockRemoved,
    BlockStored,
    Hello,
    JobResult,
    KVEventBatch,
    Medium,
    PeerRole,
    Shutdown,
    StepPlan,
    TransferJob,
    WorkerReport,
    codecs,
    wire,
)
from kvoffload._generated import Heartbeat, TierJob, TierJobResult, WorkerFailure
from kvoffload._generated.types import Message
from kvoffload._packed import pack_int32, pack_int64

HERE = Path(__file__).resolve().parent


def _job(job_id: int, blocks: int, *, sync: bool = False) -> TransferJob:
    return TransferJob(
        job_id=job_id,
        req_id=f"cmpl-{job_id:04d}",
        group_sizes=pack_int32([blocks - 1, 1]),
        block_indices=pack_int32([0, 7]),
        block_ids=pack_int64(range(1000 + job_id, 1000 + job_id + blocks)),
        chunk_ids=pack_int64([2**33 + job_id, -1]),
        sync=sync,
        chunk_tags=pack_int64([-(2**63) + job_id, 2**63 - 1]),
    )


def golden_messages() -> list[tuple[str, Message, list[bytes]]]:
    """The messages frozen for this version: every kind, with defaults, edge values and attachments."""
    return [
        (
            "hello",
            Hello(
                schema_version=SCHEMA_VERSION,
                fingerprint=SCHEMA_FINGERPRINT,
                role=PeerRole.SCHEDULER,
                rank=0,
                world_size=4,
                engine_id="engine-golden",
                pid=4242,
            ),
            [],
        ),
        (
            "step_plan",
            StepPlan(
                step=2**40,
                load_jobs=(_job(1, 4, sync=True),),
                store_jobs=(_job(2, 3), _job(3, 1)),
                flush=pack_int64([7, 8]),
                tier_jobs=(
                    TierJob(job_id=0, tier=1, is_promotion=True, keys=(b"k" * 36,), chunk_ids=pack_int64([5])),
                    TierJob(job_id=1, tier=0, is_promotion=False, keys=(), chunk_ids=pack_int64([])),
                ),
            ),
            [],
        ),
        ("step_plan_defaults", StepPlan(step=0, load_jobs=(), store_jobs=()), []),
        (
            "step_plan_attachments",
            StepPlan(step=5, load_jobs=(), store_jobs=(_job(4, 2),)),
            [b"\x01\x02\x03", b""],
        ),
        (
            "worker_report",
            WorkerReport(
                rank=3,
                step=99,
                results=(
                    JobResult(job_id=1, success=True, is_store=False, num_bytes=2**36, seconds=0.125),
                    JobResult(job_id=2, success=False, is_store=True, num_bytes=0, seconds=0.0),
                    JobResult(
                        job_id=3,
                        success=False,
                        is_store=False,
                        num_bytes=0,
                        seconds=0.5,
                        error="chunk 9 failed its checksum",
                        corrupt_chunk_ids=pack_int64([9]),
                    ),
                ),
                tier_results=(TierJobResult(job_id=0, failed=pack_int32([0]), num_bytes=4096, seconds=0.25),),
            ),
            [],
        ),
        ("worker_failure", WorkerFailure(rank=1, error_type="ConfigError", message="bad layout", step=7), []),
        ("heartbeat", Heartbeat(rank=2, seq=2**40), []),
        ("shutdown", Shutdown(reason="tests are done"), []),
        (
            "kv_event_batch",
            KVEventBatch(
                seq=41,
                engine_id="engine-golden",
                ts=1234.5,
                events=(
                    BlockStored(
                        block_hashes=(bytes(range(16)),),
                        parent_block_hash=None,
                        token_ids=pack_int32([1, 2, 3, -4]),
                        block_size=4,
                        group_idx=2,
                        medium=Medium.STORAGE,
                    ),
                    BlockStored(block_hashes=(b"\xff" * 4,)),
                    BlockStored(  # self-describing (1.6): every block's hash, LoRA, the group's spec kind
                        block_hashes=(b"\x10" * 32, b"\x11" * 32),
                        parent_block_hash=b"\x0f" * 32,
                        token_ids=pack_int32(range(32)),
                        block_size=16,
                        group_idx=1,
                        lora_id=7,
                        lora_name="adapter-golden",
                        kv_cache_spec_kind="sliding_window",
                        kv_cache_spec_sliding_window=128,
                    ),
                    BlockRemoved(block_hashes=(b"\x00" * 4, b"\x01" * 4), group_idx=1),
                ),
            ),
            [],
        ),
    ]


def write(root: Path) -> Path:
    """Write the golden directory of the current version under `root`; refuses an existing one."""
    out = root / SCHEMA_VERSION
    if out.exists():
        raise FileExistsError(f"{out} exists: released golden frames are frozen (never rewritten)")
    out.mkdir(parents=True)
    manifest: dict[str, object] = {"schema_version": SCHEMA_VERSION, "fingerprint": SCHEMA_FINGERPRINT}
    entries = []
    for name, msg, attachments in golden_messages():
        frames = wire.encode(msg, attachments)
        files = []
        for index, frame in enumerate(frames):
            file = f"{name}.{index}.bin"
            (out / file).write_bytes(bytes(frame))
            files.append(file)
        entries.append(
            {
                "name": name,
                "type": type(msg).__name__,
                "kind": type(msg).MESSAGE_ID,
                "frames": files,
                "json": json.loads(codecs.encode(msg, format="json")),
            }
        )
    manifest["messages"] = entries
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the golden wire frames of the current schema version.")
    parser.add_argument("--out", type=Path, default=HERE, help="parent directory (default: tests/golden)")
    args = parser.parse_args(argv)
    try:
        out = write(args.out)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
