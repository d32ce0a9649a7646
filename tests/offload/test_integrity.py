"""Integrity of host chunks: key tags and checksums are sealed by stores and verified by loads.

A flipped byte, a chunk holding another key, or a chunk no completed store wrote must fail the load with
the chunk ids named, for private and shared pools, whole and partial chunks, with checksums on or off.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import JobResult
from kvoffload._packed import unpack_int64
from kvoffload.offload.keys import key_tag
from kvoffload.offload.pool import HostPool, HostPoolPlan, plan_host_pool
from kvoffload.offload.pool._integrity import SEALED, TAGGED
from kvoffload.offload.worker.copy import (
    CopyEngine,
    TransferLayout,
    build_block_slots,
    build_transfer_layout,
)
from tests.helpers import Placement

pytestmark = pytest.mark.usefixtures("copy_path")  # every test runs on the native and the pure-Python path

PAGE = 64
BLOCKS = 16
# group 0: layers a, b (2 x 64 bytes per block); group 1: layer c (32 bytes per block); host slot 128 bytes
WKB = 2 * PAGE
TOTAL = 2 * BLOCKS * PAGE + BLOCKS * 32


def _layout() -> TransferLayout:
    return build_transfer_layout(
        [
            Placement(size=TOTAL, layers=("a", "b"), layer_stride=BLOCKS * PAGE, block_stride=PAGE),
            Placement(size=TOTAL, layers=("c",), layer_stride=0, block_stride=32, offset=2 * BLOCKS * PAGE),
        ],
        [[("a", PAGE), ("b", PAGE)], [("c", 32)]],
        num_blocks=BLOCKS,
        worker_kv_bytes_per_block=WKB,
    )


def _kv(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (TOTAL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _plan(bpc: int = 1, *, world_size: int = 1, rank: int = 0, replicated: bool = False, chunks: int = 8):
    copies = 1 if replicated else world_size
    return plan_host_pool(
        worker_kv_bytes_per_block=WKB,
        world_size=world_size,
        blocks_per_chunk=bpc,
        cpu_bytes_to_use=chunks * -(-WKB * copies * bpc // 4096) * 4096,
        replicated=replicated,
        rank=rank,
    )


def _corrupt(result: JobResult) -> tuple[int, ...]:
    """The chunk ids a result reports as failing verification."""
    return tuple(unpack_int64(result.corrupt_chunk_ids))


def _run(mover: CopyEngine, job_id: int, *, store: bool, **job: object) -> JobResult:
    submit = mover.submit_store if store else mover.submit_load
    job.setdefault("group_sizes", [len(job["block_ids"]), 0])  # type: ignore[arg-type]
    job.setdefault("block_indices", [0, 0])
    submit(job_id, **job)  # type: ignore[arg-type]
    mover.wait([job_id], timeout=30)
    (result,) = mover.poll()
    assert result.job_id == job_id
    return result


def _pages(kv: torch.Tensor, block: int) -> list[torch.Tensor]:
    return [kv[layer * BLOCKS * PAGE + block * PAGE :][:PAGE] for layer in range(2)]


@pytest.fixture
def private() -> Iterator[tuple[CopyEngine, HostPool, torch.Tensor]]:
    kv = _kv(1)
    with HostPool(_plan()) as pool, CopyEngine(kv, _layout(), pool) as mover:
        yield mover, pool, kv


def test_intact_chunks_load_and_a_flipped_byte_fails_naming_its_chunk(
    private: tuple[CopyEngine, HostPool, torch.Tensor],
) -> None:
    mover, pool, kv = private
    original = kv.clone()
    tags = [key_tag(b"k4"), key_tag(b"k5"), key_tag(b"k6")]
    stored = _run(mover, 1, store=True, block_ids=[1, 2, 3], chunk_ids=[4, 5, 6], chunk_tags=tags)
    assert (stored.success, _corrupt(stored)) == (True, ())
    ok = _run(mover, 2, store=False, block_ids=[7, 8, 9], chunk_ids=[4, 5, 6], chunk_tags=tags)
    assert (ok.success, ok.error, ok.num_bytes) == (True, "", 3 * WKB)
    assert all(torch.equal(a, b) for a, b in zip(_pages(kv, 8), _pages(original, 2), strict=True))

    pool.rows[5, 77] ^= 0x01  # one bit of chunk 5 (layer b of its block)
    bad = _run(mover, 3, store=False, block_ids=[10, 11, 12], chunk_ids=[4, 5, 6], chunk_tags=tags)
    assert (bad.success, bad.num_bytes, _corrupt(bad)) == (False, 0, (5,))
    assert bad.error is not None and "integrity" in bad.error and "[5]" in bad.error
    alone = _run(mover, 4, store=False, block_ids=[13], chunk_ids=[4], chunk_tags=tags[:1])
    assert alone.success  # the other chunks stay good


def test_wrong_key_tag_and_unstored_chunk_fail(private: tuple[CopyEngine, HostPool, torch.Tensor]) -> None:
    mover, _, _ = private
    assert _run(mover, 1, store=True, block_ids=[1], chunk_ids=[2], chunk_tags=[key_tag(b"first")]).success
    # the chunk id was reused for another key: its tag does not match
    wrong = _run(mover, 2, store=False, block_ids=[5], chunk_ids=[2], chunk_tags=[key_tag(b"second")])
    assert (wrong.success, _corrupt(wrong)) == (False, (2,))
    never = _run(mover, 3, store=False, block_ids=[5], chunk_ids=[3], chunk_tags=[key_tag(b"first")])
    assert (never.success, _corrupt(never)) == (False, (3,))
    # a later store of the second key into the same chunk replaces the tag
    assert _run(mover, 4, store=True, block_ids=[1], chunk_ids=[2], chunk_tags=[key_tag(b"second")]).success
    assert _run(mover, 5, store=False, block_ids=[5], chunk_ids=[2], chunk_tags=[key_tag(b"second")]).success
    stale = _run(mover, 6, store=False, block_ids=[5], chunk_ids=[2], chunk_tags=[key_tag(b"first")])
    assert _corrupt(stale) == (2,)


def test_untagged_jobs_still_verify_checksums(private: tuple[CopyEngine, HostPool, torch.Tensor]) -> None:
    mover, pool, _ = private
    assert _run(mover, 1, store=True, block_ids=[1], chunk_ids=[0]).success
    assert _run(mover, 2, store=False, block_ids=[2], chunk_ids=[0]).success
    pool.rows[0, 0] ^= 0x80
    assert _corrupt(_run(mover, 3, store=False, block_ids=[2], chunk_ids=[0])) == (0,)


def test_checksums_off_still_verify_key_tags() -> None:
    kv = _kv(2)
    with HostPool(_plan()) as pool:
        with CopyEngine(kv, _layout(), pool, checksums=False) as mover:
            assert not mover.checksums
            tag = [key_tag(b"k")]
            assert _run(mover, 1, store=True, block_ids=[1], chunk_ids=[3], chunk_tags=tag).success
            pool.rows[3, 5] ^= 0xFF
            assert _run(mover, 2, store=False, block_ids=[2], chunk_ids=[3], chunk_tags=tag).success  # not checked
            wrong = _run(mover, 3, store=False, block_ids=[2], chunk_ids=[3], chunk_tags=[key_tag(b"other")])
            assert _corrupt(wrong) == (3,)
        assert pool.integrity.storage.view(-1, 3)[3, 2] == TAGGED
        # a reader that checks content refuses a chunk stored without a checksum
        with CopyEngine(kv, _layout(), pool) as checker:
            refused = _run(checker, 4, store=False, block_ids=[2], chunk_ids=[3], chunk_tags=tag)
            assert _corrupt(refused) == (3,)
            assert _run(checker, 5, store=True, block_ids=[1], chunk_ids=[3], chunk_tags=tag).success
            assert pool.integrity.storage.view(-1, 3)[3, 2] == SEALED
            assert _run(checker, 6, store=False, block_ids=[2], chunk_ids=[3], chunk_tags=tag).success


def test_checksums_setting_is_validated(private: tuple[CopyEngine, HostPool, torch.Tensor]) -> None:
    from kvoffload.errors import ConfigError

    _, pool, kv = private
    with pytest.raises(ConfigError, match="checksums=1"):
        CopyEngine(kv, _layout(), pool, checksums=1)  # type: ignore[arg-type]


def test_chunk_tags_must_match_chunk_ids(private: tuple[CopyEngine, HostPool, torch.Tensor]) -> None:
    from kvoffload.errors import ConfigError

    mover, _, _ = private
    with pytest.raises(ConfigError, match="chunk_tags has 2 entries but the job has 1 chunk_ids"):
        mover.submit_store(1, group_sizes=[1, 0], block_indices=[0, 0], block_ids=[1], chunk_ids=[0], chunk_tags=[1, 2])


def test_partial_chunks_verify_only_the_sub_blocks_they_read() -> None:
    kv = _kv(3)
    original = kv.clone()
    with HostPool(_plan(bpc=4)) as pool, CopyEngine(kv, _layout(), pool) as mover:
        tags = [key_tag(b"c0"), key_tag(b"c1")]
        # group 0 blocks with logical indices 2, 3, 4: sub-blocks 2, 3 of chunk 0 and sub-block 0 of chunk 1
        job = {"group_sizes": [3, 0], "block_indices": [2, 0], "chunk_ids": [0, 1], "chunk_tags": tags}
        assert _run(mover, 1, store=True, block_ids=[5, 6, 7], **job).success
        assert _run(mover, 2, store=False, block_ids=[8, 9, 10], **job).success
        assert torch.equal(_pages(kv, 10)[1], _pages(original, 7)[1])
        # sub-block 1 of chunk 0 was never written: reading it fails
        head = {"group_sizes": [2, 0], "block_indices": [1, 0], "chunk_ids": [0], "chunk_tags": tags[:1]}
        assert _corrupt(_run(mover, 3, store=False, block_ids=[8, 9], **head)) == (0,)
        # a flip in an unwritten sub-block (3) of chunk 1 does not matter; one in its sub-block 0 does
        pool.rows[1, 3 * WKB + 1] ^= 1
        assert _run(mover, 4, store=False, block_ids=[8, 9, 10], **job).success
        pool.rows[1, 0 * WKB + 100] ^= 1
        assert _corrupt(_run(mover, 5, store=False, block_ids=[8, 9, 10], **job)) == (1,)


def test_two_groups_each_verify_their_own_pages() -> None:
    kv = _kv(4)
    with HostPool(_plan(bpc=2)) as pool, CopyEngine(kv, _layout(), pool) as mover:
        tags = [key_tag(b"g0"), key_tag(b"g1")]
        job = {"group_sizes": [2, 1], "block_indices": [0, 3], "chunk_ids": [2, 5], "chunk_tags": tags}
        assert _run(mover, 1, store=True, block_ids=[1, 2, 3], **job).success
        assert _run(mover, 2, store=False, block_ids=[4, 5, 6], **job).success
        pool.rows[5, WKB + 32] ^= 1  # beyond group 1's 32 bytes in its sub-block: not part of the page
        assert _run(mover, 3, store=False, block_ids=[4, 5, 6], **job).success
        pool.rows[5, WKB + 31] ^= 1
        assert _corrupt(_run(mover, 4, store=False, block_ids=[4, 5, 6], **job)) == (5,)


@settings(max_examples=40)
@given(
    bpc=st.integers(1, 3),
    first=st.integers(0, 5),
    count=st.integers(1, 6),
    flip=st.integers(0, 10**9),
)
def test_a_flip_fails_the_load_iff_it_hits_a_page_the_load_reads(bpc: int, first: int, count: int, flip: int) -> None:
    kv = _kv(5)
    plan = _plan(bpc=bpc)
    with HostPool(plan) as pool, CopyEngine(kv, _layout(), pool) as mover:
        n_chunks = -(-(count + first % bpc) // bpc)
        chunks = list(range(plan.num_chunks - 1, plan.num_chunks - 1 - n_chunks, -1))
        tags = [key_tag(bytes([c])) for c in chunks]
        job = {"group_sizes": [count, 0], "block_indices": [first, 0], "chunk_ids": chunks, "chunk_tags": tags}
        assert _run(mover, 1, store=True, block_ids=list(range(count)), **job).success
        # where the pages are, from the reference rule: block i sits in sub-block (first % bpc + i)
        read: dict[int, int] = {}
        for i in range(count):
            sub = first % bpc + i
            start = chunks[sub // bpc] * pool.row_bytes + (sub % bpc) * WKB
            for byte in range(start, start + 2 * PAGE):
                read[byte] = chunks[sub // bpc]
        host = pool.rows.reshape(-1)
        position = flip % host.numel()
        host[position] ^= 0x10
        result = _run(mover, 2, store=False, block_ids=list(range(8, 8 + count)), **job)
        expected = (read[position],) if position in read else ()
        assert _corrupt(result) == expected
        assert result.success == (not expected)


@pytest.fixture
def engine_id() -> Iterator[str]:
    yield f"test-integrity-{uuid.uuid4().hex[:12]}"


def test_shared_pool_keeps_one_table_per_rank_slot(engine_id: str) -> None:
    kvs = [_kv(10), _kv(11)]
    pools = [HostPool(_plan(world_size=2, rank=r), engine_id=engine_id) for r in (0, 1)]
    movers = [CopyEngine(kv, _layout(), pool) for kv, pool in zip(kvs, pools, strict=True)]
    try:
        tag = [key_tag(b"one row, two ranks")]
        for mover in movers:
            assert _run(mover, 1, store=True, block_ids=[1], chunk_ids=[3], chunk_tags=tag).success
        for mover in movers:
            assert _run(mover, 2, store=False, block_ids=[2], chunk_ids=[3], chunk_tags=tag).success
        pools[0].rows[3, pools[1].slot_offset + 9] ^= 1  # rank 1's slot of the shared row
        assert _run(movers[0], 3, store=False, block_ids=[2], chunk_ids=[3], chunk_tags=tag).success
        assert _corrupt(_run(movers[1], 3, store=False, block_ids=[2], chunk_ids=[3], chunk_tags=tag)) == (3,)
    finally:
        for mover in movers:
            mover.close()
        for pool in reversed(pools):
            pool.close()


def test_replicated_pool_readers_verify_what_rank_0_wrote(engine_id: str) -> None:
    kvs = [_kv(20), _kv(21)]
    pools = [HostPool(_plan(world_size=2, rank=r, replicated=True), engine_id=engine_id) for r in (0, 1)]
    movers = [CopyEngine(kv, _layout(), pool) for kv, pool in zip(kvs, pools, strict=True)]
    try:
        tag = [key_tag(b"replica")]
        # rank 1 does not write (its store is a 0-byte ack) and must not touch the table
        for rank in (1, 0):
            stored = _run(movers[rank], 1, store=True, block_ids=[1], chunk_ids=[2], chunk_tags=tag)
            assert (stored.success, stored.num_bytes) == (True, 0 if rank else WKB)
        loaded = _run(movers[1], 2, store=False, block_ids=[4], chunk_ids=[2], chunk_tags=tag)
        assert loaded.success
        assert torch.equal(_pages(kvs[1], 4)[0], _pages(kvs[0], 1)[0])  # rank 1 got rank 0's bytes
        pools[1].rows[2, 3] ^= 4
        for rank in (0, 1):
            result = _run(movers[rank], 3, store=False, block_ids=[4], chunk_ids=[2], chunk_tags=tag)
            assert _corrupt(result) == (2,)
    finally:
        for mover in movers:
            mover.close()
        for pool in reversed(pools):
            pool.close()


def test_key_tag_is_stable_signed_and_never_zero() -> None:
    tags = [key_tag(bytes([i]) * 36) for i in range(256)]
    assert all(-(1 << 63) <= t < (1 << 63) and t != 0 for t in tags)
    assert len(set(tags)) == 256
    assert key_tag(b"abc") == key_tag(b"abc") != key_tag(b"abd")


def _layer_major(layers: int, blocks: int, page: int) -> tuple[TransferLayout, HostPoolPlan]:
    """A layer-major engine of ``layers`` layers and ``blocks`` blocks, and a 16-chunk pool of 2 blocks a chunk."""
    names = ("a", "b")[:layers]
    layout = build_transfer_layout(
        [Placement(size=layers * blocks * page, layers=names, layer_stride=blocks * page, block_stride=page)],
        [[(name, page) for name in names]],
        num_blocks=blocks,
        worker_kv_bytes_per_block=layers * page,
    )
    plan = plan_host_pool(
        worker_kv_bytes_per_block=layers * page,
        world_size=1,
        blocks_per_chunk=2,
        cpu_bytes_to_use=16 * 2 * layers * page,
        replicated=False,
        rank=0,
    )
    return layout, plan


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_big_jobs_hashed_in_shares_verify_every_slot(threads: int, layers: int) -> None:
    # 24 blocks x 64 KiB pages: the copy helpers share the job. With one layer a copy run spans both
    # sub-blocks of a chunk, so shares may only be cut between chunks.
    page, blocks = 64 << 10, 24
    layout, plan = _layer_major(layers, blocks, page)
    gen = torch.Generator().manual_seed(9)
    kv = torch.randint(0, 256, (layers * blocks * page,), dtype=torch.uint8, generator=gen)
    original = kv.clone()
    with HostPool(plan) as pool, CopyEngine(kv, layout, pool, cpu_threads=threads) as mover:
        chunks = [15, 3, 4, 5, 9, 0, 1, 2, 6, 7, 8, 10]
        tags = [key_tag(bytes([c])) for c in chunks]
        job = {"group_sizes": [blocks], "block_indices": [0], "chunk_ids": chunks, "chunk_tags": tags}
        assert _run(mover, 1, store=True, block_ids=list(range(blocks)), **job).success
        kv.zero_()
        back = list(range(blocks - 1, -1, -1))
        assert _run(mover, 2, store=False, block_ids=back, **job).success
        for i, b in enumerate(back):
            for layer in range(layers):
                got = kv[layer * blocks * page + b * page :][:page]
                assert torch.equal(got, original[layer * blocks * page + i * page :][:page])
        pool.rows[9, layers * page + 5] ^= 1  # sub-block 1 of chunk 9
        pool.rows[2, 7] ^= 1
        assert _corrupt(_run(mover, 3, store=False, block_ids=back, **job)) == (2, 9)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("threads", [1, 2])
def test_slots_bigger_than_a_hash_stretch_are_hashed_exactly(threads: int, layers: int) -> None:
    # 160 KiB pages, 2 blocks per chunk: a sub-block of 160 or 320 KiB is hashed in 256 KiB stretches as its
    # bytes are copied; the sealed checksums must equal a plain xxh3 of each sub-block, and a flipped byte
    # past the first stretch must fail the load.
    page, blocks = 160 << 10, 24
    layout, plan = _layer_major(layers, blocks, page)
    gen = torch.Generator().manual_seed(11)
    kv = torch.randint(0, 256, (layers * blocks * page,), dtype=torch.uint8, generator=gen)
    original = kv.clone()
    with HostPool(plan) as pool, CopyEngine(kv, layout, pool, cpu_threads=threads) as mover:
        chunks = [15, 3, 4, 5, 9, 0, 1, 2, 6, 7, 8, 10]
        tags = [key_tag(bytes([c])) for c in chunks]
        job = {"group_sizes": [blocks], "block_indices": [0], "chunk_ids": chunks, "chunk_tags": tags}
        block_ids = [(7 * i) % blocks for i in range(blocks)]
        assert _run(mover, 1, store=True, block_ids=block_ids, **job).success
        where = {k: v for k, v in job.items() if k != "chunk_tags"}
        slots = build_block_slots(
            layout, pool.integrity, chunk_tags=tags, blocks_per_chunk=2, host_row_bytes=pool.row_bytes, **where
        )
        host = memoryview(pool.rows.reshape(-1).numpy())  # type: ignore[arg-type]
        assert pool.integrity.verify(slots, host, checksums=True) == []  # sealed sums == recomputed sums
        kv.zero_()
        assert _run(mover, 2, store=False, block_ids=block_ids, **job).success
        assert torch.equal(kv, original)
        pool.rows[4, layers * page + 300_000 % (layers * page)] ^= 1  # sub-block 1 of chunk 4, past 256 KiB
        assert _corrupt(_run(mover, 3, store=False, block_ids=block_ids, **job)) == (4,)


def test_a_store_invalidates_its_entries_until_its_copy_completes(
    private: tuple[CopyEngine, HostPool, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from kvoffload.offload.worker import copy as kvcopy
    from kvoffload.offload.worker.copy import _cpu as cpu
    from kvoffload.offload.worker.copy import _cpu_loops as loops
    from kvoffload.offload.worker.copy import _cpu_native as cpu_native

    mover, pool, _ = private
    tag = [key_tag(b"k")]
    assert _run(mover, 1, store=True, block_ids=[1], chunk_ids=[4], chunk_tags=tag).success
    job = {"group_sizes": [1, 0], "block_indices": [0, 0], "block_ids": [2], "chunk_ids": [4], "chunk_tags": tag}
    where = {k: v for k, v in job.items() if k != "block_ids"}
    slots = kvcopy.build_block_slots(
        _layout(), pool.integrity, blocks_per_chunk=1, host_row_bytes=pool.row_bytes, **where
    )
    assert pool.integrity.states(slots).tolist() == [SEALED]
    release, started = threading.Event(), threading.Event()

    def holding(real: Callable[..., None]) -> Callable[..., None]:
        def held(*args: object, **kwargs: object) -> None:
            started.set()
            release.wait(10)
            real(*args, **kwargs)

        return held

    # hold whichever copy path the job takes (the native engine's queue, or block views / memmove in Python)
    backend = mover._backend
    if isinstance(backend, cpu_native.NativeCpuBackend):
        backend.hold(True)
        started.set()
    for module, name in ((loops, "memmove_runs"), (loops, "copy_views"), (cpu, "_native_job")):
        monkeypatch.setattr(module, name, holding(getattr(module, name)))
    mover.submit_store(2, **job)  # type: ignore[arg-type]
    assert started.wait(10)
    assert pool.integrity.states(slots).tolist() == [0]  # a load now would fail: the bytes are changing
    release.set()
    if isinstance(backend, cpu_native.NativeCpuBackend):
        backend.hold(False)
    mover.wait([2], timeout=10)
    assert [r.success for r in mover.poll()] == [True]
    assert pool.integrity.states(slots).tolist() == [SEALED]
