"""The connector's scheduler half: drives an OffloadScheduler from vLLM's scheduler-side hooks."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVCacheEvent

from kvoffload import wire
from kvoffload._generated import (
    BlockRemoved,
    LoadMode,
    OffloadingConfig,
    TieringConfig,
    VLLMConnectorConfig,
    WorkerReport,
)
from kvoffload.assembly import build_scheduler
from kvoffload.metrics import STAT_METRICS, TIER_METRICS, TIERING_METRICS
from kvoffload.offload.pool import HostPoolPlan, plan_host_pool_from_config
from kvoffload.offload.scheduler import SchedulerStats, parse_load_tiers

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvoffload.tiers import Tiering, TierStatsRow

from kvoffload.integrations.vllm._messages import (
    KVOffloadConnectorMetadata,
    KVOffloadConnectorStats,
    KVOffloadWorkerMetadata,
)

logger = logging.getLogger("vllm.kvoffload")  # a child of vLLM's logger: printed in its format

_NULL_BLOCK_ID = 0
"""vLLM's placeholder block (a block a sliding window dropped): never stored, never loaded into."""


@dataclass
class _Tracked:
    """A vLLM request as the scheduler half follows it (``sid`` changes when vLLM preempts the request)."""

    request: Request
    sid: str
    known_blocks: list[int]
    known_hashes: int


