"""The disk tier on real files: byte-exact round trips, restarts, namespaces, damage, capacity, disk full."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvoffload.errors import TierError
from kvoffload.tiers import FsTier, Namespace, SecondaryTier
from kvoffload.tiers._record import HEADER_SIZE
from tests.tiers import rows as rows_helpers
from tests.tiers.rows import keys as _keys
from tests.tiers.rows import store as _store
from tests.tiers.rows import views as _views

ROW = 8192 + 24  # deliberately not a multiple of the page size


def _ns(rank: int = 0, dtype: str = "float16") -> Namespace:
    return rows_helpers.namespace(ROW, rank, dtype)


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    return rows_helpers.random_rows(n, ROW, seed)


def _load(tier: SecondaryTier, keys: list[bytes], job: int = 2) -> tuple[torch.Tensor, tuple[int, ...]]:
    return rows_helpers.load(tier, keys, ROW, job)


@pytest.mark.parametrize("odirect", [False, True])
def test_round_trip_is_byte_exact(tmp_path: Path, odirect: bool) -> None:
    with FsTier(tmp_path, _ns(), use_odirect=odirect, n_read_threads=2, n_write_threads=2) as tier:
        if odirect and not tier.uses_odirect:
            pytest.skip("this file system refuses O_DIRECT")
        rows, keys = _rows(6), _keys(6)
        assert _store(tier, keys, rows) == ()
        out, failed = _load(tier, keys)
        assert failed == () and torch.equal(out, rows)
        assert tier.lookup([*keys, _keys(1, salt=9)[0]]) == [True] * 6 + [False]
        assert not list(tier.dir.rglob(".tmp-*")), "no temporary file stays behind"
        st = tier.stats()
        assert st.stores == 6 and st.load_hits == 6 and st.bytes_read == 6 * ROW


def test_missing_keys_are_misses_by_index(tmp_path: Path) -> None:
    with FsTier(tmp_path, _ns(), n_read_threads=1, n_write_threads=1) as tier:
        _store(tier, _keys(2), _rows(2))
        keys = [_keys(2)[0], _keys(1, salt=7)[0], _keys(2)[1]]
        out, failed = _load(tier, keys)
        assert failed == (1,)
        assert torch.equal(out[0], _rows(2)[0]) and torch.equal(out[2], _rows(2)[1])


def test_a_new_process_serves_what_the_previous_one_stored(tmp_path: Path) -> None:
    rows, keys = _rows(4, seed=3), _keys(4)
    script = (
        "import sys, torch\n"
        "from kvoffload.tiers._fs import FsTier\n"
        "from tests.tiers.test_fs import _ns, _rows, _keys, _store\n"
        "with FsTier(sys.argv[1], _ns()) as t:\n"
        "    assert _store(t, _keys(4), _rows(4, seed=3)) == ()\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([os.sys.executable, "-c", script, str(tmp_path)], check=True, cwd=root, timeout=120)
    with FsTier(tmp_path, _ns()) as tier:
        assert len(tier) == 4 and tier.total_bytes > 4 * ROW
        out, failed = _load(tier, keys)
        assert failed == () and torch.equal(out, rows)


def test_namespaces_never_read_each_other(tmp_path: Path) -> None:
    a, b, c = _ns(rank=0), _ns(rank=1), _ns(dtype="bfloat16")
    assert len({a.dirname, b.dirname, c.dirname}) == 3
    with FsTier(tmp_path, a) as ta, FsTier(tmp_path, b) as tb, FsTier(tmp_path, c) as tc:
        _store(ta, _keys(3), _rows(3))
        assert tb.lookup(_keys(3)) == [False] * 3 and tc.lookup(_keys(3)) == [False] * 3
        _, failed = _load(tb, _keys(3))
        assert failed == (0, 1, 2)


def test_corrupted_record_is_a_counted_miss_and_deleted(tmp_path: Path) -> None:
    with FsTier(tmp_path, _ns(), use_odirect=False) as tier:
        keys, rows = _keys(3), _rows(3)
        _store(tier, keys, rows)
        path = tier.path_of(keys[1])
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x40
        path.write_bytes(bytes(data))
        with open(tier.path_of(keys[2]), "r+b") as f:
            f.truncate(500)
        out, failed = _load(tier, keys)
        assert failed == (1, 2)
        assert torch.equal(out[0], rows[0])
        assert tier.stats().corrupt_records == 2
        assert not path.exists() and not tier.path_of(keys[2]).exists()
        assert tier.lookup(keys) == [True, False, False]


def test_stale_temp_files_of_dead_writers_are_removed_and_never_served(tmp_path: Path) -> None:
    with FsTier(tmp_path, _ns()) as tier:
        _store(tier, _keys(1), _rows(1))
        sub = tier.path_of(_keys(1)[0]).parent
    dead = subprocess.run([os.sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    torn = sub / f".tmp-{int(dead.stdout)}-0"
    torn.write_bytes(b"half a record")
    with FsTier(tmp_path, _ns()) as tier:
        assert not torn.exists() and len(tier) == 1


def test_capacity_evicts_the_oldest_records(tmp_path: Path) -> None:
    record = ROW + HEADER_SIZE + 36  # header, key, payload
    with FsTier(tmp_path, _ns(), max_bytes=3 * record, use_odirect=False, n_write_threads=1) as tier:
        keys, rows = _keys(5), _rows(5)
        for i in range(5):
            _store(tier, keys[i : i + 1], rows[i : i + 1], job=i)
        assert tier.lookup(keys) == [False, False, True, True, True]
        assert tier.total_bytes <= 3 * record and tier.stats().evictions == 2


@contextlib.contextmanager
def _tiny_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full_marks_the_tier_unavailable_then_it_recovers(tmp_path: Path) -> None:
    with _tiny_tmpfs(tmp_path / "small", "64k") as root:
        tier = FsTier(root, _ns(), retry_backoff_s=0.05, max_backoff_s=0.05, n_write_threads=1)
        try:
            keys, rows = _keys(12), _rows(12)
            failed = _store(tier, keys, rows)
            assert failed, "a 64 KiB file system cannot hold 12 records of 8 KiB"
            st = tier.stats()
            assert st.unavailable_events >= 1 and st.store_failures >= 1 and "No space" in st.last_error
            assert not list(tier.dir.rglob(".tmp-*")), "a failed write leaves no temporary file"
            stored = [k for i, k in enumerate(keys) if i not in failed]
            # Unavailable: lookups miss and stores are dropped without touching the disk.
            if not tier.available:
                assert tier.lookup(stored) == [False] * len(stored)
                tier.submit_store(50, _keys(1, salt=5), _views(_rows(1)))
                assert tier.poll()[0].failed == (0,) and tier.stats().stores_dropped == 1
            # Every record that did get written reads back exactly.
            out, bad = _load_when_available(tier, stored)
            assert bad == ()
            assert all(torch.equal(out[j], rows[keys.index(k)]) for j, k in enumerate(stored))
            tier.clear()
            assert _store_when_available(tier, _keys(2, salt=3), _rows(2)) == ()
        finally:
            tier.close()


def _wait_available(tier: FsTier) -> None:
    import time

    deadline = time.monotonic() + 10
    while not tier.available and time.monotonic() < deadline:
        time.sleep(0.01)


def _load_when_available(tier: FsTier, keys: list[bytes]) -> tuple[torch.Tensor, tuple[int, ...]]:
    _wait_available(tier)
    return _load(tier, keys, job=60)


def _store_when_available(tier: FsTier, keys: list[bytes], rows: torch.Tensor) -> tuple[int, ...]:
    _wait_available(tier)
    return _store(tier, keys, rows, job=61)


def test_an_unusable_root_dir_raises_an_os_error_from_the_constructor_as_in_vllm(tmp_path: Path) -> None:
    """vLLM's fs tier lets ``os.makedirs`` raise (``NotADirectoryError`` for a file in the way); ours raises a
    TierError (an OSError) naming root_dir."""
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    for root in (blocker / "sub", blocker, "/dev/null/invalid_path"):
        with pytest.raises(OSError, match=r"fs tier cannot use root_dir=.*(Not a directory|File exists)") as info:
            FsTier(root, _ns())
        assert isinstance(info.value, TierError)


def test_unwritable_directory_started_down_is_unavailable_not_an_exception(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    with FsTier(blocker / "sub", _ns(), retry_backoff_s=60, start_down=True) as tier:
        assert not tier.available
        assert tier.lookup(_keys(2)) == [False, False]
        tier.submit_store(1, _keys(1), _views(_rows(1)))
        assert tier.poll()[0].failed == (0,)
        assert tier.stats().stores_dropped == 1


def test_a_vanished_directory_is_a_fault_then_recreated(tmp_path: Path) -> None:
    import shutil

    with FsTier(tmp_path, _ns(), retry_backoff_s=0.05, max_backoff_s=0.05, n_write_threads=1) as tier:
        first, second = _keys(2)  # same subdirectory
        assert _store(tier, [first], _rows(1)) == ()
        shutil.rmtree(tier.dir)
        assert _store(tier, [second], _rows(1, seed=1), job=2) == (0,)
        assert tier.stats().unavailable_events == 1
        assert tier.lookup([first]) == [False]
        assert _store_when_available(tier, [second], _rows(1, seed=1)) == ()
        out, failed = _load_when_available(tier, [second])
        assert failed == () and torch.equal(out, _rows(1, seed=1))
