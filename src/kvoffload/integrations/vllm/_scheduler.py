"""The connector's scheduler half: drives an OffloadScheduler from vLLM's scheduler-side hooks."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_events import KVCacheEvent

from kvoffload import wire
from kvoffload._generated import (
    KVCacheConfig,
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
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmKVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvoffload.offload.scheduler import TierStatsRow

from kvoffload.integrations.vllm._kv_events import SelfDescribingEvents, to_vllm_events
from kvoffload.integrations.vllm._messages import (
    CPU_ALLOCATION_SIZE,
    CPU_CACHE_READ_USAGE,
    CPU_CACHE_USAGE,
    CPU_CACHE_WRITE_USAGE,
    LOAD_SIZE,
    LOOKUP_ASYNC_DELAY,
    LOOKUP_SYNC_DELAY,
    STORE_SIZE,
    STORES_SKIPPED,
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
    loads_async: bool = False
    """Its lookup hit loads between steps (vLLM holds it in WAITING_FOR_REMOTE_KVS until the load finishes)."""


class _SchedulerHalf:
    """Drives one OffloadScheduler from vLLM's scheduler-side hooks."""

    def __init__(
        self,
        config: OffloadingConfig,
        options: VLLMConnectorConfig,
        tiering: TieringConfig | None = None,
        *,
        engine_on_cpu: bool = False,
        kv_cache_config: KVCacheConfig | None = None,
        eagle_group_ids: Collection[int] | None = None,
    ) -> None:
        pool = plan_host_pool_from_config(config)
        self.scheduler = build_scheduler(
            config,
            options,
            tiering=tiering,
            enable_events=config.enable_kv_cache_events,
            null_block_id=_NULL_BLOCK_ID,
            log=logger,
            # A CPU worker waits for its step's promotions, so a tier hit loads in the step it is promoted; not
            # with one pool shared across ranks (its writer promotes the rows the other ranks load).
            chain_promotions=engine_on_cpu and not (config.replicated_layout and config.parallel.world_size > 1),
            # the groups' engine facts (EAGLE, Mamba align, retention interval) the plan does not carry
            kv_cache_config=kv_cache_config,
            eagle_group_ids=eagle_group_ids,
        )
        self.async_loads = options.load_mode is LoadMode.ASYNC
        self._group_ids = [g.group_id for g in config.groups]
        self._live: dict[str, Request] = {}  # every unfinished request vLLM told us about
        self._tracked: dict[str, _Tracked] = {}  # those registered with the scheduler (not while preempted)
        self._generation = itertools.count()
        self._reported: dict[str, float] = {}
        # Samples since the last interval_stats (vLLM asks every step): lookup delays, bytes per transfer job.
        self._samples: dict[str, list[float]] = {
            LOOKUP_SYNC_DELAY: [],
            LOOKUP_ASYNC_DELAY: [],
            LOAD_SIZE: [],
            STORE_SIZE: [],
        }
        self._deferred_since: dict[str, float] = {}  # vLLM request id -> monotonic time of its first deferred lookup
        self.preemptions = 0
        self.load_restarts = 0
        """Requests tracked afresh after an asynchronous load of theirs failed (see ``_restart_after_failed_load``)."""
        self._closed = False
        # self_describing_kv_events: full payloads in the KV events (kv_cache_config names the groups' kinds)
        self._payloads = (
            SelfDescribingEvents(config, kv_cache_config)
            if config.enable_kv_cache_events and options.self_describing_kv_events
            else None
        )
        tiers = self.scheduler.extension.describe()
        logger.info("%s", start_line(pool, config, options, engine_on_cpu=engine_on_cpu, tiers=tiers))

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
        """vLLM's ``get_num_new_matched_tokens``, timed as vLLM 0.33 times it: every lookup call's duration
        (``lookup_sync_delay_seconds``), and for a request whose lookup was deferred (None: a store, load, tier
        query or promotion in flight) the time from its first deferred call to the call that answers
        (``lookup_async_delay_seconds``)."""
        tracked = self.track(request)
        self._sync_tokens(tracked)
        started = time.monotonic()
        hit = self.scheduler.lookup(tracked.sid, num_computed_tokens)
        self._samples[LOOKUP_SYNC_DELAY].append(time.monotonic() - started)
        if hit is None:
            self._deferred_since.setdefault(request.request_id, started)
            return None, False
        self._end_deferral(request.request_id)
        # A hit within the step's sync_load_budget_bytes loads inside the step, as with load_mode='sync'.
        tracked.loads_async = bool(hit) and self.async_loads and not self.scheduler.is_sync_load(tracked.sid)
        return hit, tracked.loads_async

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
        if self._payloads is not None and plan.store_jobs:
            requests = {t.sid: t.request for t in self._tracked.values()}
            self._payloads.on_plan(plan, requests, self.scheduler.manager)
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

    def _end_deferral(self, req_id: str) -> None:
        """The request's deferred lookups are over (answered, or the request ended): their delay is a sample."""
        since = self._deferred_since.pop(req_id, None)
        if since is not None:
            self._samples[LOOKUP_ASYNC_DELAY].append(time.monotonic() - since)

    def finished(self, request: Request) -> None:
        self._end_deferral(request.request_id)
        self._live.pop(request.request_id, None)
        self._forget(request.request_id, preempted=False)

    def on_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVOffloadWorkerMetadata) and meta.reports:
            reports = [wire.decode([frame]).expect(WorkerReport) for frame in meta.reports]
            for report in reports:  # one size sample per transfer job and worker, as vLLM's workers record them
                for result in report.results:
                    if result.num_bytes:
                        self._samples[STORE_SIZE if result.is_store else LOAD_SIZE].append(result.num_bytes)
            outcome = self.scheduler.on_worker_reports(reports)
            if self._payloads is not None:
                self._payloads.on_reports(reports)
            for sid in outcome.recompute:
                self._restart_after_failed_load(sid)

    def _restart_after_failed_load(self, sid: str) -> None:
        """An asynchronous load of ``sid`` failed: vLLM recomputes from its first invalid block, freeing every block
        of the request when none before it is valid (it then looks the request up and allocates anew). The request
        is tracked afresh the next time vLLM shows it, so no later load or store uses the block ids it held.
        (A failed in-step load keeps the request's blocks: vLLM only rolls its computed tokens back.)"""
        req_id = sid.rpartition("#")[0]
        tracked = self._tracked.get(req_id)
        if tracked is None or tracked.sid != sid or not tracked.loads_async:
            return
        self.load_restarts += 1
        self._tracked.pop(req_id)
        self.scheduler.abort_request(sid)

    def close(self) -> None:
        """Log the run's summary once, then release the tiers."""
        if self._closed:
            return
        self._closed = True
        logger.info("%s", shutdown_line(self.scheduler.stats(), self.scheduler.extension.figures().tiers))
        self.scheduler.close()

    def interval_stats(self) -> KVOffloadConnectorStats:
        """Counter increases, changed gauges and samples since the previous call (what vLLM aggregates, logs and
        exports; see :class:`KVOffloadConnectorStats`)."""
        stats = self.scheduler.stats()
        now: dict[str, float] = {metric: getattr(stats, field) for field, metric in STAT_METRICS.items()}
        for reason, count in stats.lookup_miss_reasons.items():
            now[f"lookup_misses_{reason.value}"] = count
        figures = self.scheduler.extension.figures()
        if figures.tiers:  # per tier, as vLLM's tiering labels its tiers: "<metric>@1:fs"
            for row in figures.tiers:
                now.update((f"{TIER_METRICS[f][0]}@{row.vllm_label}", getattr(row, f)) for f in TIER_METRICS)
            now.update((metric, figures.counters.get(key, 0)) for key, (metric, _, _) in TIERING_METRICS.items())
        delta: dict[str, Any] = {}
        for name, value in now.items():
            previous = self._reported.get(name, 0)
            if value != previous:
                delta[name] = value - previous
                self._reported[name] = value
        pool = self.scheduler.manager.stats()  # its allocation sizes and skipped stores restart at each call
        for name, gauge in (
            (CPU_CACHE_USAGE, pool.usage),
            (CPU_CACHE_WRITE_USAGE, pool.write_usage),
            (CPU_CACHE_READ_USAGE, pool.read_usage),
        ):
            if gauge != self._reported.get(name, 0.0):
                delta[name] = self._reported[name] = gauge
        if pool.stores_skipped:
            delta[STORES_SKIPPED] = pool.stores_skipped
        if pool.allocation_sizes:
            delta[CPU_ALLOCATION_SIZE] = list(pool.allocation_sizes)
        for name, samples in self._samples.items():
            if samples:
                delta[name] = samples
                self._samples[name] = []
        return KVOffloadConnectorStats(data=delta)

    def events(self) -> list[KVCacheEvent]:
        """The scheduler's KV events in vLLM's types: placeholders, or self-describing payloads (see _kv_events)."""
        events = self.scheduler.take_events()
        if self._payloads is not None:
            events = self._payloads.take(events, self.scheduler.manager)
        return to_vllm_events(events)


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
        f"loads missed on a tier {stats.tier_missed_loads}, "
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


def engine_group_facts(
    vllm_config: VllmConfig, vllm_kv_cache_config: VllmKVCacheConfig, config: OffloadingConfig, kv: KVCacheConfig
) -> tuple[KVCacheConfig, tuple[int, ...]]:
    """What the scheduler half needs of vLLM's engine beyond the plan: the snapshot's KV cache config ``kv`` with
    vLLM's ``prefix_cache_retention_interval``, and the offloaded EAGLE/MTP draft groups as vLLM 0.33's
    scheduler takes them (``is_eagle_group`` groups, and only when ``speculative_config.use_eagle_block_drop()``)."""
    retention = getattr(vllm_kv_cache_config, "prefix_cache_retention_interval", None)
    if retention is not None:
        kv = msgspec.structs.replace(kv, prefix_cache_retention_interval=retention)
    spec = vllm_config.speculative_config
    if spec is None or not spec.use_eagle_block_drop():
        return kv, ()
    groups = kv.kv_cache_groups
    return kv, tuple(
        g.group_id for g in config.groups if g.group_id < len(groups) and groups[g.group_id].is_eagle_group
    )