class _SchedulerHalf:
    """Drives one OffloadScheduler from vLLM's scheduler-side hooks."""

    def __init__(
        self,
        config: OffloadingConfig,
        options: VLLMConnectorConfig,
        tiering: TieringConfig | None = None,
        *,
        engine_on_cpu: bool = False,
    ) -> None:
        pool = plan_host_pool_from_config(config)
        self.scheduler = build_scheduler(
            config,
            options,
            tiering=tiering,
            enable_events=config.enable_kv_cache_events,
            null_block_id=_NULL_BLOCK_ID,
            log=logger,
        )
        self.async_loads = options.load_mode is LoadMode.ASYNC
        self._group_ids = [g.group_id for g in config.groups]
        self._live: dict[str, Request] = {}  # every unfinished request vLLM told us about
        self._tracked: dict[str, _Tracked] = {}  # those registered with the scheduler (not while preempted)
        self._generation = itertools.count()
        self._reported: dict[str, float] = {}
        self.preemptions = 0
        self._closed = False
        tiers_in = self._tiering()
        tiers = tiers_in.describe() if tiers_in is not None else []
        logger.info("%s", start_line(pool, config, options, engine_on_cpu=engine_on_cpu, tiers=tiers))

    def _tiering(self) -> Tiering | None:
        """The scheduler's tiers, when it has any."""
        ext = self.scheduler.extension
        if ext is None:
            return None
        from kvoffload.tiers import Tiering

        return ext if isinstance(ext, Tiering) else None

    def track(self, request: Request) -> _Tracked:
        """The tracked state of ``request``, registering it with the scheduler the first time it is seen."""
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            return tracked
        self._live[request.request_id] = request
        params = request.kv_transfer_params or {}
        sid = f"{request.request_id}#{next(self._generation)}"
        hashes = list(request.block_hashes)
        self.scheduler.add_request(
            sid,
            hashes,
            request.num_tokens,
            prompt_len=min(request.num_prompt_tokens, request.num_tokens),
            max_load_tokens=_limit(params, "max_load_tokens"),
            max_offload_tokens=_limit(params, "max_offload_tokens"),
            load_tiers=parse_load_tiers(params["kv_load_tiers"], log=logger) if "kv_load_tiers" in params else None,
        )
        tracked = _Tracked(request, sid, [0] * len(self._group_ids), len(hashes))
        self._tracked[request.request_id] = tracked
        return tracked

    def _sync_tokens(self, tracked: _Tracked) -> None:
        request = tracked.request
        hashes = request.block_hashes
        self.scheduler.extend_request(tracked.sid, hashes[tracked.known_hashes :], request.num_tokens)
        tracked.known_hashes = len(hashes)

    def _new_blocks(self, tracked: _Tracked, all_blocks: Sequence[Sequence[int]]) -> list[list[int]]:
        """Blocks of each offloaded group beyond those already recorded (``all_blocks`` is the full list)."""
        fresh: list[list[int]] = []
        for i, group_id in enumerate(self._group_ids):
            ids = all_blocks[group_id]
            fresh.append(list(ids[tracked.known_blocks[i] :]))
            tracked.known_blocks[i] = max(tracked.known_blocks[i], len(ids))
        return fresh

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self.track(request)
        self._sync_tokens(tracked)
        hit = self.scheduler.lookup(tracked.sid, num_computed_tokens)
        if hit is None:
            return None, False
        # A hit within the step's sync_load_budget_bytes loads inside the step, as with load_mode='sync'.
        return hit, bool(hit) and self.async_loads and not self.scheduler.is_sync_load(tracked.sid)

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self.track(request)
        fresh = self._new_blocks(tracked, blocks.get_block_ids())
        self.scheduler.on_blocks_allocated(tracked.sid, fresh, num_external_tokens=num_external_tokens)

    def build_plan(self, output: SchedulerOutput) -> KVOffloadConnectorMetadata:
        for req_id in output.preempted_req_ids or ():
            self._forget(req_id, preempted=True)
        scheduled = output.num_scheduled_tokens
        for new in output.scheduled_new_reqs:
            tracked = self._tracked_or_resumed(new.req_id)
            if tracked is None:
                continue
            self._advance(tracked, new.block_ids, full=True, computed=new.num_computed_tokens + scheduled[new.req_id])
        cached = output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id) if req_id not in resumed else self._tracked_or_resumed(req_id)
            if tracked is None:
                continue
            computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._advance(tracked, cached.new_block_ids[i], full=req_id in resumed, computed=computed)
        plan = self.scheduler.build_step_plan()
        return KVOffloadConnectorMetadata(bytes(wire.encode(plan)[0]))

    def _tracked_or_resumed(self, req_id: str) -> _Tracked | None:
        """The tracked state, re-registering a request vLLM resumed without asking for a lookup first."""
        tracked = self._tracked.get(req_id)
        if tracked is None and req_id in self._live:
            tracked = self.track(self._live[req_id])
        return tracked

    def _advance(
        self, tracked: _Tracked, block_ids: Sequence[Sequence[int]] | None, *, full: bool, computed: int
    ) -> None:
        self._sync_tokens(tracked)
        if block_ids is not None:
            if full:
                fresh = self._new_blocks(tracked, block_ids)
            else:
                fresh = [list(block_ids[g]) for g in self._group_ids]
                for i, ids in enumerate(fresh):
                    tracked.known_blocks[i] += len(ids)
            if any(fresh):
                self.scheduler.on_blocks_allocated(tracked.sid, fresh)
        self.scheduler.on_tokens_computed(tracked.sid, min(computed, tracked.request.num_tokens))

    def _forget(self, req_id: str, *, preempted: bool) -> None:
        tracked = self._tracked.pop(req_id, None)
        if tracked is None:
            return
        if preempted:
            self.preemptions += 1
            # Its blocks are gone: in-flight stores are flushed; it is tracked afresh when rescheduled.
            self.scheduler.abort_request(tracked.sid)
        else:
            self.scheduler.finish_request(tracked.sid)

    def finished(self, request: Request) -> None:
        self._live.pop(request.request_id, None)
        self._forget(request.request_id, preempted=False)

    def on_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVOffloadWorkerMetadata) and meta.reports:
            reports = [wire.decode([frame]).expect(WorkerReport) for frame in meta.reports]
            self.scheduler.on_worker_reports(reports)

    def close(self) -> None:
        """Log the run's summary once, then release the tiers."""
        if self._closed:
            return
        self._closed = True
        tiering = self._tiering()
        logger.info("%s", shutdown_line(self.scheduler.stats(), tiering.stats if tiering is not None else ()))
        self.scheduler.close()

    def interval_stats(self) -> KVOffloadConnectorStats:
        """Counter increases since the previous call (what vLLM aggregates, logs and exports)."""
        stats = self.scheduler.stats()
        now: dict[str, float] = {metric: getattr(stats, field) for field, metric in STAT_METRICS.items()}
        for reason, count in stats.lookup_miss_reasons.items():
            now[f"lookup_misses_{reason.value}"] = count
        tiering = self._tiering()
        if tiering is not None:  # per tier, as vLLM's tiering labels its tiers: "<metric>@1:fs"
            for row in tiering.stats:
                now.update((f"{TIER_METRICS[f][0]}@{row.vllm_label}", getattr(row, f)) for f in TIER_METRICS)
            counters = tiering.counters()
            now.update((metric, counters.get(key, 0)) for key, (metric, _, _) in TIERING_METRICS.items())
        delta: dict[str, Any] = {}
        for name, value in now.items():
            previous = self._reported.get(name, 0)
            if value != previous:
                delta[name] = value - previous
                self._reported[name] = value
        return KVOffloadConnectorStats(data=delta)

    def events(self) -> list[KVCacheEvent]:
        converted: list[KVCacheEvent] = []
        for event in self.scheduler.take_events():
            medium = event.medium.value
            if isinstance(event, BlockRemoved):
                converted.append(
                    VllmBlockRemoved(block_hashes=list(event.block_hashes), medium=medium, group_idx=event.group_idx)
                )
            else:
                converted.append(
                    VllmBlockStored(
                        block_hashes=list(event.block_hashes),
                        parent_block_hash=event.parent_block_hash,
                        token_ids=[],
                        block_size=event.block_size,
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                        group_idx=event.group_idx,
                    )
                )
        return converted


