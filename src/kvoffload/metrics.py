"""Prometheus metrics for the scheduler and the workers, plus an engine-neutral snapshot of the same figures.

Two recorders, one per side of the wire, each registering its metrics on a ``CollectorRegistry`` the embedding
application owns (nothing is registered at import, nothing touches prometheus_client's global registry):

* :class:`SchedulerMetrics` (scheduler process): lookups, hits, misses per :class:`MissReason`, tokens moved,
  failed and corrupted loads, evictions, allocation failures, backpressure drops, pool usage gauges. It pulls
  the scheduler's cumulative stats once per step (:meth:`SchedulerMetrics.observe`), so the scheduler's hot
  paths carry no metric calls at all.
* :class:`WorkerMetrics` (each worker process): bytes and seconds of every finished transfer, recorded from the
  worker's :class:`WorkerReport`. Spawned workers write through prometheus_client's multiprocess mode: the
  parent spawns them inside :func:`multiprocess_env`, reads their files with :func:`add_worker_collector`, and
  calls :func:`mark_worker_dead` when one exits.

Names follow vLLM 0.33's offloading metrics (``vllm:kv_offload_load_bytes`` -> ``kvoffload_load_bytes``) where vLLM
has one; ``tier`` labels the offload tier (``host`` for the host pool) and ``direction`` is ``load`` (towards the
engine) or ``store``. Label children are bound once at construction: a record costs one attribute add and one
child call.

Every recorder also keeps the figures since its previous :meth:`take_snapshot` call, returned as a plain
:class:`MetricsSnapshot` (counters as deltas, gauges as current values, histograms as count, sum and samples) that
an engine integration can forward to its own stats system and :meth:`MetricsSnapshot.aggregate` across workers.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from ._generated import MissReason, WorkerReport
from ._ints import check_int
from .errors import ConfigError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from .offload.scheduler import OffloadScheduler

__all__ = [
    "ALLOCATION_BUCKETS",
    "MULTIPROC_ENV",
    "SIZE_BUCKETS",
    "TIME_BUCKETS",
    "HistogramSample",
    "MetricSample",
    "MetricsServer",
    "MetricsSnapshot",
    "SchedulerMetrics",
    "WorkerMetrics",
    "add_worker_collector",
    "mark_worker_dead",
    "multiprocess_env",
    "serve_metrics",
]

PREFIX = "kvoffload"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""The environment variable prometheus_client's multiprocess mode reads when it is imported."""

SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
"""Bytes per transfer job (vLLM's ``kv_offload_load_size`` / ``store_size`` buckets)."""
TIME_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0, 10.0)
"""Seconds per transfer job."""
ALLOCATION_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
"""Chunks allocated per store offer (vLLM's ``kv_offload_cpu_allocation_size`` buckets)."""

_DEFAULT_MAX_SAMPLES = 4096


# ----------------------------------------------------------------------------------------------- snapshot


class MetricSample(msgspec.Struct, frozen=True, kw_only=True):
    """One counter or gauge series: its full name (``kvoffload_...``), labels and value."""

    name: str
    labels: dict[str, str] = {}
    value: float


class HistogramSample(msgspec.Struct, frozen=True, kw_only=True):
    """One histogram series: observations since the previous snapshot (``samples`` may hold fewer than
    ``count`` when a recorder's sample cap was reached; ``count`` and ``sum`` are always exact)."""

    name: str
    labels: dict[str, str] = {}
    count: int
    sum: float
    samples: tuple[float, ...] = ()


