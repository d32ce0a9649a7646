"""The checksummed copy loop: runs copied and sub-blocks hashed on the way, native kernel and pure Python.

Random jobs (sub-blocks with gaps or back to back, runs cut at random points and crossing sub-block ends, slot
bytes no run writes, runs past the last slot, scattered in engine memory, given in shuffled order): the native
job (hashing in the copy loop or after it, on one thread or in granules shared with helper threads, with
ordinary or streaming stores) and the pure-Python loop (random stretch sizes and share counts) must move
exactly the reference bytes and give each sub-block the xxh3_64 of its host bytes. Every native build this CPU
can run (baseline, AVX2, AVX-512F) is checked, not only the one the engine picks.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError
from kvoffload.offload.pool import BlockSlots
from kvoffload.offload.worker.copy import CopyRuns, _native
from kvoffload.offload.worker.copy import _cpu_loops as loops


@st.composite
def hashed_jobs(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]], int]:
    """``(slots as (host offset, size), runs as (engine offset, host offset, length), engine bytes)``."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    slots: list[tuple[int, int]] = []
    position = rng.randrange(0, 64)
    for _ in range(draw(st.integers(1, 8))):
        size = rng.choice([0, 1, 8, 240, 241, 1024, 1025, rng.randrange(1, 3000), rng.randrange(1, 40_000)])
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
        # now and then a piece no run copies: slot bytes the job does not write
        pieces.extend((x, y - x) for x, y in itertools.pairwise(cuts) if y > x and rng.random() > 0.05)
    if rng.random() < 0.2:  # a run past the last slot
        pieces.append((position + rng.randrange(0, 50), rng.randrange(1, 5000)))
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
    """Every native build this CPU can run, widest first; the engine's (the fastest measured) is one of them."""
    kernels = _native.load_kernels()
    assert native_kernel.path in {k.path for k in kernels}
    return kernels


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hashed_jobs(), st.sampled_from([1, 7, 64, 1000, 1 << 20]), st.integers(1, 3), st.booleans())
def test_copy_and_hash_matches_the_reference(
    native_kernels: list[_native.NativeKernel],
    helper_pools: list[_native.NativePool | None],
    job: tuple[list[tuple[int, int]], list[tuple[int, int, int]], int],
    stretch: int,
    parts: int,
    is_store: bool,
) -> None:
    slots, runs, engine_bytes = job
    host_bytes = max([first + size for first, size in slots] + [h + n for _, h, n in runs]) + 1
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
    # the pure-Python loop, in shares
    engine, host = engine0.clone(), host0.clone()
    shares = loops.hashed_parts(copy_runs, is_store, engine.data_ptr(), host.data_ptr(), block_slots, parts)
    assert sorted(i for share in shares for i in share.slot_ids.tolist()) == list(range(len(slots)))
    digests = [0] * len(slots)
    for share in shares:
        loops.copy_and_hash(share, memoryview(host.numpy()), digests, stretch)
    assert torch.equal(engine, want_engine) and torch.equal(host, want_host) and digests == want_digests
    # the native job: every build, hashed in the loop or after it, alone or in granules shared with helpers
    arrays = (copy_runs.engine_offsets.numpy(), copy_runs.host_offsets.numpy(), copy_runs.lengths.numpy())
    for kernel, flags, pool in itertools.product(native_kernels, _FLAG_SETS, helper_pools):
        engine, host = engine0.clone(), host0.clone()
        sums = np.zeros(len(slots), dtype=np.uint64)
        stats = np.zeros(len(_native.STATS), dtype=np.int64)
        kernel.job(
            pool,
            arrays,
            block_slots.arrays(),
            is_store=is_store,
            kv_base=engine.data_ptr(),
            host_base=host.data_ptr(),
            digests=sums,
            flags=flags,
            granule=min(stretch, 5000) if pool is not None else 0,
            stats=stats,
        )
        where = (kernel.path.name, flags, pool is not None)
        assert torch.equal(engine, want_engine) and torch.equal(host, want_host), where
        assert sums.tolist() == want_digests, where
        counts = dict(zip(_native.STATS, stats.tolist(), strict=True))
        moved = sum(counts[f"{who}_{kind}"] for who in ("caller", "helper") for kind in ("fused", "plain"))
        assert moved == sum(n for _, _, n in runs), (where, counts)
        # the same job without checksums moves the same bytes
        engine, host = engine0.clone(), host0.clone()
        kernel.job(
            pool,
            arrays,
            None,
            is_store=is_store,
            kv_base=engine.data_ptr(),
            host_base=host.data_ptr(),
            digests=None,
            flags=flags,
            granule=min(stretch, 5000) if pool is not None else 0,
        )
        assert torch.equal(engine, want_engine) and torch.equal(host, want_host), where


