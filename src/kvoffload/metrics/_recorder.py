"""The recording core shared by the scheduler and worker metrics: bound series and the recorder that owns them.

A recorder creates prometheus families on the owner's registry (or none), binds one child per label set at
construction, and keeps the figures since the previous snapshot alongside, so a record costs one attribute add
and one child call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvoffload._ints import check_int
from kvoffload.errors import ConfigError
from kvoffload.metrics._samples import HistogramSample, MetricSample, MetricsSnapshot

PREFIX = "kvoffload"
"""Prefix of every series name (``kvoffload_load_bytes``)."""

_DEFAULT_MAX_SAMPLES = 4096


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
