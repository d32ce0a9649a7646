"""What crosses vLLM's processes for the connector: step metadata, worker reports, stats and metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvoffload.errors import ConfigError, WireError
from kvoffload.metrics import ALLOCATION_BUCKETS, SIZE_BUCKETS, STAT_METRICS, TIER_METRICS, TIERING_METRICS

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class KVOffloadConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: the StepPlan as one kvoffload wire frame."""

    def __init__(self, plan: bytes) -> None:
        self.plan = plan


class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: each worker's WorkerReport as a kvoffload wire frame; aggregation concatenates."""

    def __init__(self, reports: Sequence[bytes]) -> None:
        self.reports = list(reports)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVOffloadWorkerMetadata):
            raise ConfigError(f"cannot aggregate KVOffloadWorkerMetadata with {type(other).__name__}")
        return KVOffloadWorkerMetadata(self.reports + other.reports)


# ------------------------------------------------------------------------------------------------------------
# The connector's figures as vLLM 0.33 names them
# ------------------------------------------------------------------------------------------------------------

_Kind = Literal["counter", "gauge", "histogram"]


class _Figure(NamedTuple):
    """One connector figure in vLLM's Prometheus registry."""

    metric: str
    """Its name there (a counter's without the ``_total`` that prometheus_client appends)."""
    kind: _Kind
    documentation: str
    buckets: tuple[float, ...] = ()


LOOKUP_SYNC_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0)
"""Seconds of one lookup call (vLLM 0.33's ``kv_offload_lookup_sync_delay_seconds`` buckets)."""
LOOKUP_ASYNC_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
"""Seconds from a request's first deferred lookup to its answer (``kv_offload_lookup_async_delay_seconds``)."""

# Names of figures in KVOffloadConnectorStats.data that are not SchedulerStats counters (STAT_METRICS).
LOAD_SIZE = "load_size"
STORE_SIZE = "store_size"
LOOKUP_SYNC_DELAY = "lookup_sync_delay_seconds"
LOOKUP_ASYNC_DELAY = "lookup_async_delay_seconds"
CPU_CACHE_USAGE = "cpu_cache_usage_perc"
CPU_CACHE_WRITE_USAGE = "cpu_cache_write_usage_perc"
CPU_CACHE_READ_USAGE = "cpu_cache_read_usage_perc"
CPU_ALLOCATION_SIZE = "cpu_allocation_size"
STORES_SKIPPED = "stores_skipped"

VLLM_FIGURES: dict[str, _Figure] = {
    # KVOffloadConnectorStats.data name -> the figure under vLLM 0.33's name (OffloadingConnector, CPU spec)
    "load_bytes": _Figure(
        "vllm:kv_offload_load_bytes", "counter", "Bytes loaded from the host pool into the KV cache."
    ),
    "load_time": _Figure("vllm:kv_offload_load_time", "counter", "Seconds of load jobs (summed over workers)."),
    "store_bytes": _Figure(
        "vllm:kv_offload_store_bytes", "counter", "Bytes stored from the KV cache to the host pool."
    ),
    "store_time": _Figure("vllm:kv_offload_store_time", "counter", "Seconds of store jobs (summed over workers)."),
    "allocation_failure": _Figure(
        "vllm:kv_offload_allocation_failure", "counter", "Store offers that found no room in the host pool."
    ),
    STORES_SKIPPED: _Figure(
        "vllm:kv_offload_stores_skipped", "counter", "Offered chunks not stored: below the store threshold."
    ),
    LOAD_SIZE: _Figure("vllm:kv_offload_load_size", "histogram", "Bytes per load job and worker.", SIZE_BUCKETS),
    STORE_SIZE: _Figure("vllm:kv_offload_store_size", "histogram", "Bytes per store job and worker.", SIZE_BUCKETS),
    LOOKUP_SYNC_DELAY: _Figure(
        "vllm:kv_offload_lookup_sync_delay_seconds",
        "histogram",
        "Seconds spent in one lookup call (get_num_new_matched_tokens).",
        LOOKUP_SYNC_BUCKETS,
    ),
    LOOKUP_ASYNC_DELAY: _Figure(
        "vllm:kv_offload_lookup_async_delay_seconds",
        "histogram",
        "Seconds from a request's first deferred lookup to the lookup that answered (or the request's end).",
        LOOKUP_ASYNC_BUCKETS,
    ),
    CPU_CACHE_USAGE: _Figure(
        "vllm:kv_offload_cpu_cache_usage_perc", "gauge", "Share of host chunks that cannot be evicted (0 to 1)."
    ),
    CPU_CACHE_WRITE_USAGE: _Figure(
        "vllm:kv_offload_cpu_cache_write_usage_perc", "gauge", "Share of host chunks whose store is in flight."
    ),
    CPU_CACHE_READ_USAGE: _Figure(
        "vllm:kv_offload_cpu_cache_read_usage_perc", "gauge", "Share of host chunks pinned by loads."
    ),
    CPU_ALLOCATION_SIZE: _Figure(
        "vllm:kv_offload_cpu_allocation_size", "histogram", "Chunks allocated per store offer.", ALLOCATION_BUCKETS
    ),
}
"""The connector's figures that vLLM 0.33 has, under vLLM's names; every other figure is ``kvoffload_<name>``."""

