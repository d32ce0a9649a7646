"""Scheduler-side metrics: lookups, hits, misses by reason, tokens moved, failures, evictions and pool usage."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from kvoffload._generated import MissReason
from kvoffload.errors import ConfigError
from kvoffload.metrics._recorder import _DEFAULT_MAX_SAMPLES, _BoundCounter, _BoundGauge, _check_tier, _Recorder
from kvoffload.metrics._samples import MetricsSnapshot
from kvoffload.metrics._tiers import TIER_METRICS, TIERING_METRICS
from kvoffload.offload.scheduler import SchedulerStats

if TYPE_CHECKING:
    from kvoffload.offload.scheduler import ExtensionFigures, OffloadScheduler

__all__ = ["ALLOCATION_BUCKETS", "STAT_METRICS", "SchedulerMetrics"]

ALLOCATION_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
"""Chunks allocated per store offer (vLLM's ``kv_offload_cpu_allocation_size`` buckets)."""


STAT_METRICS: dict[str, str] = {
    # SchedulerStats field -> metric name (vLLM's name without its prefix where vLLM has one), for engines that
    # export the scheduler's totals under their own registry (the vLLM connector's interval stats, which map
    # load_bytes, load_time, store_bytes, store_time and allocation_failure to vLLM's vllm:kv_offload_* names)
    "lookups": "lookups",
    "lookups_deferred": "lookups_deferred",
    "lookup_hits": "lookup_hits",
    "lookup_misses": "lookup_misses",
    "tokens_loaded": "load_tokens",
    "tokens_stored": "store_tokens",
    "bytes_loaded": "load_bytes",
    "bytes_stored": "store_bytes",
    "load_seconds": "load_time",
    "store_seconds": "store_time",
    "failed_loads": "failed_loads",
    "failed_stores": "failed_stores",
    "corrupt_loads": "corrupted_loads",
    "allocation_failures": "allocation_failure",
    "pending_recomputes": "pending_recomputes",
    "shared_loads": "shared_loads",
    "sync_loads": "sync_loads",
}
"""What each counter of :class:`~kvoffload.offload.scheduler.SchedulerStats` is called as a metric."""


class SchedulerMetrics:
    """Scheduler-side metrics, pulled from an :class:`OffloadScheduler` once per step by :meth:`observe`.

    ``registry`` is the embedding application's registry (None: no Prometheus series, snapshots only);
    ``tier`` labels the host pool's series. Tiers report their drops through :meth:`record_backpressure_drops`.
    With secondary tiers (:class:`~kvoffload.tiers.Tiering`) each tier's figures are series too, labelled by its
    kind and index (``fs0``): outages, availability, residency (``tier_resident_bytes``, ``tier_resident_records``)
    and the counters of :data:`~kvoffload.metrics.TIER_METRICS`.
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

        fam = r.counter_family("lookups", "Lookups of requests in the offload pool, once per final answer.")
        self.lookups = r.counter(fam, "lookups")
        fam = r.counter_family("lookup_hits", "Lookups that found at least one chunk to load.")
        self.lookup_hits = r.counter(fam, "lookup_hits")
        fam = r.counter_family(
            "lookup_misses", "Lookups that loaded nothing, by the reason of their first missed chunk.", ("reason",)
        )
        self.lookup_misses = {MissReason(x): r.counter(fam, "lookup_misses", reason=x) for x in reasons}
        fam = r.counter_family(
            "lookups_deferred", "Re-asks: lookups answered 'ask again later' (a store, load or tier query in flight)."
        )
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
        self._outages_family = r.counter_family(
            "tier_outages", "Times a secondary tier went unavailable, as the scheduler saw it.", ("tier",)
        )
        self._available_family = r.gauge_family(
            "tier_available", "1 while a secondary tier answers the scheduler's lookups, 0 while it is down.", ("tier",)
        )
        self._resident_families = {
            "resident_bytes": r.gauge_family(
                "tier_resident_bytes", "Bytes of records a secondary tier holds (its workers' instances).", ("tier",)
            ),
            "resident_records": r.gauge_family(
                "tier_resident_records", "Records a secondary tier holds (its workers' instances).", ("tier",)
            ),
        }
        self._resident: dict[tuple[str, str], _BoundGauge] = {}
        self._outages: dict[str, _BoundCounter] = {}
        self._available: dict[str, _BoundGauge] = {}
        self._seen_outages: dict[str, int] = {}
        self._tier_families = {f: r.counter_family(n, doc, ("tier",)) for f, (n, _, doc) in TIER_METRICS.items()}
        self._tier_series: dict[tuple[str, str], _BoundCounter] = {}  # (row field, tier label) -> series
        self._tiering_series: dict[str, _BoundCounter] = {}  # bound with the first tiers seen
        self._seen_tier: dict[tuple[str, str], float] = {}
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
        self._seen = SchedulerStats()
        self._seen_evicted = 0
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
        mstats = manager.stats()
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
            (self.corrupted_loads, stats.corrupt_loads, "corrupt_loads"),
        ):
            delta = total - getattr(seen, attr)
            if delta > 0:
                series.inc(delta)
        self._seen = stats
        if mstats.evicted > self._seen_evicted:
            self.evictions.inc(mstats.evicted - self._seen_evicted)
            self._seen_evicted = mstats.evicted
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
        self._observe_tiers(sched.extension.figures())
        return True

    def _observe_tiers(self, figures: ExtensionFigures) -> None:
        """Each secondary tier's outages, availability and counters (``tier`` label: kind and index, ``fs0``)."""
        if not figures.tiers:
            return
        for row in figures.tiers:
            label = row.label
            if label not in self._outages:
                self._outages[label] = self._rec.counter(self._outages_family, "tier_outages", tier=label)
                self._available[label] = self._rec.gauge(self._available_family, "tier_available", tier=label)
                self._seen_outages[label] = 0
            delta = row.outages - self._seen_outages[label]
            if delta > 0:
                self._outages[label].inc(delta)
                self._seen_outages[label] = row.outages
            self._available[label].set(1.0 if row.available else 0.0)
            for field, gauge_family in self._resident_families.items():
                if (field, label) not in self._resident:
                    name = f"tier_{field}"
                    self._resident[(field, label)] = self._rec.gauge(gauge_family, name, tier=label)
                self._resident[(field, label)].set(float(getattr(row, field)))
            for field, family in self._tier_families.items():
                key = (field, label)
                if key not in self._tier_series:
                    self._tier_series[key] = self._rec.counter(family, TIER_METRICS[field][0], tier=label)
                self._advance(key, getattr(row, field))
        if not self._tiering_series:
            for name, (metric, _, doc) in TIERING_METRICS.items():
                self._tier_series[(name, "")] = self._rec.counter(self._rec.counter_family(metric, doc), metric)
                self._tiering_series[name] = self._tier_series[(name, "")]
        for name in self._tiering_series:
            self._advance((name, ""), figures.counters.get(name, 0))

    def _advance(self, key: tuple[str, str], total: float) -> None:
        """Add what ``total`` grew by since the last reading to the series of ``key``."""
        delta = total - self._seen_tier.get(key, 0)
        if delta > 0:
            self._tier_series[key].inc(delta)
            self._seen_tier[key] = total

    def take_snapshot(self) -> MetricsSnapshot:
        """The figures since the previous snapshot, engine-neutral (see :class:`MetricsSnapshot`)."""
        return self._rec.take_snapshot()