_FLAG_SETS = (0, _native.FUSED, _native.FUSED | _native.STREAM)


@pytest.fixture(scope="module")
def helper_pools() -> Iterator[list[_native.NativePool | None]]:
    """No pool (the calling thread alone) and pools of one and three helper threads."""
    kernel = _native.KERNEL
    pools = [kernel.pool(1), kernel.pool(3)] if kernel is not None else []
    yield [None, *pools]
    for pool in pools:
        if pool is not None:
            pool.close()


@pytest.mark.parametrize("is_store", [True, False])
def test_overlapping_runs_copy_in_host_order(native_kernels: list[_native.NativeKernel], is_store: bool) -> None:
    """Runs that overlap in host memory (two engine blocks into one sub-block, or one read twice): a store's
    last run in host order wins and each digest is that of the final host bytes; a load reads both."""
    rng = random.Random(7)
    slots = [(0, 2000), (2000, 5000), (7000, 40_000)]
    runs: list[tuple[int, int, int]] = []
    engine = 0
    for first, size in slots:
        for a, b in itertools.pairwise(sorted({first, first + size, rng.randrange(first, first + size)})):
            for offset in (0, 0, 5):  # the same bytes twice, and once more from 5 bytes in
                runs.append((engine, a + offset, b - a - offset))
                engine += b - a
    rng.shuffle(runs)
    order = sorted(range(len(runs)), key=lambda i: runs[i][1])  # stable: host order, then job order
    engine0 = np.random.default_rng(1).integers(0, 256, engine + 1, dtype=np.uint8)
    host0 = np.random.default_rng(2).integers(0, 256, 47_001, dtype=np.uint8)
    want_engine, want_host = engine0.copy(), host0.copy()
    for i in order:
        e, h, n = runs[i]
        if is_store:
            want_host[h : h + n] = engine0[e : e + n]
        else:
            want_engine[e : e + n] = host0[h : h + n]
    want = [xxhash.xxh3_64_intdigest(want_host[f : f + s].tobytes()) for f, s in slots]
    arrays = tuple(np.array(column, dtype=np.int64) for column in zip(*runs, strict=True))
    slot_arrays = tuple(np.array(column, dtype=np.int64) for column in zip(*slots, strict=True))
    pool = native_kernels[0].pool(2)
    try:
        for kernel, flags in itertools.product(native_kernels, _FLAG_SETS):
            engine_bytes, host_bytes = engine0.copy(), host0.copy()
            sums = np.zeros(len(slots), dtype=np.uint64)
            stats = np.zeros(len(_native.STATS), dtype=np.int64)
            kernel.job(
                pool,
                arrays,  # type: ignore[arg-type]
                slot_arrays,  # type: ignore[arg-type]
                is_store=is_store,
                kv_base=engine_bytes.ctypes.data,
                host_base=host_bytes.ctypes.data,
                digests=sums,
                flags=flags,
                granule=4096,
                stats=stats,
            )
            where = (kernel.path.name, flags)
            assert np.array_equal(engine_bytes, want_engine) and np.array_equal(host_bytes, want_host), where
            assert sums.tolist() == want, where
            mode = stats[_native.STATS.index("mode")]
            assert mode == (2 if is_store or not flags else 1), where  # a store: copied, then hashed
    finally:
        if pool is not None:
            pool.close()