_EAGER = ("load_bytes", "load_time", "store_bytes", "store_time", "allocation_failure")
"""Registered with the metrics, as vLLM registers its connector's counters; the other figures at their first value."""
_GAUGES = frozenset(name for name, figure in VLLM_FIGURES.items() if figure.kind == "gauge")
_HISTOGRAMS = frozenset(name for name, figure in VLLM_FIGURES.items() if figure.kind == "histogram")


def _check_value(name: str, value: object) -> None:
    """A figure's value as it crosses vLLM's processes: samples (a list of numbers) or one number."""
    if isinstance(value, list):
        if name not in _HISTOGRAMS:
            raise WireError(f"kvoffload connector stats: {name!r} carries samples but is not a histogram")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            raise WireError(f"kvoffload connector stats: {name!r} samples must be numbers")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError(f"kvoffload connector stats: {name!r} must be a number, got {type(value).__name__}")
    elif name in _HISTOGRAMS:
        raise WireError(f"kvoffload connector stats: histogram {name!r} carries a number, not samples")


@dataclass
class KVOffloadConnectorStats(KVConnectorStats):
    """kvoffload's figures over one interval, in vLLM's connector stats (its "KV Transfer metrics" log line and
    its Prometheus registry, through :class:`KVOffloadPromMetrics`).

    ``data`` maps a figure's name to plain values (it crosses vLLM's processes): a counter's increase since the
    last report (:class:`~kvoffload.SchedulerStats` fields named as :data:`~kvoffload.metrics.STAT_METRICS`
    names them, ``lookup_misses_<reason>``, ``stores_skipped``), a gauge's current value (the host pool's
    ``cpu_cache_usage_perc``, ``cpu_cache_write_usage_perc``, ``cpu_cache_read_usage_perc``), or a histogram's
    samples as a list (``load_size`` / ``store_size``: bytes per transfer job and worker;
    ``lookup_sync_delay_seconds``, ``lookup_async_delay_seconds``; ``cpu_allocation_size``). Aggregation adds
    counters, keeps the newer gauge and concatenates samples. A secondary tier's counters are named
    ``<metric>@<tier>`` (``tier`` as vLLM's tiering labels it, ``1:fs``; see :data:`~kvoffload.metrics.TIER_METRICS`).
    """

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, KVOffloadConnectorStats):
            raise ConfigError(f"cannot aggregate KVOffloadConnectorStats with {type(other).__name__}")
        merged: dict[str, Any] = {}
        for name, value in self.data.items():
            _check_value(name, value)
            merged[name] = list(value) if isinstance(value, list) else value
        for name, value in other.data.items():
            _check_value(name, value)
            if name not in merged:
                merged[name] = list(value) if isinstance(value, list) else value
            elif isinstance(value, list):
                merged[name].extend(value)
            elif name in _GAUGES:
                merged[name] = value
            else:
                merged[name] += value
        return KVOffloadConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, value in sorted(self.data.items()):
            metric, _, tier = name.partition("@")
            key = f"kvoffload_{metric}{{tier={tier}}}" if tier else f"kvoffload_{name}"
            if isinstance(value, list):
                out[f"{key}_count"] = len(value)
                out[f"{key}_sum"] = sum(value)
            else:
                out[key] = value
        return out

    def is_empty(self) -> bool:
        return not self.data


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    """kvoffload's figures in vLLM's own Prometheus registry, with vLLM's per-engine labels.

    Figures vLLM 0.33's offloading connector has take vLLM's names (:data:`VLLM_FIGURES`), so vLLM's dashboards
    and ``LLM.get_metrics()`` see them: counters ``vllm:kv_offload_load_bytes_total``, ``..._load_time_total``,
    ``..._store_bytes_total``, ``..._store_time_total``, ``vllm:kv_offload_allocation_failure_total`` and
    ``vllm:kv_offload_stores_skipped_total``; histograms ``vllm:kv_offload_load_size`` / ``..._store_size`` (bytes
    per transfer job and worker), ``vllm:kv_offload_lookup_sync_delay_seconds`` (one lookup call),
    ``vllm:kv_offload_lookup_async_delay_seconds`` (a request's first deferred lookup to its answer) and
    ``vllm:kv_offload_cpu_allocation_size``; gauges ``vllm:kv_offload_cpu_cache_usage_perc``,
    ``..._cpu_cache_write_usage_perc`` and ``..._cpu_cache_read_usage_perc``. The five transfer and allocation
    counters are registered up front; the other vLLM-named figures at their first value.

    kvoffload's own counters are ``kvoffload_<name>_total`` (``kvoffload_lookups_total``,
    ``kvoffload_load_tokens_total``, ...); miss reasons go into ``kvoffload_lookup_misses_by_reason_total{reason=...}``.
    Secondary tiers' counters take vLLM 0.33's tiering names where vLLM has the figure
    (``vllm:kv_offload_tiering_read_bytes_total{tier="1:fs"}``), ``kvoffload_<name>_total{tier=...}`` otherwise
    (:data:`~kvoffload.metrics.TIER_METRICS`).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[str, dict[int, Any]] = {}
        for metric in STAT_METRICS.values():
            figure = VLLM_FIGURES.get(metric)
            if figure is not None:
                if metric in _EAGER:
                    counter = self._family(figure)
                    self._children[metric] = {e: counter.labels(*v) for e, v in per_engine_labelvalues.items()}
                continue
            counter = self._counter_cls(
                name=f"kvoffload_{metric}", documentation=f"kvoffload {metric.replace('_', ' ')}", labelnames=labelnames
            )
            self._children[metric] = {e: counter.labels(*v) for e, v in per_engine_labelvalues.items()}
        self._by_reason = self._counter_cls(
            name="kvoffload_lookup_misses_by_reason",
            documentation="kvoffload lookups that loaded nothing, by the reason of their first miss",
            labelnames=[*labelnames, "reason"],
        )
        self._tier_counters: dict[str, Any] = {}  # data name (without "@tier") -> counter labelled by tier
        for metric, vllm_name, doc in TIER_METRICS.values():
            name = vllm_name or f"kvoffload_{metric}"
            self._tier_counters[metric] = self._counter_cls(
                name=name, documentation=doc, labelnames=[*labelnames, "tier"]
            )
        for metric, vllm_name, doc in TIERING_METRICS.values():
            counter = self._counter_cls(
                name=vllm_name or f"kvoffload_{metric}", documentation=doc, labelnames=labelnames
            )
            self._children[metric] = {e: counter.labels(*v) for e, v in per_engine_labelvalues.items()}
        self._late: dict[str, Any] = {}  # data name -> the family of a figure registered at its first value

    def _family(self, figure: _Figure) -> Any:
        """A new metric family for ``figure``, with vLLM's engine labels."""
        if figure.kind == "counter":
            return self._counter_cls(
                name=figure.metric, documentation=figure.documentation, labelnames=self._labelnames
            )
        if figure.kind == "gauge":
            return self._gauge_cls(name=figure.metric, documentation=figure.documentation, labelnames=self._labelnames)
        return self._histogram_cls(
            name=figure.metric,
            documentation=figure.documentation,
            labelnames=self._labelnames,
            buckets=figure.buckets,
        )

    def _child(self, name: str, engine_idx: int) -> Any:
        """The engine's series of a figure of :data:`VLLM_FIGURES` that is registered at its first value."""
        children = self._children.get(name)
        if children is None:
            children = self._children[name] = {}
        child = children.get(engine_idx)
        if child is None:
            family = self._late.get(name)
            if family is None:
                family = self._late[name] = self._family(VLLM_FIGURES[name])
            child = children[engine_idx] = family.labels(*self.per_engine_labelvalues[engine_idx])
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            _check_value(name, value)
            figure = VLLM_FIGURES.get(name)
            if figure is not None and figure.kind == "histogram":
                if value:
                    child = self._child(name, engine_idx)
                    for sample in value:
                        child.observe(sample)
                continue
            if figure is not None and figure.kind == "gauge":
                self._child(name, engine_idx).set(value)
                continue
            if value <= 0:
                continue
            metric, _, tier = name.partition("@")
            if tier and metric in self._tier_counters:
                self._tier_counters[metric].labels(*values, tier).inc(value)
            elif name.startswith("lookup_misses_"):
                self._by_reason.labels(*values, name.removeprefix("lookup_misses_")).inc(value)
            elif name in self._children or figure is not None:
                self._child(name, engine_idx).inc(value)
