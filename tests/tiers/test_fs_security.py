"""The disk tier as a hostile operator tries it: planted records, forged records, file permissions, bad paths,
and a medium that fails under many jobs at once."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch

from kvoffload.tiers import FsTier, Namespace
from kvoffload.tiers import _record as record_module
from kvoffload.tiers._record import HAVE_BLAKE3, SECRET_ENV
from tests.tiers import rows as rows_helpers
from tests.tiers.rows import keys as _keys
from tests.tiers.rows import store as _store
from tests.tiers.rows import views as _views

ROW = 4096 + 8


def _ns(rank: int = 0) -> Namespace:
    return rows_helpers.namespace(ROW, rank)


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    return rows_helpers.random_rows(n, ROW, seed)


def test_a_record_copied_from_another_rank_is_a_counted_miss_and_deleted(tmp_path: Path) -> None:
    """Rank 1's record of a chunk planted over rank 0's record of the same chunk is never served to rank 0."""
    (key,) = _keys(1)
    with FsTier(tmp_path, _ns(0)) as rank0, FsTier(tmp_path, _ns(1)) as rank1:
        assert _store(rank0, [key], _rows(1, seed=0)) == ()
        assert _store(rank1, [key], _rows(1, seed=1)) == ()
        shutil.copyfile(rank1.path_of(key), rank0.path_of(key))
        out, failed = rows_helpers.load(rank0, [key], ROW)
        assert failed == (0,) and not torch.equal(out[0], _rows(1, seed=1)[0])
        assert rank0.stats().corrupt_records == 1
        assert not rank0.path_of(key).exists(), "the foreign record is deleted"


def test_with_a_secret_a_forged_record_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records written without the secret (a forger with write access) are refused by readers that hold it."""
    (key,) = _keys(1, salt=4)
    with FsTier(tmp_path, _ns()) as forger:  # no secret: valid checksums, no MAC
        assert _store(forger, [key], _rows(1, seed=7)) == ()
    monkeypatch.setenv(SECRET_ENV, "correct horse battery staple")
    with FsTier(tmp_path, _ns(), scan=False) as reader:
        _out, failed = rows_helpers.load(reader, [key], ROW)
        assert failed == (0,) and reader.stats().corrupt_records == 1
        assert _store(reader, [key], _rows(1, seed=8), job=3) == ()
        out, failed = rows_helpers.load(reader, [key], ROW, job=4)
        assert failed == () and torch.equal(out[0], _rows(1, seed=8)[0])


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_records_are_private_by_default_and_shared_on_request(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        (key,) = _keys(1)
        with FsTier(tmp_path / "private", _ns()) as tier:
            assert _store(tier, [key], _rows(1)) == ()
            record = tier.path_of(key)
            assert _mode(record) == 0o600
            assert _mode(record.parent) == _mode(tier.dir) == _mode(tier.root_dir) == 0o700
            assert _mode(tier.dir / "namespace.json") == 0o600
        with FsTier(tmp_path / "group", _ns(), file_mode=0o660) as tier:
            assert _store(tier, [key], _rows(1)) == ()
            assert _mode(tier.path_of(key)) == 0o660  # exactly as asked, whatever the umask
            assert _mode(tier.path_of(key).parent) == 0o770
    finally:
        os.umask(old)


def test_a_path_too_long_for_the_file_system_is_a_miss_not_an_exception(tmp_path: Path) -> None:
    root = tmp_path / ("x" * 5000)
    with FsTier(root, _ns(), retry_backoff_s=60, start_down=True) as tier:
        assert tier.lookup(_keys(3)) == [False, False, False]
        tier.submit_store(1, _keys(1), _views(_rows(1)))
        assert tier.wait([1], 10)
        assert tier.poll()[0].failed == (0,)


def test_one_outage_doubles_the_back_off_once_however_many_jobs_fail(tmp_path: Path) -> None:
    """Eight jobs failing at once are one outage: the back-off doubles once (not to its maximum), and the tier
    is available again after that one back-off."""
    with FsTier(tmp_path, _ns(), n_write_threads=8, retry_backoff_s=0.2, max_backoff_s=30.0) as tier:
        assert _store(tier, _keys(1), _rows(1)) == ()
        shutil.rmtree(tier.dir)
        tier.dir.write_bytes(b"")  # the namespace directory is now a file: every write fails
        for job in range(8):
            tier.submit_store(10 + job, _keys(4, salt=job + 1), _views(_rows(4, seed=job)))
        assert tier.wait(list(range(10, 18)), 10)
        assert all(r.failed for r in tier.poll())
        st = tier.stats()
        assert st.unavailable_events == 1 and not st.available
        deadline = time.monotonic() + 5
        while not tier.available and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier.available, "one outage backs off once (0.2 s here), not up to max_backoff_s"


@pytest.mark.skipif(not HAVE_BLAKE3, reason="the blake3 package is not installed (a dev dependency)")
def test_a_reader_without_blake3_misses_a_blake3_record_and_leaves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet being upgraded: an engine without the blake3 package meets a record an upgraded engine MACed with
    BLAKE3. It cannot verify it, so it is a miss, but the sound record is not deleted: the upgraded engine still
    reads it."""
    (key,) = _keys(1, salt=5)
    monkeypatch.setenv(SECRET_ENV, "correct horse battery staple")
    with FsTier(tmp_path, _ns()) as writer:
        assert _store(writer, [key], _rows(1, seed=9)) == ()
    monkeypatch.setattr(record_module, "_blake3", None)  # this process as one without the package
    with FsTier(tmp_path, _ns(), scan=False) as old_reader:
        _out, failed = rows_helpers.load(old_reader, [key], ROW)
        assert failed == (0,) and old_reader.stats().corrupt_records == 0
        assert old_reader.path_of(key).exists(), "a sound record this reader cannot verify stays"
    monkeypatch.undo()
    monkeypatch.setenv(SECRET_ENV, "correct horse battery staple")
    with FsTier(tmp_path, _ns(), scan=False) as new_reader:
        out, failed = rows_helpers.load(new_reader, [key], ROW)
        assert failed == () and torch.equal(out[0], _rows(1, seed=9)[0])
