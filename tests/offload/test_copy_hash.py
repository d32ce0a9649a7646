"""The checksummed copy loop: runs copied and sub-blocks hashed in stretches, native kernel and pure Python.

Random jobs (sub-blocks with gaps or back to back, runs cut at random points and crossing sub-block ends,
scattered in engine memory, given in shuffled order), random stretch sizes and share counts: both loops must
move exactly the reference bytes and give each sub-block the xxh3_64 of its host bytes. Every native build
this CPU can run (baseline, AVX2, AVX-512F) is checked, not only the one the engine picks.
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


@pytest.fixture
def native_kernels(native_kernel: _native.NativeKernel) -> list[_native.NativeKernel]:
    """Every native build this CPU can run, widest (the engine's) first."""
    kernels = _native.load_kernels()
    assert kernels[0].path == native_kernel.path
    return kernels


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hashed_jobs(), st.sampled_from([1, 7, 64, 1000, 1 << 20]), st.integers(1, 3), st.booleans())
def test_copy_and_hash_matches_the_reference(
    native_kernels: list[_native.NativeKernel],
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
    for kernel in [*native_kernels, None]:
        engine, host = engine0.clone(), host0.clone()
        shares = cpu._hashed_parts(copy_runs, is_store, engine.data_ptr(), host.data_ptr(), block_slots, parts)
        assert sorted(i for share in shares for i in share.slot_ids.tolist()) == list(range(len(slots)))
        if kernel is not None:
            sums = np.zeros(len(slots), dtype=np.uint64)
            for share in shares:
                cpu._native_copy_and_hash(kernel, share, host.data_ptr(), sums, stretch)
            digests = sums.tolist()
        else:
            digests = [0] * len(slots)
            for share in shares:
                cpu._copy_and_hash(share, memoryview(host.numpy()), digests, stretch)
        where = kernel.path.name if kernel is not None else "python"
        assert torch.equal(engine, want_engine) and torch.equal(host, want_host), where
        assert digests == want_digests, where


@pytest.mark.parametrize("size", [0, 1, 240, 241, 1023, 1024, 1025, 2048, 2049, 4159, 65536, 131073, 300_000])
def test_long_slots_hash_like_xxh3_at_every_stretch(native_kernels: list[_native.NativeKernel], size: int) -> None:
    """One slot copied in stretches that end inside, on and across xxh3's 64-byte stripes and 1 KB blocks:
    the kernel's block-by-block hash gives XXH3_64bits's digest."""
    src = np.random.default_rng(size).integers(0, 256, size + 16, dtype=np.uint8)
    want = xxhash.xxh3_64_intdigest(src[3 : 3 + size].tobytes())
    for kernel in native_kernels:
        for stretch in (1, 63, 64, 1000, 1024, 1088, 4096, 1 << 20):
            dst = np.zeros(size + 16, dtype=np.uint8)
            base = dst.ctypes.data
            runs = tuple(np.array([v], dtype=np.int64) for v in (base + 5, src.ctypes.data + 3, size, 5))
            slots = tuple(np.array([v], dtype=np.int64) for v in (5, size, 0))
            sums = np.zeros(1, dtype=np.uint64)
            kernel.copy_hash(runs, slots, stretch, base, sums)  # type: ignore[arg-type]
            assert int(sums[0]) == want, (kernel.path.name, stretch)
            assert bytes(dst[5 : 5 + size]) == bytes(src[3 : 3 + size]), (kernel.path.name, stretch)


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


def test_kernel_hash_is_xxh3_64(native_kernels: list[_native.NativeKernel]) -> None:
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    for kernel in native_kernels:
        for size in (0, 1, 16, 17, 240, 241, 1024, 100_003):
            assert kernel.xxh3_64(data.ctypes.data, size) == xxhash.xxh3_64_intdigest(data[:size].tobytes())


def test_native_copy_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_NATIVE_COPY", "0")
    assert _native.load_kernels() == []
    assert _native.load_kernel() is None