def test_long_jobs_hash_in_the_copy_loop_and_share_granules(native_kernel: _native.NativeKernel) -> None:
    """A job of page-aligned 32 KB pages: (nearly) every byte is hashed in the copy loop, granules are cut at
    sub-block ends and taken by both threads, and the digests match."""
    page, layers, blocks = 32 << 10, 4, 64
    rng = np.random.default_rng(3)
    engine0 = rng.integers(0, 256, 2 * layers * blocks * page, dtype=np.uint8)
    host = np.zeros(layers * blocks * page, dtype=np.uint8)
    engine_blocks = rng.permutation(2 * blocks)[:blocks]
    runs = [
        (layer * 2 * blocks * page + int(b) * page, i * layers * page + layer * page, page)
        for layer in range(layers)
        for i, b in enumerate(engine_blocks)
    ]
    arrays = tuple(np.array(column, dtype=np.int64) for column in zip(*runs, strict=True))
    slot_first = np.arange(blocks, dtype=np.int64) * layers * page
    slot_size = np.full(blocks, layers * page, dtype=np.int64)
    pool = native_kernel.pool(1)
    assert pool is not None and pool.helpers == 1
    try:
        sums = np.zeros(blocks, dtype=np.uint64)
        stats = np.zeros(len(_native.STATS), dtype=np.int64)
        native_kernel.job(
            pool,
            arrays,  # type: ignore[arg-type]
            (slot_first, slot_size),
            is_store=True,
            kv_base=engine0.ctypes.data,
            host_base=host.ctypes.data,
            digests=sums,
            flags=_native.FUSED | _native.STREAM,
            granule=256 << 10,
            stats=stats,
        )
    finally:
        pool.close()
    counts = dict(zip(_native.STATS, stats.tolist(), strict=True))
    want = [xxhash.xxh3_64_intdigest(host[f : f + layers * page].tobytes()) for f in slot_first.tolist()]
    assert sums.tolist() == want
    fused = counts["caller_fused"] + counts["helper_fused"]
    total = layers * blocks * page
    if native_kernel.vector_width:
        assert fused >= total * 127 // 128  # all but the 1 KB tail of each 128 KB sub-block
    assert counts["granules"] == 32 and counts["caller_granules"] + counts["helper_granules"] == 32
    assert counts["mode"] == 1 and counts["participants"] == 2


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


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32), st.booleans())
def test_block_jobs_build_the_runs_of_the_reference(
    native_kernels: list[_native.NativeKernel], helper_pools: list[_native.NativePool | None], seed: int, is_store: bool
) -> None:
    """Jobs given as blocks (the engine's fast path): the kernel builds each block's runs from its group's
    segments (merging runs that continue each other) and hashes its sub-block; a sub-block named twice in a
    store keeps the later block's bytes, as the run path does."""
    rng = random.Random(seed)
    num_blocks, slot = 24, 4096
    groups = []  # per group: (engine offset, engine block stride, length, offset in the sub-block) rows
    engine_bytes = 0
    for _ in range(rng.randint(1, 3)):
        cuts = sorted(rng.sample(range(1, slot), rng.randint(1, 6)))
        segments, start = [], 0
        for a, b in itertools.pairwise([0, *cuts]):
            if rng.random() < 0.8:
                segments.append((a, b - a))
        rows = []
        for host_offset, length in segments:
            stride = rng.choice([length, length + rng.randrange(0, 64)])  # pages back to back, or with gaps
            rows.append((engine_bytes, stride, length, host_offset))
            engine_bytes += stride * num_blocks + rng.randrange(0, 64)
        groups.append(rows)
        start += 1
    seg_start = np.cumsum([0] + [len(g) for g in groups], dtype=np.int64)
    segs = np.array([r for g in groups for r in g] or np.zeros((0, 4)), dtype=np.int64).reshape(-1, 4)
    group_bytes = np.array([max((h + n for _, _, n, h in g), default=0) for g in groups], dtype=np.int64)
    layout = _native.NativeLayout(
        seg_start, segs, group_bytes, (seg_start.ctypes.data, segs.ctypes.data, group_bytes.ctypes.data)
    )
    n = rng.randint(1, 20)
    job_groups = np.array([rng.randrange(len(groups)) for _ in range(n)], dtype=np.int64)
    # a store may read an engine block twice; a load writes each once (which of two writes lands is up to the
    # threads sharing the job)
    picks = rng.sample(range(num_blocks), n) if not is_store else [rng.randrange(num_blocks) for _ in range(n)]
    engine_blocks = np.array(picks, dtype=np.int64)
    chunks = [rng.randrange(12) for _ in range(n)]
    if n > 1 and rng.random() < 0.3:
        chunks[-1] = chunks[0]  # the same sub-block twice
    host_blocks = np.array([c * slot for c in chunks], dtype=np.int64)
    engine0 = np.random.default_rng(seed).integers(0, 256, engine_bytes + 1, dtype=np.uint8)
    host0 = np.random.default_rng(seed + 1).integers(0, 256, 12 * slot, dtype=np.uint8)
    want_engine, want_host = engine0.copy(), host0.copy()
    for i in sorted(range(n), key=lambda i: host_blocks[i]):  # host order, then job order
        for e, stride, length, h in groups[job_groups[i]]:
            e, h = e + stride * engine_blocks[i], host_blocks[i] + h
            if is_store:
                want_host[h : h + length] = engine0[e : e + length]
            else:
                want_engine[e : e + length] = host0[h : h + length]
    want = [
        xxhash.xxh3_64_intdigest(want_host[h : h + group_bytes[g]].tobytes())
        for g, h in zip(job_groups.tolist(), host_blocks.tolist(), strict=True)
    ]
    for kernel, flags, pool in itertools.product(native_kernels, _FLAG_SETS, helper_pools):
        engine, host = engine0.copy(), host0.copy()
        sums = np.zeros(n, dtype=np.uint64)
        kernel.job_blocks(
            pool,
            layout,
            (job_groups, engine_blocks, host_blocks),
            is_store=is_store,
            kv_base=engine.ctypes.data,
            host_base=host.ctypes.data,
            digests=sums,
            flags=flags,
            granule=4096 if pool is not None else 0,
        )
        where = (kernel.path.name, flags, pool is not None)
        assert np.array_equal(engine, want_engine) and np.array_equal(host, want_host), where
        assert sums.tolist() == want, where


