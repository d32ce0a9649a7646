"""Engine-neutral metric figures: the plain-data snapshot a recorder takes, and how snapshots combine."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

__all__ = ["HistogramSample", "MetricSample", "MetricsSnapshot"]


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
