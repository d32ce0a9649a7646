"""What each secondary tier's figures are called as metrics, in kvoffload's registry and in vLLM's.

The scheduler's :class:`~kvoffload.tiers.TierStatsRow` of each tier counts its cascades, drops, promotions,
failures, bad records, bytes and seconds. :data:`TIER_METRICS` names each counter: ``kvoffload_<name>`` with a
``tier`` label in :class:`~kvoffload.metrics.SchedulerMetrics` (label ``fs0``, ``valkey1``), and, where vLLM 0.33's
tiering has the figure, vLLM's own name (``vllm:kv_offload_tiering_read_bytes``) in vLLM's registry, labelled as vLLM
labels its tiers (``1:fs``). :data:`TIERING_METRICS` names the figures of the tiering as a whole (no label).
"""

from __future__ import annotations

__all__ = ["TIERING_METRICS", "TIER_METRICS"]

TIER_METRICS: dict[str, tuple[str, str | None, str]] = {
    # TierStatsRow field -> (kvoffload metric name, vLLM 0.33's name or None, documentation)
    "cascaded_chunks": ("tier_cascaded_chunks", None, "Chunks cascaded to the tier (in every rank's namespace)."),
    "cascade_failures": ("tier_cascade_failures", None, "Chunks whose cascade to the tier failed."),
    "dropped_chunks": ("tier_dropped_chunks", None, "Chunks whose cascade backpressure dropped."),
    "promoted_chunks": ("tier_promoted_chunks", None, "Chunks promoted from the tier into the host pool."),
    "promotion_failures": ("tier_promotion_failures", None, "Chunks whose promotion from the tier failed."),
    "corrupt_records": ("tier_corrupt_records", None, "Records found bad (missed and deleted), per rank."),
    "cascade_job_failures": (
        "tiering_cascade_job_failures",
        "vllm:kv_offload_tiering_cascade_job_failures",
        "Cascade jobs with a failed chunk.",
    ),
    "promotion_job_failures": (
        "tiering_promotion_job_failures",
        "vllm:kv_offload_tiering_promotion_job_failures",
        "Promotion jobs with a failed chunk.",
    ),
    "bytes_written": ("tiering_write_bytes", "vllm:kv_offload_tiering_write_bytes", "Bytes written to the tier."),
    "write_seconds": ("tiering_write_time", "vllm:kv_offload_tiering_write_time", "Seconds of cascade jobs."),
    "bytes_read": ("tiering_read_bytes", "vllm:kv_offload_tiering_read_bytes", "Bytes read from the tier."),
    "read_seconds": ("tiering_read_time", "vllm:kv_offload_tiering_read_time", "Seconds of promotion jobs."),
    "chunk_queries": (
        "tiering_chunk_queries",
        "vllm:kv_offload_tiering_chunk_queries",
        "Chunks lookups asked the tier about.",
    ),
    "chunk_hits": ("tiering_chunk_hits", "vllm:kv_offload_tiering_chunk_hits", "Chunks the tier had when asked."),
}
"""Each counter of a tier's :class:`~kvoffload.tiers.TierStatsRow` as a metric (labelled ``tier``)."""

TIERING_METRICS: dict[str, tuple[str, str | None, str]] = {
    # Tiering.counters() key -> (kvoffload metric name, vLLM 0.33's name or None, documentation)
    "promotions_refused": (
        "tiering_promotion_allocation_failures",
        "vllm:kv_offload_tiering_promotion_allocation_failures",
        "Promotions refused because the host pool had no room (the request recomputes).",
    ),
    "tier_lookups_late": (
        "tiering_lookups_late",
        None,
        "Tier lookups unanswered after tier_lookup_timeout_s: their requests recomputed what they asked for, the "
        "tier stayed up (a busy host, not an outage).",
    ),
}
"""The tiering's own counters (:meth:`~kvoffload.tiers.Tiering.counters`) as metrics (no label)."""