def _series_key(name: str, labels: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


class MetricsSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Engine-neutral figures of one recorder (or several, aggregated): plain data, msgspec/pickle safe.

    Counters are increments since the previous snapshot, gauges the current values, histograms the
    observations since the previous snapshot. :meth:`aggregate` combines snapshots of several processes as
    vLLM's connector stats do: counters add, gauges take the later value, histograms add up and concatenate.
    """

    counters: tuple[MetricSample, ...] = ()
    gauges: tuple[MetricSample, ...] = ()
    histograms: tuple[HistogramSample, ...] = ()

    def is_empty(self) -> bool:
        """True when no counter moved, no gauge is set and nothing was observed."""
        return not self.gauges and not any(c.value for c in self.counters) and not any(h.count for h in self.histograms)

    def aggregate(self, *others: MetricsSnapshot) -> MetricsSnapshot:
        """This snapshot combined with ``others`` (counters add, gauges: last one wins, histograms merge)."""
        counters: dict[tuple[str, tuple[tuple[str, str], ...]], MetricSample] = {}
        gauges: dict[tuple[str, tuple[tuple[str, str], ...]], MetricSample] = {}
        histograms: dict[tuple[str, tuple[tuple[str, str], ...]], HistogramSample] = {}
        for snap in (self, *others):
            for c in snap.counters:
                key = _series_key(c.name, c.labels)
                old = counters.get(key)
                counters[key] = c if old is None else msgspec.structs.replace(old, value=old.value + c.value)
            for g in snap.gauges:
                gauges[_series_key(g.name, g.labels)] = g
            for h in snap.histograms:
                key = _series_key(h.name, h.labels)
                prev = histograms.get(key)
                histograms[key] = (
                    h
                    if prev is None
                    else msgspec.structs.replace(
                        prev, count=prev.count + h.count, sum=prev.sum + h.sum, samples=prev.samples + h.samples
                    )
                )
        return MetricsSnapshot(
            counters=tuple(counters.values()), gauges=tuple(gauges.values()), histograms=tuple(histograms.values())
        )

    def reduce(self) -> dict[str, float]:
        """One flat number per series, for logs (vLLM's ``reduce``): ``name{label=value,...}`` for counters and
        gauges, ``..._count`` and ``..._sum`` for histograms."""
        out: dict[str, float] = {}
        for c in self.counters:
            key = _series_name(c.name, c.labels)
            out[key] = out.get(key, 0.0) + c.value
        for g in self.gauges:
            out[_series_name(g.name, g.labels)] = g.value
        for h in self.histograms:
            out[_series_name(f"{h.name}_count", h.labels)] = float(h.count)
            out[_series_name(f"{h.name}_sum", h.labels)] = h.sum
        return out

    def counter(self, name: str, **labels: str) -> float:
        """The summed value of counter ``name`` over its series matching ``labels`` (0.0 when none)."""
        return sum(c.value for c in self.counters if c.name == name and _matches(c.labels, labels))

    def gauge(self, name: str, **labels: str) -> float | None:
        """The value of the first gauge series ``name`` matching ``labels``, or None."""
        return next((g.value for g in self.gauges if g.name == name and _matches(g.labels, labels)), None)

    def histogram(self, name: str, **labels: str) -> HistogramSample | None:
        """The first histogram series ``name`` matching ``labels``, or None."""
        return next((h for h in self.histograms if h.name == name and _matches(h.labels, labels)), None)


def _series_name(name: str, labels: Mapping[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def _matches(have: Mapping[str, str], want: Mapping[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())


# ------------------------------------------------------------------------------------- bound series


class _Series:
    __slots__ = ("labels", "name")

    def __init__(self, name: str, labels: dict[str, str]) -> None:
        self.name = name
        self.labels = labels


class _BoundCounter(_Series):
    """One counter series: the bound prometheus child (if registered) and the increments since the last take."""

    __slots__ = ("_child", "delta")

    def __init__(self, family: Counter | None, name: str, labels: dict[str, str]) -> None:
        super().__init__(name, labels)
        self._child = None if family is None else (family.labels(**labels) if labels else family)
        self.delta = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0)."""
        self.delta += amount
        if self._child is not None:
            self._child.inc(amount)


class _BoundGauge(_Series):
    __slots__ = ("_child", "value")

    def __init__(self, family: Gauge | None, name: str, labels: dict[str, str]) -> None:
        super().__init__(name, labels)
        self._child = None if family is None else (family.labels(**labels) if labels else family)
        self.value: float | None = None

    def set(self, value: float) -> None:
        """Set the current value (the prometheus child is only written when it changes)."""
        if value != self.value:
            self.value = value
            if self._child is not None:
                self._child.set(value)


class _BoundHistogram(_Series):
    __slots__ = ("_child", "_max_samples", "count", "samples", "sum")

    def __init__(self, family: Histogram | None, name: str, labels: dict[str, str], max_samples: int) -> None:
        super().__init__(name, labels)
        self._child = None if family is None else (family.labels(**labels) if labels else family)
        self._max_samples = max_samples
        self.count = 0
        self.sum = 0.0
        self.samples: list[float] = []

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.count += 1
        self.sum += value
        if len(self.samples) < self._max_samples:
            self.samples.append(value)
        if self._child is not None:
            self._child.observe(value)


class _Recorder:
    """Creates families on the owner's registry (or none), binds series, and takes snapshots."""

    def __init__(self, registry: CollectorRegistry | None, max_samples: int) -> None:
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise ConfigError(f"registry must be a prometheus_client CollectorRegistry or None, got {registry!r}")
        check_int("max_samples", max_samples)
        self.registry = registry
        self._max_samples = max_samples
        self._counters: list[_BoundCounter] = []
        self._gauges: list[_BoundGauge] = []
        self._histograms: list[_BoundHistogram] = []
        self._lock = threading.Lock()

    def counter_family(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> Counter | None:
        if self.registry is None:
            return None
        return Counter(f"{PREFIX}_{name}", doc, labelnames, registry=self.registry)

    def gauge_family(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> Gauge | None:
        if self.registry is None:
            return None
        return Gauge(f"{PREFIX}_{name}", doc, labelnames, registry=self.registry, multiprocess_mode="mostrecent")

    def histogram_family(
        self, name: str, doc: str, buckets: Sequence[float], labelnames: Sequence[str] = ()
    ) -> Histogram | None:
        if self.registry is None:
            return None
        return Histogram(f"{PREFIX}_{name}", doc, labelnames, registry=self.registry, buckets=tuple(buckets))

    def counter(self, family: Counter | None, name: str, **labels: str) -> _BoundCounter:
        series = _BoundCounter(family, f"{PREFIX}_{name}", labels)
        self._counters.append(series)
        return series

    def gauge(self, family: Gauge | None, name: str, **labels: str) -> _BoundGauge:
        series = _BoundGauge(family, f"{PREFIX}_{name}", labels)
        self._gauges.append(series)
        return series

    def histogram(self, family: Histogram | None, name: str, **labels: str) -> _BoundHistogram:
        series = _BoundHistogram(family, f"{PREFIX}_{name}", labels, self._max_samples)
        self._histograms.append(series)
        return series

    def take_snapshot(self) -> MetricsSnapshot:
        """Figures since the previous call (counters and histograms restart from zero)."""
        with self._lock:
            counters = []
            for c in self._counters:
                if c.delta:
                    counters.append(MetricSample(name=c.name, labels=dict(c.labels), value=c.delta))
                    c.delta = 0.0
            gauges = [
                MetricSample(name=g.name, labels=dict(g.labels), value=g.value)
                for g in self._gauges
                if g.value is not None
            ]
            histograms = []
            for h in self._histograms:
                if h.count:
                    histograms.append(
                        HistogramSample(
                            name=h.name, labels=dict(h.labels), count=h.count, sum=h.sum, samples=tuple(h.samples)
                        )
                    )
                    h.count, h.sum, h.samples = 0, 0.0, []
        return MetricsSnapshot(counters=tuple(counters), gauges=tuple(gauges), histograms=tuple(histograms))


def _check_tier(tier: str) -> str:
    if not isinstance(tier, str) or not tier:
        raise ConfigError(f"tier must be a non-empty str, got {tier!r}")
    return tier


# ------------------------------------------------------------------------------------------ scheduler


@dataclass(slots=True)
class _Totals:
    """The cumulative figures SchedulerMetrics last saw, to turn totals into increments."""

    lookups: int = 0
    lookup_hits: int = 0
    lookups_deferred: int = 0
    tokens_loaded: int = 0
    tokens_stored: int = 0
    allocation_failures: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    evicted: int = 0
    corrupt_loads: int = 0


class SchedulerMetrics:
    """Scheduler-side metrics, pulled from an :class:`OffloadScheduler` once per step by :meth:`observe`.

    ``registry`` is the embedding application's registry (None: no Prometheus series, snapshots only);
    ``tier`` labels the host pool's series. Tiers report their drops through :meth:`record_backpressure_drops`.
    ``min_interval_s`` rate-limits :meth:`observe` (reading the stats costs ~20 us): calls closer together are
    skipped, losing nothing since the figures are cumulative; pass ``force=True`` for the final reading.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        tier: str = "host",
        max_samples: int = _DEFAULT_MAX_SAMPLES,
        min_interval_s: float = 0.05,
    ) -> None:
        self.tier = _check_tier(tier)
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, int | float) or min_interval_s < 0:
            raise ConfigError(f"min_interval_s must be a number >= 0, got {min_interval_s!r}")
        self._min_interval_s = float(min_interval_s)
        self._last_observed = -math.inf
        r = self._rec = _Recorder(registry, max_samples)
        reasons = [m.value for m in MissReason]

        fam = r.counter_family("lookups", "Lookups of requests in the offload pool.")
        self.lookups = r.counter(fam, "lookups")
        fam = r.counter_family("lookup_hits", "Lookups that found at least one chunk to load.")
        self.lookup_hits = r.counter(fam, "lookup_hits")
        fam = r.counter_family(
            "lookup_misses", "Lookups that loaded nothing, by the reason of their first missed chunk.", ("reason",)
        )
        self.lookup_misses = {MissReason(x): r.counter(fam, "lookup_misses", reason=x) for x in reasons}
        fam = r.counter_family("lookups_deferred", "Lookups answered 'ask again later' (a store or load in flight).")
        self.lookups_deferred = r.counter(fam, "lookups_deferred")
        fam = r.counter_family("chunk_misses", "Wanted chunks that lookups did not load, by reason.", ("reason",))
        self.chunk_misses = {MissReason(x): r.counter(fam, "chunk_misses", reason=x) for x in reasons}

        fam = r.counter_family("load_tokens", "Tokens loaded from the tier into the engine.", ("tier",))
        self.load_tokens = r.counter(fam, "load_tokens", tier=tier)
        fam = r.counter_family("store_tokens", "Tokens stored from the engine into the tier.", ("tier",))
        self.store_tokens = r.counter(fam, "store_tokens", tier=tier)
        fam = r.counter_family("failed_loads", "Load jobs that failed (the engine recomputes).", ("tier",))
        self.failed_loads = r.counter(fam, "failed_loads", tier=tier)
        fam = r.counter_family("failed_stores", "Store jobs that failed (their chunks were freed).", ("tier",))
        self.failed_stores = r.counter(fam, "failed_stores", tier=tier)
        fam = r.counter_family(
            "chunks_removed", "Chunks dropped as unusable (corrupt, forget_chunk), by reason.", ("tier", "reason")
        )
        self.chunks_removed = {MissReason(x): r.counter(fam, "chunks_removed", tier=tier, reason=x) for x in reasons}
        fam = r.counter_family(
            "corrupted_loads", "Load jobs failed because a chunk did not verify (the request recomputes).", ("tier",)
        )
        self.corrupted_loads = r.counter(fam, "corrupted_loads", tier=tier)
        fam = r.counter_family("evictions", "Chunks evicted by the cache policy.", ("tier",))
        self.evictions = r.counter(fam, "evictions", tier=tier)
        fam = r.counter_family("allocation_failure", "Store offers that could not get room in the pool.")
        self.allocation_failure = r.counter(fam, "allocation_failure")
        fam = r.counter_family("stores_skipped", "Offered chunks below the store threshold (not stored).")
        self.stores_skipped = r.counter(fam, "stores_skipped")
        self._drops_family = r.counter_family(
            "backpressure_drops", "Stores a tier dropped under backpressure.", ("tier",)
        )
        self._drops: dict[str, _BoundCounter] = {}
        fam = r.counter_family("kv_event_batches", "KV event batches published, by outcome.", ("outcome",))
        self.event_batches_sent = r.counter(fam, "kv_event_batches", outcome="sent")
        self.event_batches_dropped = r.counter(fam, "kv_event_batches", outcome="dropped")

        gfam = r.gauge_family(
            "cpu_cache_usage_perc", "Share of host chunks that cannot be evicted (pending or pinned)."
        )
        self.usage = r.gauge(gfam, "cpu_cache_usage_perc")
        gfam = r.gauge_family("cpu_cache_write_usage_perc", "Share of host chunks whose store is in flight.")
        self.write_usage = r.gauge(gfam, "cpu_cache_write_usage_perc")
        gfam = r.gauge_family("cpu_cache_read_usage_perc", "Share of host chunks pinned by loads.")
        self.read_usage = r.gauge(gfam, "cpu_cache_read_usage_perc")
        gfam = r.gauge_family("pool_chunks", "Chunks of the pool by state.", ("tier", "state"))
        self.pool_chunks = {
            state: r.gauge(gfam, "pool_chunks", tier=tier, state=state)
            for state in ("capacity", "free", "write_pending", "ready", "pinned")
        }
        hfam = r.histogram_family("cpu_allocation_size", "Chunks allocated per store offer.", ALLOCATION_BUCKETS)
        self.allocation_size = r.histogram(hfam, "cpu_allocation_size")
        self._seen = _Totals()
        self._seen_reasons: dict[str, dict[MissReason, int]] = {"lookup": {}, "chunk": {}, "removed": {}}
        self._seen_batches = (0, 0)

    @property
    def registry(self) -> CollectorRegistry | None:
        """The registry the series are registered on (None: snapshots only)."""
        return self._rec.registry

    def record_backpressure_drops(self, tier: str, count: int = 1) -> None:
        """Count ``count`` stores that ``tier`` dropped under backpressure (its series is bound on first use)."""
        series = self._drops.get(tier)
        if series is None:
            series = self._drops[_check_tier(tier)] = self._rec.counter(
                self._drops_family, "backpressure_drops", tier=tier
            )
        series.inc(count)

    def record_event_batches(self, sent: int, dropped: int) -> None:
        """Set the publisher's cumulative batch counts (sent and dropped); the increments are recorded."""
        old_sent, old_dropped = self._seen_batches
        if sent > old_sent:
            self.event_batches_sent.inc(sent - old_sent)
        if dropped > old_dropped:
            self.event_batches_dropped.inc(dropped - old_dropped)
        self._seen_batches = (max(sent, old_sent), max(dropped, old_dropped))

    def observe(self, sched: OffloadScheduler, *, force: bool = False) -> bool:
        """Record what changed in ``sched`` since the previous reading; False when skipped by ``min_interval_s``.

        Call it once per step, and with ``force=True`` at the end (or before a snapshot that must be exact).
        """
        now = time.monotonic()
        if not force and now - self._last_observed < self._min_interval_s:
            return False
        self._last_observed = now
        manager = sched.manager
        mstats = manager.stats()  # first: the scheduler's stats() would consume the allocation sizes
        stats = sched.stats()
        seen = self._seen
        for series, total, attr in (
            (self.lookups, stats.lookups, "lookups"),
            (self.lookup_hits, stats.lookup_hits, "lookup_hits"),
            (self.lookups_deferred, stats.lookups_deferred, "lookups_deferred"),
            (self.load_tokens, stats.tokens_loaded, "tokens_loaded"),
            (self.store_tokens, stats.tokens_stored, "tokens_stored"),
            (self.allocation_failure, stats.allocation_failures, "allocation_failures"),
            (self.failed_loads, stats.failed_loads, "failed_loads"),
            (self.failed_stores, stats.failed_stores, "failed_stores"),
            (self.evictions, mstats.evicted, "evicted"),
            (self.corrupted_loads, stats.corrupt_loads, "corrupt_loads"),
        ):
            delta = total - getattr(seen, attr)
            if delta > 0:
                series.inc(delta)
                setattr(seen, attr, total)
        for kind, totals, bound in (
            ("lookup", stats.lookup_miss_reasons, self.lookup_misses),
            ("chunk", stats.chunk_miss_reasons, self.chunk_misses),
            ("removed", stats.chunks_removed, self.chunks_removed),
        ):
            last = self._seen_reasons[kind]
            for reason, total in totals.items():
                delta = total - last.get(reason, 0)
                if delta > 0:
                    bound[reason].inc(delta)
                    last[reason] = total
        if mstats.stores_skipped:
            self.stores_skipped.inc(mstats.stores_skipped)
        for size in mstats.allocation_sizes:
            self.allocation_size.observe(size)
        self.usage.set(mstats.usage)
        self.write_usage.set(mstats.write_usage)
        self.read_usage.set(mstats.read_usage)
        num = mstats.num_chunks
        free = manager.num_free_chunks
        ready = manager.num_evictable_chunks
        pending = round(mstats.write_usage * num)
        chunks = self.pool_chunks
        chunks["capacity"].set(num)
        chunks["free"].set(free)
        chunks["write_pending"].set(pending)
        chunks["ready"].set(ready)
        chunks["pinned"].set(num - free - pending - ready)
        return True

    def take_snapshot(self) -> MetricsSnapshot:
        """The figures since the previous snapshot, engine-neutral (see :class:`MetricsSnapshot`)."""
        return self._rec.take_snapshot()


# --------------------------------------------------------------------------------------------- worker


class WorkerMetrics:
    """Worker-side transfer metrics, recorded from each :class:`WorkerReport` the worker sends.

    In a spawned worker (multiprocess mode) ``registry`` may be a private ``CollectorRegistry()``: the values
    go to the multiprocess directory either way, and the parent's :func:`add_worker_collector` sums them.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, tier: str = "host", max_samples: int = _DEFAULT_MAX_SAMPLES
    ) -> None:
        self.tier = _check_tier(tier)
        r = self._rec = _Recorder(registry, max_samples)
        fam = r.counter_family("load_bytes", "Bytes loaded from the tier into the engine.", ("tier",))
        self.load_bytes = r.counter(fam, "load_bytes", tier=tier)
        fam = r.counter_family("load_time", "Seconds spent loading (sum over jobs).", ("tier",))
        self.load_time = r.counter(fam, "load_time", tier=tier)
        fam = r.counter_family("store_bytes", "Bytes stored from the engine into the tier.", ("tier",))
        self.store_bytes = r.counter(fam, "store_bytes", tier=tier)
        fam = r.counter_family("store_time", "Seconds spent storing (sum over jobs).", ("tier",))
        self.store_time = r.counter(fam, "store_time", tier=tier)
        hfam = r.histogram_family("load_size", "Bytes per load job.", SIZE_BUCKETS, ("tier",))
        self.load_size = r.histogram(hfam, "load_size", tier=tier)
        hfam = r.histogram_family("store_size", "Bytes per store job.", SIZE_BUCKETS, ("tier",))
        self.store_size = r.histogram(hfam, "store_size", tier=tier)
        hfam = r.histogram_family("transfer_seconds", "Seconds per transfer job.", TIME_BUCKETS, ("tier", "direction"))
        self.load_seconds = r.histogram(hfam, "transfer_seconds", tier=tier, direction="load")
        self.store_seconds = r.histogram(hfam, "transfer_seconds", tier=tier, direction="store")
        fam = r.counter_family("transfer_failures", "Transfer jobs a worker failed.", ("tier", "direction"))
        self.load_failures = r.counter(fam, "transfer_failures", tier=tier, direction="load")
        self.store_failures = r.counter(fam, "transfer_failures", tier=tier, direction="store")

    @property
    def registry(self) -> CollectorRegistry | None:
        """The registry the series are registered on (None: snapshots only)."""
        return self._rec.registry

    def record(self, report: WorkerReport) -> None:
        """Record every job result of ``report``: sizes and times per job, byte and time totals once per report."""
        load_bytes = store_bytes = load_failed = store_failed = 0
        load_time = store_time = 0.0
        for result in report.results:
            if result.is_store:
                store_bytes += result.num_bytes
                store_time += result.seconds
                store_failed += not result.success
                self.store_size.observe(result.num_bytes)
                self.store_seconds.observe(result.seconds)
            else:
                load_bytes += result.num_bytes
                load_time += result.seconds
                load_failed += not result.success
                self.load_size.observe(result.num_bytes)
                self.load_seconds.observe(result.seconds)
        if load_bytes or load_time:
            self.load_bytes.inc(load_bytes)
            self.load_time.inc(load_time)
        if store_bytes or store_time:
            self.store_bytes.inc(store_bytes)
            self.store_time.inc(store_time)
        if load_failed:
            self.load_failures.inc(load_failed)
        if store_failed:
            self.store_failures.inc(store_failed)

    def take_snapshot(self) -> MetricsSnapshot:
        """The figures since the previous snapshot, engine-neutral (see :class:`MetricsSnapshot`)."""
        return self._rec.take_snapshot()


# ------------------------------------------------------------------------------------ multiprocess, HTTP


@contextlib.contextmanager
def multiprocess_env(path: str | os.PathLike[str]) -> Iterator[None]:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` to ``path`` while processes are spawned, then restore it.

    A spawned child inherits the variable, so its prometheus_client starts in multiprocess mode and writes its
    values under ``path``; this process's own metrics are unaffected (the mode is fixed when prometheus_client
    is imported).
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise ConfigError(f"metrics directory {directory!r} does not exist")
    old = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = directory
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = old


def add_worker_collector(registry: CollectorRegistry, path: str | os.PathLike[str]) -> MultiProcessCollector:
    """Make ``registry`` also expose the metrics worker processes write under ``path`` (summed over workers)."""
    return MultiProcessCollector(registry, path=os.fspath(path))  # type: ignore[no-untyped-call]


def mark_worker_dead(pid: int, path: str | os.PathLike[str]) -> None:
    """Tell prometheus_client that worker ``pid`` exited: its live gauges go, its counters stay counted."""
    mark_process_dead(pid, os.fspath(path))  # type: ignore[no-untyped-call]


class MetricsServer:
    """An HTTP server exposing ``registry`` at ``/metrics`` on a background thread (see :func:`serve_metrics`)."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        """The bound port (useful after asking for port 0)."""
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = self._server.server_address[0]
        name = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{name}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(registry: CollectorRegistry, port: int, *, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` at ``http://addr:port/metrics`` until :meth:`MetricsServer.close` (port 0: any free)."""
    check_int("metrics port", port, 0, 65535)
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None
    return MetricsServer(server, thread)