def start_line(
    pool: HostPoolPlan,
    config: OffloadingConfig,
    options: VLLMConnectorConfig,
    *,
    engine_on_cpu: bool,
    tiers: Sequence[str] = (),
) -> str:
    """The connector's start line: the host pool, its chunking in engine blocks, the policy, and every tier."""
    blocks = "engine" if engine_on_cpu else "GPU"
    line = (
        f"kvoffload: host pool of {pool.num_chunks} chunks x {pool.row_bytes} bytes "
        f"({config.cache.blocks_per_chunk} {blocks} blocks per chunk, {options.eviction_policy}, "
        f"{options.load_mode.value} loads)"
    )
    if tiers:
        line += f"; {len(tiers)} secondary tier{'s' if len(tiers) > 1 else ''}: " + "; ".join(tiers)
    return line


def shutdown_line(stats: SchedulerStats, tiers: Sequence[TierStatsRow] = ()) -> str:
    """The connector's summary at shutdown: chunks stored and loaded, tier cascades and promotions, misses."""
    line = (
        f"kvoffload: shutting down: stored {stats.chunks_stored} chunks ({stats.tokens_stored} tokens), loaded "
        f"{stats.chunks_loaded} chunks ({stats.tokens_loaded} tokens); {stats.lookups} lookups, "
        f"{stats.lookup_hits} hits, {stats.lookups_deferred} re-asks; failed loads {stats.failed_loads}, "
        f"failed stores {stats.failed_stores}, corrupt loads {stats.corrupt_loads}"
    )
    for row in tiers:
        line += (
            f"; secondary_tiers[{row.index}] ({row.name}): cascaded {row.cascaded_chunks} chunks "
            f"({row.cascade_failures} failed, {row.dropped_chunks} dropped), promoted {row.promoted_chunks} "
            f"({row.promotion_failures} failed), {row.outages} outage{'' if row.outages == 1 else 's'}"
        )
    reasons = sorted(stats.lookup_miss_reasons.items(), key=lambda item: (-item[1], item[0].value))
    misses = ", ".join(f"{reason.value} {count}" for reason, count in reasons) or "none"
    return f"{line}; lookup misses by reason: {misses}"


def _limit(params: Mapping[str, object], key: str) -> int | None:
    """A per-request cap from ``kv_transfer_params``: a non-negative int, else ignored with a warning (vLLM)."""
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        logger.warning("kvoffload: ignoring kv_transfer_params[%r]=%r (not a non-negative int)", key, value)
        return None
    return value
