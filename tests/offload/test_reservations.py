"""Host-memory reservations across real processes: a pool being allocated elsewhere counts against this one."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError, HostMemoryError
from kvoffload.offload.pool._reservations import LEDGER_NAME, reserve_host_memory, reserved_by_others

GiB = 1 << 30

_HOLDER = """
import sys, time
from kvoffload.offload.pool._reservations import reserve_host_memory
with reserve_host_memory(int(sys.argv[2]), lambda: 1 << 62, lambda free: MemoryError(free), shm_dir=sys.argv[1]):
    print("reserved", flush=True)
    time.sleep(120)
"""


_LOCKER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""

_LOGGER = "kvoffload.offload.pool._reservations"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == _LOGGER and r.levelno >= logging.WARNING]


def _one_warning(caplog: pytest.LogCaptureFixture) -> str:
    warnings = _warnings(caplog)
    assert len(warnings) == 1, f"expected one warning from {_LOGGER}, got {warnings}"
    return warnings[0]


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


def _ledger_doc(nbytes: int) -> bytes:
    """A well-formed ledger in which pid 1 (always alive) reserves ``nbytes``."""
    return json.dumps([{"pid": 1, "bytes": nbytes, "id": 1}]).encode()


def _plant_symlink(shm: Path, target: Path) -> None:
    (shm / LEDGER_NAME).symlink_to(target)


def _plant_hardlink(shm: Path, target: Path) -> None:
    os.link(target, shm / LEDGER_NAME)


def _plant_fifo(shm: Path, target: Path) -> None:
    os.mkfifo(shm / LEDGER_NAME, 0o600)


@pytest.mark.parametrize(
    ("plant", "why"),
    [(_plant_symlink, "symbolic link"), (_plant_hardlink, "2 hard links"), (_plant_fifo, "not a regular file")],
)
def test_a_ledger_planted_as_a_link_is_never_written_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, plant: Callable[[Path, Path], None], why: str
) -> None:
    """A link planted at the ledger path (shm is world-writable) must not get its target overwritten."""
    caplog.set_level(logging.WARNING, logger=_LOGGER)
    shm, target = tmp_path / "shm", tmp_path / "precious"
    shm.mkdir()
    target.write_bytes(b"do not overwrite")
    target.chmod(0o600)
    plant(shm, target)
    with reserve_host_memory(GiB, lambda: 2 * GiB, _refuse, shm_dir=shm):
        assert target.read_bytes() == b"do not overwrite"
    assert target.read_bytes() == b"do not overwrite"
    assert os.path.lexists(shm / LEDGER_NAME), "the planted entry is left alone"
    warning = _one_warning(caplog)
    assert str(shm / LEDGER_NAME) in warning and why in warning
    caplog.clear()
    with pytest.raises(HostMemoryError), reserve_host_memory(2 * GiB, lambda: GiB, _refuse, shm_dir=shm):
        pytest.fail("without the ledger the plain check must still apply")
    _one_warning(caplog)


def _loosen_mode(ledger: Path) -> None:
    ledger.chmod(0o644)


def _give_away(ledger: Path) -> None:
    os.chown(ledger, 65534, 65534)


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (_loosen_mode, "mode 0644 is wider than 0600"),
        pytest.param(
            _give_away,
            "owned by uid 65534",
            marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown"),
        ),
    ],
)
def test_a_ledger_that_is_not_a_private_file_of_ours_is_neither_trusted_nor_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, spoil: Callable[[Path], None], why: str
) -> None:
    caplog.set_level(logging.WARNING, logger=_LOGGER)
    ledger = tmp_path / LEDGER_NAME
    ledger.write_bytes(_ledger_doc(2 * GiB))
    ledger.chmod(0o600)
    spoil(ledger)
    with reserve_host_memory(2 * GiB, lambda: 3 * GiB, _refuse, shm_dir=tmp_path):
        pass  # its 2 GiB "reservation" is not believed
    assert ledger.read_bytes() == _ledger_doc(2 * GiB)
    warning = _one_warning(caplog)
    assert str(ledger) in warning and why in warning


_DEEP = 100_000


@pytest.mark.parametrize(
    "doc",
    [
        b'[{"pid": 1}]',
        b'[{"pid": 1, "bytes": "1073741824", "id": 1}]',
        b"[" * _DEEP + b"]" * _DEEP,
        b'[{"pid": 1, "bytes": 1, "id": 1, "x": ' + b"[" * _DEEP + b"]" * _DEEP + b"}]",
        b'[{"pid": 1, "bytes": NaN, "id": 1}]',
        b'[{"pid": 1, "bytes": -1099511627776, "id": 1}]',
        b'[{"pid": 1, "bytes": 1e400, "id": 1}]',
        b'[{"pid": 1, "bytes": 100000000000000000000000000000, "id": 1}]',
        b'[{"pid": -1, "bytes": 1, "id": 1}]',
        b'{"pid": 1, "bytes": 1, "id": 1}',
        b'[{"pid": 1, "bytes": 1',
    ],
    ids=[
        "missing-bytes",
        "string-size",
        "deep-nesting",
        "deep-extra-field",
        "nan-size",
        "negative-size",
        "huge-float-size",
        "huge-int-size",
        "negative-pid",
        "not-a-list",
        "torn",
    ],
)
def test_a_malformed_ledger_is_reset_with_one_warning_and_the_check_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, doc: bytes
) -> None:
    caplog.set_level(logging.WARNING, logger=_LOGGER)
    ledger = tmp_path / LEDGER_NAME
    ledger.write_bytes(doc)
    ledger.chmod(0o600)
    with (
        pytest.raises(HostMemoryError, match=f"only {GiB} bytes free"),
        reserve_host_memory(2 * GiB, lambda: GiB, _refuse, shm_dir=tmp_path),
    ):
        pytest.fail("a malformed entry must not switch the memory check off")
    warning = _one_warning(caplog)
    assert str(ledger) in warning and "malformed" in warning
    assert not ledger.exists(), "the bad document is gone"
    caplog.clear()
    holder = _holder(tmp_path, 2 * GiB)  # a valid reservation made afterwards still counts
    try:
        assert reserved_by_others(tmp_path) == 2 * GiB
        with (
            pytest.raises(HostMemoryError, match=f"only {GiB} bytes free"),
            reserve_host_memory(2 * GiB, lambda: 3 * GiB, _refuse, shm_dir=tmp_path),
        ):
            pytest.fail("two pools of 2 GiB were both let into 3 GiB")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    assert _warnings(caplog) == []


def test_a_ledger_locked_by_a_stuck_process_does_not_hang_the_reservation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=_LOGGER)
    ledger = tmp_path / LEDGER_NAME
    locker = subprocess.Popen([sys.executable, "-c", _LOCKER, str(ledger)], stdout=subprocess.PIPE, text=True)
    outcome: list[BaseException | None] = []

    def reserve() -> None:
        try:
            with reserve_host_memory(GiB, lambda: 2 * GiB, _refuse, shm_dir=tmp_path):
                pass
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=reserve, daemon=True)
    try:
        assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
        thread.start()
        thread.join(60)  # the default lock timeout is a few seconds
        assert not thread.is_alive(), "the reservation hung on another process's lock"
        assert outcome == [None]
        warning = _one_warning(caplog)
        assert str(ledger) in warning and "locked" in warning
        with (
            pytest.raises(HostMemoryError),
            reserve_host_memory(2 * GiB, lambda: GiB, _refuse, shm_dir=tmp_path, lock_timeout_s=0.1),
        ):
            pytest.fail("without the ledger the plain check must still apply")
        assert reserved_by_others(tmp_path, lock_timeout_s=0.1) == 0
    finally:
        locker.send_signal(signal.SIGKILL)
        locker.wait(10)
        thread.join(60)


@pytest.mark.parametrize("nbytes", [-1, 1 << 63])
def test_a_reservation_the_ledger_cannot_hold_is_refused_by_name(tmp_path: Path, nbytes: int) -> None:
    with (
        pytest.raises(ConfigError, match=f"nbytes={nbytes}"),
        reserve_host_memory(nbytes, lambda: 1 << 64, _refuse, shm_dir=tmp_path),
    ):
        pytest.fail("a size no other process could decode was written to the ledger")
    assert not (tmp_path / LEDGER_NAME).exists()
