"""What crosses vLLM's processes for the connector: step metadata, worker reports, stats and metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvoffload.errors import ConfigError
from kvoffload.metrics import STAT_METRICS, TIER_METRICS, TIERING_METRICS

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


@dataclass
class KVOffloadConnectorStats(KVConnectorStats):
    """kvoffload's counters over one interval, in vLLM's connector stats (its "KV Transfer metrics" log line).

    ``data`` maps counter names (:class:`~kvoffload.SchedulerStats` fields) to the increase since the last
    report; aggregation adds them. A secondary tier's counters are named ``<metric>@<tier>`` (``tier`` as vLLM's
    tiering labels it, ``1:fs``; see :data:`~kvoffload.metrics.TIER_METRICS`).
    """

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            merged[name] = merged.get(name, 0) + value
        return KVOffloadConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, value in sorted(self.data.items()):
            metric, _, tier = name.partition("@")
            out[f"kvoffload_{metric}{{tier={tier}}}" if tier else f"kvoffload_{name}"] = value
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    """kvoffload's counters in vLLM's own Prometheus registry: ``kvoffload_<name>_total``, per engine label.

    Miss reasons go into ``kvoffload_lookup_misses_by_reason_total{reason=...}``. Secondary tiers' counters take
    vLLM 0.33's tiering names where vLLM has the figure (``vllm:kv_offload_tiering_read_bytes_total{tier="1:fs"}``),
    ``kvoffload_<name>_total{tier=...}`` otherwise (:data:`~kvoffload.metrics.TIER_METRICS`).
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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if value <= 0:
                continue
            metric, _, tier = name.partition("@")
            if tier and metric in self._tier_counters:
                self._tier_counters[metric].labels(*values, tier).inc(value)
            elif name.startswith("lookup_misses_"):
                self._by_reason.labels(*values, name.removeprefix("lookup_misses_")).inc(value)
            elif name in self._children:
                self._children[name][engine_idx].inc(value)
