"""Wire benchmark: encode + decode round trip of a StepPlan, ours vs pickle vs msgspec lists vs memcpy.

Plain script (`python benchmarks/wire.py [--quick]`). Two plans: 64 jobs x 128 blocks and 64 jobs x 16
blocks (half loads, half stores; 4 engine blocks per host chunk). Every contender moves the same values:

- ours:      `kvoffload.wire.encode` / `decode` (envelope + generated msgpack codec, packed int arrays)
- pickle:    pickle protocol 5 of equivalent frozen dataclasses holding `list[int]`
- msgspec:   msgspec msgpack of equivalent array-like frozen Structs holding `list[int]`
- raw body:  our exact body decoded by bare msgspec Structs with `bytes` fields, no envelope: what
             msgspec alone costs for these bytes; the gap to ours is the envelope (header checks, frames)
- memcpy:    one copy of our encoded frame, the floor of any serialization

Times are the best per-iteration time over interleaved repeats of one run (the machine is shared, so
the minimum is the least noisy estimate); ratios are measured side by side in the same run.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvoffload import StepPlan, TransferJob, wire
from kvoffload._packed import pack_int32, pack_int64, unpack_int32, unpack_int64

BLOCKS_PER_CHUNK = 4
TARGET = 15.0


@dataclass(frozen=True)
class PickleJob:
    """TransferJob as a frozen dataclass with Python lists."""

    job_id: int
    req_id: str
    group_sizes: list[int]
    block_indices: list[int]
    block_ids: list[int]
    chunk_ids: list[int]
    sync: bool = False


@dataclass(frozen=True)
class PicklePlan:
    """StepPlan as a frozen dataclass with Python lists."""

    step: int
    load_jobs: list[PickleJob]
    store_jobs: list[PickleJob]
    flush: list[int]


class ListJob(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """TransferJob as a msgspec Struct with `list[int]` fields."""

    job_id: int
    req_id: str
    group_sizes: list[int]
    block_indices: list[int]
    block_ids: list[int]
    chunk_ids: list[int]
    sync: bool = False


class ListPlan(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """StepPlan as a msgspec Struct with `list[int]` fields."""

    step: int
    load_jobs: list[ListJob]
    store_jobs: list[ListJob]
    flush: list[int] = []


class RawJob(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """TransferJob with its packed arrays left as raw little-endian `bytes`."""

    job_id: int
    req_id: str
    group_sizes: bytes
    block_indices: bytes
    block_ids: bytes
    chunk_ids: bytes
    sync: bool = False
    chunk_tags: bytes = b""


class RawPlan(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """StepPlan with its packed arrays left as raw `bytes`."""

    step: int
    load_jobs: tuple[RawJob, ...]
    store_jobs: tuple[RawJob, ...]
    flush: bytes = b""
    tier_jobs: tuple[msgspec.Raw, ...] = ()


def make_plan(num_jobs: int, blocks: int) -> StepPlan:
    """A realistic plan: block ids in the 100k range, chunk ids in the 1M range, one group per job."""
    jobs = []
    for i in range(num_jobs):
        first = 100_000 + i * blocks
        chunks = blocks // BLOCKS_PER_CHUNK
        jobs.append(
            TransferJob(
                job_id=10_000 + i,
                req_id=f"cmpl-{i:08x}-0",
                group_sizes=pack_int32([blocks]),
                block_indices=pack_int32([i % 7]),
                block_ids=pack_int64(range(first, first + blocks)),
                chunk_ids=pack_int64(range(1_000_000 + i * chunks, 1_000_000 + (i + 1) * chunks)),
                sync=i % 5 == 0,
            )
        )
    half = num_jobs // 2
    return StepPlan(step=4242, load_jobs=tuple(jobs[:half]), store_jobs=tuple(jobs[half:]))


def as_pickle(plan: StepPlan) -> PicklePlan:
    def job(j: TransferJob) -> PickleJob:
        return PickleJob(
            j.job_id, j.req_id, unpack_int32(j.group_sizes), unpack_int32(j.block_indices), unpack_int64(j.block_ids),
            unpack_int64(j.chunk_ids), j.sync,
        )  # fmt: skip

    return PicklePlan(plan.step, [job(j) for j in plan.load_jobs], [job(j) for j in plan.store_jobs], [])


def as_lists(plan: StepPlan) -> ListPlan:
    def job(j: TransferJob) -> ListJob:
        return ListJob(
            job_id=j.job_id, req_id=j.req_id, group_sizes=unpack_int32(j.group_sizes),
            block_indices=unpack_int32(j.block_indices), block_ids=unpack_int64(j.block_ids),
            chunk_ids=unpack_int64(j.chunk_ids), sync=j.sync,
        )  # fmt: skip

    return ListPlan(step=plan.step, load_jobs=[job(j) for j in plan.load_jobs],
                    store_jobs=[job(j) for j in plan.store_jobs])  # fmt: skip


@dataclass
class Contender:
    """One way to ship the plan: encode -> bytes-ish, decode -> object, and the encoded size."""

    name: str
    encode: Callable[[], object]
    decode: Callable[[], object]
    roundtrip: Callable[[], object]
    size: int
    best: dict[str, float]


def measure(contenders: list[Contender], repeats: int, inner: int) -> None:
    """Interleave contenders and phases; keep the best per-iteration time in microseconds."""
    for _ in range(repeats):
        for c in contenders:
            for phase, fn in (("encode", c.encode), ("decode", c.decode), ("roundtrip", c.roundtrip)):
                start = time.perf_counter_ns()
                for _ in range(inner):
                    fn()
                elapsed = (time.perf_counter_ns() - start) / inner / 1000
                c.best[phase] = min(c.best.get(phase, float("inf")), elapsed)


def contenders_for(plan: StepPlan) -> list[Contender]:
    frames = wire.encode(plan)
    frame = bytes(frames[0])
    decoded = wire.decode([frame]).message
    if decoded != plan:
        raise SystemExit("ours: the round trip changed the plan")

    pplan = as_pickle(plan)
    pbytes = pickle.dumps(pplan, protocol=5)
    if pickle.loads(pbytes) != pplan:
        raise SystemExit("pickle: the round trip changed the plan")

    lplan = as_lists(plan)
    lenc = msgspec.msgpack.Encoder()
    ldec = msgspec.msgpack.Decoder(ListPlan)
    lbytes = lenc.encode(lplan)
    if ldec.decode(lbytes) != lplan:
        raise SystemExit("msgspec lists: the round trip changed the plan")

    body = frame[wire.HEADER_SIZE :]
    renc = msgspec.msgpack.Encoder()
    rdec = msgspec.msgpack.Decoder(RawPlan)
    rplan = rdec.decode(body)
    if renc.encode(rplan) != body:
        raise SystemExit("raw body: the round trip changed the bytes")

    encode, decode = wire.encode, wire.decode
    dumps, loads = pickle.dumps, pickle.loads
    return [
        Contender(
            "ours (wire)",
            lambda: encode(plan),
            lambda: decode([frame]),
            lambda: decode(encode(plan)),
            len(frame),
            {},
        ),
        Contender(
            "pickle p5 + lists",
            lambda: dumps(pplan, protocol=5),
            lambda: loads(pbytes),
            lambda: loads(dumps(pplan, protocol=5)),
            len(pbytes),
            {},
        ),
        Contender(
            "msgspec + lists",
            lambda: lenc.encode(lplan),
            lambda: ldec.decode(lbytes),
            lambda: ldec.decode(lenc.encode(lplan)),
            len(lbytes),
            {},
        ),
        Contender(
            "raw body (bytes)",
            lambda: renc.encode(rplan),
            lambda: rdec.decode(body),
            lambda: rdec.decode(renc.encode(rplan)),
            len(body),
            {},
        ),
        Contender(
            "memcpy floor",
            lambda: bytearray(frame),
            lambda: bytearray(frame),
            lambda: bytearray(frame),
            len(frame),
            {},
        ),
    ]


def report(title: str, contenders: list[Contender]) -> float:
    """Print one table; returns pickle / ours for the round trip."""
    ours = contenders[0].best["roundtrip"]
    print(f"\n{title}")
    print(f"{'contender':<20} {'encode us':>10} {'decode us':>10} {'round us':>10} {'bytes':>9} {'x ours':>8}")
    for c in contenders:
        ratio = c.best["roundtrip"] / ours
        print(
            f"{c.name:<20} {c.best['encode']:>10.1f} {c.best['decode']:>10.1f} {c.best['roundtrip']:>10.1f} "
            f"{c.size:>9} {ratio:>7.2f}x"
        )
    by_name = {c.name: c.best["roundtrip"] for c in contenders}
    pickle_ratio = by_name["pickle p5 + lists"] / ours
    print(
        f"ours is {pickle_ratio:.1f}x faster than pickle, "
        f"{by_name['msgspec + lists'] / ours:.1f}x faster than msgspec lists, "
        f"{ours / by_name['memcpy floor']:.1f}x the memcpy floor"
    )
    return pickle_ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = parser.parse_args()
    repeats, inner = (3, 20) if args.quick else (15, 100)
    print(f"python {sys.version.split()[0]}, msgspec {msgspec.__version__}, repeats={repeats} x {inner}")
    ratios = {}
    for jobs, blocks in ((64, 128), (64, 16)):
        contenders = contenders_for(make_plan(jobs, blocks))
        measure(contenders, repeats, inner)
        ratios[(jobs, blocks)] = report(f"StepPlan {jobs} jobs x {blocks} blocks", contenders)
    ratio = ratios[(64, 128)]
    verdict = "met" if ratio >= TARGET else "NOT met"
    print(f"\ntarget: ours >= {TARGET:.0f}x faster than pickle on 64 x 128: {verdict} ({ratio:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
