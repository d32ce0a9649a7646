"""Host pool sizing and allocation: private, pinned, shared across processes."""

from __future__ import annotations

import gc
import multiprocessing
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvoffload.errors import ConfigError, HostMemoryError, InvalidStateError, WorkerError
from kvoffload.offload.pool import (
    PAGE_SIZE,
    HostPool,
    HostPoolPlan,
    plan_host_pool,
    plan_host_pool_from_config,
    shared_pool_path,
)
from tests.helpers import offloading_config


def _plan(**overrides: int | bool) -> HostPoolPlan:
    args: dict[str, int | bool] = {
        "worker_kv_bytes_per_block": 1000,
        "world_size": 4,
        "blocks_per_chunk": 3,
        "cpu_bytes_to_use": 10**6,
        "replicated": False,
        "rank": 2,
    }
    args.update(overrides)
    return plan_host_pool(**args)  # type: ignore[arg-type]


@pytest.fixture
def engine_id() -> Iterator[str]:
    """A unique engine id; fails the test if its shared-memory file outlives it."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    path = shared_pool_path(name)
    leaked = path.exists()
    if leaked:
        path.unlink()
    assert not leaked, f"{path} was left behind"


# -- plan ---------------------------------------------------------------------------------------------


def test_plan_not_replicated() -> None:
    plan = _plan()
    assert plan.copies == 4
    assert plan.slot_bytes == 3000  # raw_chunk 12000 // copies
    assert plan.row_bytes == 12288  # round_up(12000, 4096)
    assert plan.num_chunks == 10**6 // 12288 == 81
    assert plan.slot_offset == 2 * 3000 == plan.slot_offset_of(2)
    assert plan.slot_offset_of(3) == 9000
    assert plan.writes
    assert plan.total_bytes == 81 * 12288


def test_plan_replicated() -> None:
    plan = _plan(replicated=True)
    assert (plan.copies, plan.slot_bytes, plan.row_bytes) == (1, 3000, 4096)
    assert plan.num_chunks == 10**6 // 4096
    assert plan.slot_offset == 0 == plan.slot_offset_of(3)
    assert not plan.writes
    assert _plan(replicated=True, rank=0).writes


def test_plan_zero_worker_bytes_is_all_zero() -> None:
    plan = _plan(worker_kv_bytes_per_block=0)
    assert (plan.slot_bytes, plan.row_bytes, plan.num_chunks, plan.total_bytes) == (0, 0, 0, 0)
    with HostPool(plan) as pool:
        assert pool.rows.shape == (0, 0)


def test_plan_row_already_page_aligned() -> None:
    plan = _plan(worker_kv_bytes_per_block=PAGE_SIZE, world_size=1, rank=0, blocks_per_chunk=2)
    assert plan.row_bytes == plan.slot_bytes == 2 * PAGE_SIZE


def test_plan_budget_too_small_names_numbers() -> None:
    with pytest.raises(HostMemoryError, match=r"cpu_bytes_to_use=12287 \(the total host budget across all 4"):
        _plan(cpu_bytes_to_use=12287)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use=0 must be > 0: it is the total host budget"),
        ({"rank": 4}, r"rank=4 must be in \[0, world_size=4\)"),
        ({"world_size": 0, "rank": 0}, "world_size=0 must be >= 1"),
        ({"blocks_per_chunk": 0}, "blocks_per_chunk=0 must be >= 1"),
        ({"worker_kv_bytes_per_block": -1}, "worker_kv_bytes_per_block=-1 must be >= 0"),
    ],
)
def test_plan_rejects_bad_values(overrides: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _plan(**overrides)


def test_plan_from_config() -> None:
    from kvoffload._generated import (
        OffloadingConfig,
    )

    def config(extra: dict[str, object]) -> OffloadingConfig:
        return offloading_config(
            (), worker_kv_bytes_per_block=1000, extra_config=extra, blocks_per_chunk=3, rank=2, world_size=4
        )

    assert plan_host_pool_from_config(config({"cpu_bytes_to_use": 10**6})) == _plan()
    assert plan_host_pool_from_config(config({"cpu_bytes_to_use": "1000000"})) == _plan()
    with pytest.raises(ConfigError, match="must be specified in kv_connector_extra_config"):
        plan_host_pool_from_config(config({}))
    with pytest.raises(ConfigError, match="cpu_bytes_to_use='lots' is not a number"):
        plan_host_pool_from_config(config({"cpu_bytes_to_use": "lots"}))


# -- private pool -------------------------------------------------------------------------------------


def test_private_pool_holds_only_this_workers_slot() -> None:
    plan = _plan()
    with HostPool(plan) as pool:
        assert not pool.is_shared and pool.path is None
        assert pool.rows.shape == (81, 3000) and pool.rows.dtype == torch.uint8
        assert pool.row_bytes == 3000 and pool.slot_offset == 0
        assert int(pool.rows.count_nonzero()) == 0
        assert pool.slot_rows().data_ptr() == pool.rows.data_ptr()
        assert pool.rows_int64().shape == (81, 375)
        assert pool.wait_pinned(timeout=60) == torch.cuda.is_available()
        assert pool.writes
        with pytest.raises(ConfigError, match="rank=1: a private pool holds only rank 2's slot"):
            pool.slot_rows(1)
    with pytest.raises(InvalidStateError, match="closed"):
        _ = pool.rows


def test_int64_view_needs_multiple_of_8() -> None:
    with HostPool(_plan(worker_kv_bytes_per_block=1001, world_size=1, rank=0, blocks_per_chunk=1)) as pool:
        with pytest.raises(ConfigError, match="slot_bytes=1001 is not a multiple of 8"):
            pool.slot_rows_int64()
        with pytest.raises(ConfigError, match="row_bytes=1001 is not a multiple of 8"):
            pool.rows_int64()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_pin_memory_true_without_cuda() -> None:
    with pytest.raises(ConfigError, match="pin_memory=True needs CUDA"):
        HostPool(_plan(), pin_memory=True)


def test_pool_too_big_for_memory_names_numbers() -> None:
    plan = _plan(worker_kv_bytes_per_block=1 << 20, world_size=1, rank=0, cpu_bytes_to_use=1 << 50)
    requested = plan.num_chunks * plan.slot_bytes
    with pytest.raises(HostMemoryError) as info:
        HostPool(plan)
    message = str(info.value)
    assert f"needs {requested} bytes (num_chunks={plan.num_chunks} x row_bytes={plan.slot_bytes})" in message
    assert "bytes of host memory are available" in message
    assert f"cpu_bytes_to_use (={1 << 50}, the total across all 1 workers)" in message


def test_shared_pool_too_big_for_shm_is_removed(tmp_path: Path) -> None:
    plan = _plan(worker_kv_bytes_per_block=1 << 20, world_size=1, rank=0, cpu_bytes_to_use=1 << 50)
    with pytest.raises(HostMemoryError, match=f"bytes of free space in {tmp_path} are available"):
        HostPool(plan, engine_id="big", shm_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# -- shared pool --------------------------------------------------------------------------------------


def test_shared_pool_create_join_and_cleanup(engine_id: str) -> None:
    plan0 = _plan(world_size=2, rank=0)
    plan1 = _plan(world_size=2, rank=1)
    creator = HostPool(plan0, engine_id=engine_id)
    joiner = HostPool(plan1, engine_id=engine_id)
    path = shared_pool_path(engine_id)
    assert creator.is_creator and not joiner.is_creator
    assert creator.path == joiner.path == path and path.stat().st_size == plan0.shared_file_bytes
    assert creator.rows.shape == (plan0.num_chunks, plan0.row_bytes)
    assert (creator.slot_offset, joiner.slot_offset) == (0, plan0.slot_bytes)
    joiner.slot_rows()[5, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert creator.slot_rows(1)[5, :4].tolist() == [1, 2, 3, 4]
    assert creator.rows[5, plan0.slot_bytes : plan0.slot_bytes + 4].tolist() == [1, 2, 3, 4]
    joiner.close()
    assert path.exists()  # only the creator removes the file
    creator.close()
    assert not path.exists()


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the mapping holding ``tensor`` that are mapped in this process (Rss in /proc/self/smaps)."""
    address = tensor.data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