def test_the_fastest_measured_kernel_is_picked_and_a_tie_goes_to_the_narrower_build(
    native_kernels: list[_native.NativeKernel],
) -> None:
    """The widest build is not the fastest on every CPU: the pick follows the measurement."""
    if len(native_kernels) < 2:
        pytest.skip("one kernel build for this CPU")
    wide, narrow = native_kernels[0], native_kernels[-1]
    times = [1.0] * len(native_kernels)
    times[-1] = 0.5
    assert _native.pick_kernel(native_kernels, times) is narrow
    times = [0.5] + [1.0] * (len(native_kernels) - 1)
    assert _native.pick_kernel(native_kernels, times) is wide
    assert _native.pick_kernel(native_kernels, [1.0] * len(native_kernels)) is narrow
    with pytest.raises(ConfigError, match="one time per kernel"):
        _native.pick_kernel(native_kernels, [1.0])


def test_load_kernel_measures_every_build_or_takes_the_one_named(
    native_kernels: list[_native.NativeKernel], monkeypatch: pytest.MonkeyPatch
) -> None:
    for kernel in native_kernels:
        assert _native.measure_kernel(kernel, nbytes=256 << 10, repeats=2) > 0
    picked = _native.load_kernel()
    assert picked is not None and picked.path in {k.path for k in native_kernels}
    for kernel in native_kernels:
        monkeypatch.setenv(_native.KERNEL_ENV, _native.kernel_name(kernel))
        named = _native.load_kernel()
        assert named is not None and named.path == kernel.path
    monkeypatch.setenv(_native.KERNEL_ENV, "sse9")
    with pytest.raises(ConfigError, match="KVOFFLOAD_COPY_KERNEL='sse9' is not a kernel built for this CPU"):
        _native.load_kernel()
