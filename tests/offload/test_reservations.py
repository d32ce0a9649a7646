"""Host-memory reservations across real processes: a pool being allocated elsewhere counts against this one."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.errors import HostMemoryError
from kvoffload.offload.pool._reservations import LEDGER_NAME, reserve_host_memory, reserved_by_others

GiB = 1 << 30

_HOLDER = """
import sys, time
from kvoffload.offload.pool._reservations import reserve_host_memory
with reserve_host_memory(int(sys.argv[2]), lambda: 1 << 62, lambda free: MemoryError(free), shm_dir=sys.argv[1]):
    print("reserved", flush=True)
    time.sleep(120)
"""


def _refuse(free: int) -> HostMemoryError:
    return HostMemoryError(f"only {free} bytes free")


def _holder(shm_dir: Path, nbytes: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(shm_dir), str(nbytes)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "reserved"
    return proc


def test_a_reservation_in_another_process_counts_until_it_is_done_or_gone(tmp_path: Path) -> None:
    holder = _holder(tmp_path, 2 * GiB)
    try:
        assert reserved_by_others(tmp_path) == 2 * GiB
        with (
            pytest.raises(HostMemoryError, match=f"only {GiB} bytes free"),
            reserve_host_memory(2 * GiB, lambda: 3 * GiB, _refuse, shm_dir=tmp_path),
        ):
            pytest.fail("two pools of 2 GiB were both let into 3 GiB")
        with reserve_host_memory(GiB, lambda: 3 * GiB, _refuse, shm_dir=tmp_path):
            pass  # what is left still fits
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    assert reserved_by_others(tmp_path) == 0, "a killed process's reservation is dropped"
    with reserve_host_memory(2 * GiB, lambda: 3 * GiB, _refuse, shm_dir=tmp_path):
        assert reserved_by_others(tmp_path) == 0  # its own reservation is not counted against itself
    assert not (tmp_path / LEDGER_NAME).exists(), "no reservation, no file"


def test_the_reservation_is_released_when_the_allocation_fails(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="allocation failed"),
        reserve_host_memory(GiB, lambda: 2 * GiB, _refuse, shm_dir=tmp_path),
    ):
        raise RuntimeError("allocation failed")
    assert not (tmp_path / LEDGER_NAME).exists(), "no reservation, no file"


def test_without_a_usable_shm_directory_the_plain_check_still_applies(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    with pytest.raises(HostMemoryError), reserve_host_memory(2 * GiB, lambda: GiB, _refuse, shm_dir=missing):
        pass
    with reserve_host_memory(GiB, lambda: 2 * GiB, _refuse, shm_dir=missing):
        pass
    assert not missing.exists()


def test_a_host_pool_counts_what_other_processes_are_allocating(tmp_path: Path) -> None:
    """Two pools created at the same moment cannot both take the machine's free memory."""
    from kvoffload.offload.pool import HostPool, available_host_memory_bytes, plan_host_pool

    plan = plan_host_pool(
        worker_kv_bytes_per_block=1 << 20,
        world_size=1,
        blocks_per_chunk=1,
        cpu_bytes_to_use=64 << 20,
        replicated=False,
        rank=0,
    )
    holder = _holder(tmp_path, available_host_memory_bytes())  # another process is allocating all of it
    try:
        with pytest.raises(HostMemoryError, match="bytes of host memory are available"):
            HostPool(plan, pin_memory=False, shm_dir=tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    with HostPool(plan, pin_memory=False, shm_dir=tmp_path) as pool:  # its owner is gone: the memory is free
        assert pool.num_chunks == plan.num_chunks
    assert not (tmp_path / LEDGER_NAME).exists()