def test_shared_pool_pages_are_faulted_in_in_the_background(engine_id: str) -> None:
    # A store into a fresh shared mapping used to take one page fault per 4 KiB page (a 5x slower store): every
    # rank maps its slots in the background, without changing what another rank (or this one) already wrote.
    plan0 = _plan(world_size=2, rank=0, cpu_bytes_to_use=4 << 20)
    plan1 = _plan(world_size=2, rank=1, cpu_bytes_to_use=4 << 20)
    with HostPool(plan0, engine_id=engine_id) as creator:
        creator.slot_rows(1)[3, :3] = torch.tensor([7, 8, 9], dtype=torch.uint8)  # usable before it is faulted in
        assert creator.wait_prefaulted(30) and creator.is_prefaulted
        own = plan0.num_chunks * plan0.slot_bytes
        assert _resident_bytes(creator.rows) >= own
        with HostPool(plan1, engine_id=engine_id) as joiner:
            assert joiner.wait_prefaulted(30)
            assert _resident_bytes(joiner.rows) >= own
            assert joiner.slot_rows()[3, :3].tolist() == [7, 8, 9]


def test_private_pool_is_usable_at_once_and_faulted_in_in_the_background() -> None:
    plan = _plan(world_size=1, rank=0, cpu_bytes_to_use=64 << 20)
    with HostPool(plan, pin_memory=False) as pool:
        pattern = torch.arange(pool.row_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        rows = list(range(0, plan.num_chunks, 7))
        for row in rows:  # written while the background thread may still be populating
            pool.rows[row] = pattern
        assert pool.wait_prefaulted(30) and pool.is_prefaulted
        assert _resident_bytes(pool.rows) >= plan.num_chunks * plan.slot_bytes
        assert all(torch.equal(pool.rows[row], pattern) for row in rows), "populating never changes a page"
        assert int(pool.rows[1].sum()) == 0, "the other rows read as zeros"


def test_unlink_keeps_mapping(engine_id: str) -> None:
    with HostPool(_plan(world_size=1, rank=0), engine_id=engine_id) as pool:
        pool.unlink()
        assert not shared_pool_path(engine_id).exists()
        pool.rows[0, 0] = 9
        assert int(pool.rows[0, 0]) == 9


def test_garbage_collected_pool_removes_its_file(engine_id: str) -> None:
    pool = HostPool(_plan(world_size=1, rank=0), engine_id=engine_id)
    view = pool.rows[1]
    del pool
    gc.collect()
    assert not shared_pool_path(engine_id).exists()
    view.fill_(3)  # the mapping lives on while a view does
    assert int(view.sum()) == 3 * view.numel()


def test_joiner_times_out_naming_the_path(engine_id: str) -> None:
    path = shared_pool_path(engine_id)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # a creator that never sizes the file
    try:
        with pytest.raises(WorkerError, match=f"timed out after 0.05s .* {path}") as info:
            HostPool(_plan(world_size=1, rank=0), engine_id=engine_id, join_timeout_s=0.05)
        assert isinstance(info.value.__cause__, TimeoutError)
    finally:
        os.close(fd)
        path.unlink()


def test_joiner_rejects_a_file_of_another_plan(engine_id: str) -> None:
    with (
        HostPool(_plan(world_size=1, rank=0), engine_id=engine_id),
        pytest.raises(WorkerError, match="ranks disagree on the host pool plan"),
    ):
        HostPool(_plan(world_size=1, rank=0, cpu_bytes_to_use=10**5), engine_id=engine_id)


def test_bad_engine_id() -> None:
    with pytest.raises(ConfigError, match="engine_id='a/b' cannot name a shared-memory file"):
        HostPool(_plan(), engine_id="a/b")


def _child_joins(engine_id: str, plan: HostPoolPlan, results: multiprocessing.Queue[object]) -> None:
    """Runs in a spawned process: join, read the creator's bytes, write this rank's slot."""
    with HostPool(plan, engine_id=engine_id, join_timeout_s=20) as pool:
        results.put((pool.is_creator, pool.slot_rows(0)[3, :8].tolist()))
        pool.slot_rows()[3].fill_(7)


@pytest.mark.slow
def test_shared_pool_joined_from_another_process(engine_id: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[object] = ctx.Queue()
    with HostPool(_plan(world_size=2, rank=0), engine_id=engine_id) as pool:
        pool.slot_rows()[3, :8] = torch.arange(8, dtype=torch.uint8) + 100
        child = ctx.Process(target=_child_joins, args=(engine_id, _plan(world_size=2, rank=1), results))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert results.get(timeout=5) == (False, list(range(100, 108)))
        assert bool((pool.slot_rows(1)[3] == 7).all())
        assert int(pool.slot_rows(1)[2].count_nonzero()) == 0
        assert pool.slot_rows()[3, :8].tolist() == list(range(100, 108))
        assert shared_pool_path(engine_id).exists()
    assert not shared_pool_path(engine_id).exists()


def test_the_background_prefault_waits_while_the_engine_computes() -> None:
    plan = _plan(world_size=1, rank=0, cpu_bytes_to_use=512 << 20)
    with HostPool(plan, pin_memory=False) as pool:
        pool.hold_prefault()  # a forward pass started: at most the slice in progress is populated
        assert not pool.wait_prefaulted(0.5), "the prefault went on while held"
        held = _resident_bytes(pool.rows)
        assert not pool.wait_prefaulted(0.3)
        assert _resident_bytes(pool.rows) == held, "pages were populated while held"
        assert held < plan.num_chunks * plan.slot_bytes
        pool.release_prefault()
        assert pool.wait_prefaulted(60) and pool.is_prefaulted
        assert _resident_bytes(pool.rows) >= plan.num_chunks * plan.slot_bytes
