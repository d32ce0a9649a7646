"""The checksummed copy loop: runs copied and sub-blocks hashed in stretches, native kernel and pure Python.

Random jobs (sub-blocks with gaps or back to back, runs cut at random points and crossing sub-block ends,
scattered in engine memory, given in shuffled order), random stretch sizes and share counts: both loops must
move exactly the reference bytes and give each sub-block the xxh3_64 of its host bytes.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.offload.pool import BlockSlots
from kvoffload.offload.worker.copy import CopyRuns, _native
from kvoffload.offload.worker.copy import _cpu as cpu


@st.composite
def hashed_jobs(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]], int]:
    """``(slots as (host offset, size), runs as (engine offset, host offset, length), engine bytes)``."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    slots: list[tuple[int, int]] = []
    position = rng.randrange(0, 64)
    for _ in range(draw(st.integers(1, 8))):
        size = rng.choice([0, 1, 8, rng.randrange(1, 3000)])
        slots.append((position, size))
        position += size + rng.choice([0, 0, rng.randrange(1, 100)])
    # runs cover every slot byte; a cut may fall anywhere, so runs cross the ends of back-to-back slots
    covered = sorted({(first, first + size) for first, size in slots if size})
    merged: list[list[int]] = []
    for a, b in covered:
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    pieces: list[tuple[int, int]] = []
    for a, b in merged:
        cuts = sorted({a, b, *(rng.randrange(a, b) for _ in range(rng.randrange(0, 4)))})
        pieces.extend((x, y - x) for x, y in itertools.pairwise(cuts) if y > x)
    rng.shuffle(pieces)  # engine order differs from host order
    runs: list[tuple[int, int, int]] = []
    engine = 0
    for host, length in pieces:
        engine += rng.randrange(0, 50)
        runs.append((engine, host, length))
        engine += length
    rng.shuffle(runs)
    order = list(range(len(slots)))
    rng.shuffle(order)
    return [slots[i] for i in order], runs, engine + 1


def _job(slots: list[tuple[int, int]], runs: list[tuple[int, int, int]]) -> tuple[CopyRuns, BlockSlots]:
    ids = [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]
    copy_runs = CopyRuns(*(torch.tensor(x, dtype=torch.int64).reshape(-1) for x in ids), sum(ids[2]))
    none = np.zeros(len(slots), dtype=np.int64)
    return copy_runs, BlockSlots(none, none, [s[0] for s in slots], [s[1] for s in slots], none)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hashed_jobs(), st.sampled_from([1, 7, 64, 1000, 1 << 20]), st.integers(1, 3), st.booleans())
def test_copy_and_hash_matches_the_reference(
    native_kernel: _native.NativeKernel,
    job: tuple[list[tuple[int, int]], list[tuple[int, int, int]], int],
    stretch: int,
    parts: int,
    is_store: bool,
) -> None:
    slots, runs, engine_bytes = job
    host_bytes = max(first + size for first, size in slots) + 1
    gen = torch.Generator().manual_seed(len(runs) * 7919 + stretch)
    engine0 = torch.randint(0, 256, (engine_bytes,), dtype=torch.uint8, generator=gen)
    host0 = torch.randint(0, 256, (host_bytes,), dtype=torch.uint8, generator=gen)
    want_engine, want_host = engine0.clone(), host0.clone()
    for e, h, n in runs:
        if is_store:
            want_host[h : h + n] = engine0[e : e + n]
        else:
            want_engine[e : e + n] = host0[h : h + n]
    want_digests = [xxhash.xxh3_64_intdigest(want_host[f : f + s].numpy().tobytes()) for f, s in slots]
    copy_runs, block_slots = _job(slots, runs)
    for native in (True, False):
        engine, host = engine0.clone(), host0.clone()
        shares = cpu._hashed_parts(copy_runs, is_store, engine.data_ptr(), host.data_ptr(), block_slots, parts)
        assert sorted(i for share in shares for i in share.slot_ids.tolist()) == list(range(len(slots)))
        if native:
            sums = np.zeros(len(slots), dtype=np.uint64)
            for share in shares:
                cpu._native_copy_and_hash(native_kernel, share, host.data_ptr(), sums, stretch)
            digests = sums.tolist()
        else:
            digests = [0] * len(slots)
            for share in shares:
                cpu._copy_and_hash(share, memoryview(host.numpy()), digests, stretch)
        assert torch.equal(engine, want_engine) and torch.equal(host, want_host), f"native={native}"
        assert digests == want_digests, f"native={native}"


def test_kernel_refuses_unsorted_input_without_copying(native_kernel: _native.NativeKernel) -> None:
    kernel = native_kernel
    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    base = dst.ctypes.data
    runs = tuple(np.array(v, dtype=np.int64) for v in ([base + 8, base], [src.ctypes.data] * 2, [4, 4], [8, 0]))
    slots = tuple(np.array(v, dtype=np.int64) for v in ([0], [16], [0]))
    with pytest.raises(ValueError, match="not sorted"):
        kernel.copy_hash(runs, slots, 64, base, np.zeros(1, dtype=np.uint64))  # type: ignore[arg-type]
    assert not dst.any()
    with pytest.raises(ValueError, match="digest indices"):
        bad = (slots[0], slots[1], np.array([3], dtype=np.int64))
        kernel.copy_hash(runs, bad, 64, base, np.zeros(1, dtype=np.uint64))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int64"):
        kernel.copy(np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))


def test_kernel_hash_is_xxh3_64(native_kernel: _native.NativeKernel) -> None:
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    for size in (0, 1, 16, 17, 240, 241, 1024, 100_003):
        assert native_kernel.xxh3_64(data.ctypes.data, size) == xxhash.xxh3_64_intdigest(data[:size].tobytes())
