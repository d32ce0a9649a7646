"""Prometheus metrics for the scheduler and the workers, plus an engine-neutral snapshot of the same figures.

Two recorders, one per side of the wire, each registering its metrics on a ``CollectorRegistry`` the embedding
application owns (nothing is registered at import, nothing touches prometheus_client's global registry):

* :class:`SchedulerMetrics` (scheduler process): lookups, hits, misses per :class:`MissReason`, tokens moved,
  failed and corrupted loads, evictions, allocation failures, backpressure drops, pool usage gauges. It pulls
  the scheduler's cumulative stats once per step (:meth:`SchedulerMetrics.observe`), so the scheduler's hot
  paths carry no metric calls at all. With secondary tiers, each tier's outages, availability, cascades, drops,
  promotions, failures, bad records, bytes and seconds (:data:`TIER_METRICS`, label ``tier``).
* :class:`WorkerMetrics` (each worker process): bytes and seconds of every finished transfer, recorded from the
  worker's :class:`WorkerReport`. Spawned workers write through prometheus_client's multiprocess mode: the
  parent spawns them inside :func:`multiprocess_env`, reads their files with :func:`add_worker_collector`, and
  calls :func:`mark_worker_dead` when one exits.

Names follow vLLM 0.33's offloading metrics (``vllm:kv_offload_load_bytes`` -> ``kvoffload_load_bytes``) where vLLM
has one; ``tier`` labels the offload tier (``host`` for the host pool) and ``direction`` is ``load`` (towards the
engine) or ``store``. Label children are bound once at construction: a record costs one attribute add and one
child call. Inside vLLM the connector exports the same figures in vLLM's registry under vLLM's own names
(``vllm:kv_offload_load_bytes``; see ``kvoffload.integrations.vllm.KVOffloadPromMetrics``).

Every recorder also keeps the figures since its previous :meth:`take_snapshot` call, returned as a plain
:class:`MetricsSnapshot` (counters as deltas, gauges as current values, histograms as count, sum and samples) that
an engine integration can forward to its own stats system and :meth:`MetricsSnapshot.aggregate` across workers.
"""

from __future__ import annotations

from kvoffload.metrics._multiprocess import MULTIPROC_ENV, add_worker_collector, mark_worker_dead, multiprocess_env
from kvoffload.metrics._samples import HistogramSample, MetricSample, MetricsSnapshot
from kvoffload.metrics._scheduler import ALLOCATION_BUCKETS, STAT_METRICS, SchedulerMetrics
from kvoffload.metrics._server import MetricsServer, serve_metrics
from kvoffload.metrics._tiers import TIER_METRICS, TIERING_METRICS
from kvoffload.metrics._worker import SIZE_BUCKETS, TIME_BUCKETS, WorkerMetrics

__all__ = [
    "ALLOCATION_BUCKETS",
    "MULTIPROC_ENV",
    "SIZE_BUCKETS",
    "STAT_METRICS",
    "TIERING_METRICS",
    "TIER_METRICS",
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
