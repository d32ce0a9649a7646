"""vLLM 0.33's tiering semantics on top of the host pool: cascade every stored chunk, promote tier hits.

Where the work runs, and why: kvoffload's host pool rows live in the worker processes (one ``HostPool`` per
rank, or one shared ``/dev/shm`` region), so the tier IO runs in each worker on its own rows
(:class:`~kvoffload.tiers.TierWorker`), reading and writing its own namespace (rank-specific unless the
offload is replicated). The scheduler decides (:class:`Tiering`, this module, composed into the scheduler);
it ships the decisions as ``TierJob`` lists on the ``StepPlan`` and gets ``TierJobResult`` lists back on each
``WorkerReport``, like copy jobs. A tier chunk counts as present only when every rank's namespace has it.
Lookups are metadata queries (a stat, an EXISTS) that the scheduler runs itself, on a background thread.

Semantics (vLLM 0.33's):

* **Cascade.** Every chunk whose store to the host completes is cascaded to every tier: the host chunk is
  pinned (``prepare_load``) until every rank reported the tier job, so it is never evicted while read.
  A tier under backpressure drops the cascade (counted); the engine never waits on a tier store.
* **Promotion.** A lookup that misses in host memory asks the tiers (RETRY: the lookup returns ``None``
  while the query runs). Keys found in a tier, from the first host miss on as a prefix per group, are
  allocated in the host pool (``prepare_store``: HIT_PENDING until the promotion completes; if the host is
  full the answer is a MISS and the engine recomputes) and promoted in one job per tier and request. Once
  the promotion completes, the next lookup finds a host hit and loads it as usual. A key that failed (a
  corrupt record, a tier that went down) is freed and never marked ready.

Tier work never blocks an engine step: queries run on a thread, IO on the workers' tier threads, results
are polled at each step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import msgspec

from kvoffload._generated import (
    FsTierConfig,
    OffloadingConfig,
    SecondaryTierConfig,
    TieringConfig,
    TierJob,
    TierJobResult,
    ValkeyTierConfig,
    WorkerReport,
)
from kvoffload._packed import Int32Array, pack_int64
from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager import HostBlockManager
from kvoffload.tiers._backpressure import EMABackpressureDetector, resolve_backpressure
from kvoffload.tiers._base import SecondaryTier, TierBase
from kvoffload.tiers._config import open_tier
from kvoffload.tiers._namespace import namespaces_for_all_ranks
from kvoffload.tiers._valkey import EmbeddedValkey

__all__ = ["TierStatsRow", "Tiering", "start_embedded_servers"]

logger = logging.getLogger(__name__)


def start_embedded_servers(
    tiering: TieringConfig, *, socket_dir: str | None = None
) -> tuple[TieringConfig, list[EmbeddedValkey]]:
    """Start a private Valkey server for each ``valkey`` tier without a url.

    Returns the config with the servers' urls filled in (give it to the workers) and the servers
    (``stop()`` them at the end).
    """
    servers: list[EmbeddedValkey] = []
    tiers = []
    for tier in tiering.secondary_tiers:
        if isinstance(tier, ValkeyTierConfig) and not tier.url:
            server = EmbeddedValkey(maxmemory=tier.embedded_maxmemory, socket_dir=socket_dir)
            servers.append(server)
            tier = msgspec.structs.replace(tier, url=server.url)
        tiers.append(tier)
    return msgspec.structs.replace(tiering, secondary_tiers=tuple(tiers)), servers


def _unusable(tier: SecondaryTier) -> str | None:
    """Why ``tier`` cannot be used now (None: it can): a built-in tier probes its medium, any other tier is
    asked whether it is available."""
    if isinstance(tier, TierBase):
        return tier.probe()
    return None if tier.available else "the tier reports itself unavailable"


def _tier_type(config: SecondaryTierConfig) -> str:
    if isinstance(config, FsTierConfig):
        return "fs"
    return "valkey" if isinstance(config, ValkeyTierConfig) else "custom"


@dataclass(slots=True)
class TierStatsRow:
    """What one tier did for this scheduler: cascades, drops, promotions and their bytes and seconds."""

    name: str
    cascaded_chunks: int = 0
    cascade_failures: int = 0
    dropped_chunks: int = 0
    promoted_chunks: int = 0
    promotion_failures: int = 0
    corrupt_records: int = 0
    """Records a worker found bad (damaged, of another namespace, not authenticated): missed and deleted."""
    tokens_promoted: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    bytes_read: int = 0
    read_seconds: float = 0.0

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0


@dataclass(slots=True)
class _TierJobState:
    job: TierJob
    req_id: str | None
    pending: int
    tokens: int
    reported: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    num_bytes: int = 0
    seconds: float = 0.0
    stale: bool = False


@dataclass(slots=True)
class _Query:
    keys: list[OffloadKey]
    future: Future[list[list[bool]]]


class Tiering:
    """Secondary tiers below the host pool, composed into an :class:`~kvoffload.offload.scheduler.OffloadScheduler`.

    Implements :class:`~kvoffload.offload.scheduler.SchedulerExtension` (see the module docstring for the
    semantics): ``OffloadScheduler(config, manager, extension=Tiering(config, manager, tiering))``, with the same
    ``config`` and ``manager``. ``tiering`` lists the tiers; valkey tiers need a url here (see
    :func:`start_embedded_servers`). It opens one lookup instance per tier and rank namespace; ``close()``
    (the scheduler's ``close()`` calls it) releases them.
    """

    def __init__(self, config: OffloadingConfig, manager: HostBlockManager, tiering: TieringConfig) -> None:
        self.config = config
        self.manager = manager
        self.tiering = tiering
        bpc = config.cache.blocks_per_chunk
        self._tokens_per_chunk = tuple(g.tokens_per_block * bpc for g in config.groups)
        namespaces = namespaces_for_all_ranks(config)
        self._ranks_reporting = config.parallel.world_size
        self._query_pool = ThreadPoolExecutor(1, thread_name_prefix="kvo-tier-lookup")
        self._lookup_tiers: list[list[SecondaryTier]] = []
        try:
            for tier_config in tiering.secondary_tiers:
                self._lookup_tiers.append([open_tier(tier_config, ns, lookups_only=True) for ns in namespaces])
            self._check_usable(tiering)
        except BaseException:
            self.close()
            raise
        self._detectors = [
            EMABackpressureDetector(resolve_backpressure(_tier_type(t), tiering.backpressure, t.backpressure))
            for t in tiering.secondary_tiers
        ]
        self.stats = [TierStatsRow(_tier_type(t)) for t in tiering.secondary_tiers]
        """What each tier did, in config order."""
        self._queries: dict[str, _Query] = {}
        self._queried: dict[str, set[OffloadKey]] = {}
        self._promoting: dict[str, set[int]] = {}
        self._tier_jobs: dict[int, _TierJobState] = {}
        self._next_tier_job = 0
        self._queued_tier_jobs: list[TierJob] = []
        self._cascade_queue: list[OffloadKey] = []
        self._fence: set[int] = set()  # stale tier jobs in flight since a reset
        self._counters = {"tier_lookups_retry": 0, "promotions_refused": 0, "tier_hits": 0}
        self._poll_s = tiering.tier_poll_interval_s

    def _check_usable(self, tiering: TieringConfig) -> None:
        """Refuse to start on a tier that cannot be used now (a mistyped path, a server that is not there), in
        one line naming it, unless ``start_degraded`` asks to start anyway (a WARNING; it is retried later)."""
        for i, (config, per_rank) in enumerate(zip(tiering.secondary_tiers, self._lookup_tiers, strict=True)):
            reason = _unusable(per_rank[0]) if per_rank else None
            if reason is None:
                continue
            what = f"secondary_tiers[{i}] ({_tier_type(config)}) is unusable: {reason}"
            if not tiering.start_degraded:
                raise ConfigError(f"{what} (set start_degraded to start without it)")
            logger.warning("%s; starting degraded (start_degraded), it is retried later", what)

    # ------------------------------------------------------------------------------------ lookups

    def defer_lookup(self, req_id: str, keys: Sequence[Sequence[OffloadKey]], num_computed_tokens: int) -> bool:
        """Ask the tiers for chunks the host pool misses: True (ask again later) while a tier query runs
        (RETRY) or a promotion is in flight (HIT_PENDING)."""
        if not self._lookup_tiers or self._fence:
            return False  # no tiers, or a reset not yet flushed: the host pool answers alone
        if self._promoting.get(req_id):
            return True
        query = self._queries.get(req_id)
        if query is None:
            asked = self._queried.setdefault(req_id, set())
            candidates = [k for k in self._host_misses(keys, num_computed_tokens) if k not in asked]
            if candidates and any(t[0].available for t in self._lookup_tiers):
                asked.update(candidates)
                query = _Query(candidates, self._query_pool.submit(self._query, candidates))
                self._queries[req_id] = query
                # A fresh query gets one poll interval to answer before the lookup says RETRY; with no
                # interval its answer is used by the next lookup (the engine asks again next step).
                if self._poll_s <= 0:
                    self._counters["tier_lookups_retry"] += 1
                    return True
                wait_futures([query.future], timeout=self._poll_s)
        if query is None:
            return False
        if not query.future.done():
            self._counters["tier_lookups_retry"] += 1
            return True
        del self._queries[req_id]
        return self._promote(req_id, keys, num_computed_tokens, query)  # HIT_PENDING until it completes

    def _host_misses(self, keys: Sequence[Sequence[OffloadKey]], num_computed: int) -> list[OffloadKey]:
        """Keys of the request's chunks past ``num_computed`` that the host pool does not hold, in order."""
        out: list[OffloadKey] = []
        manager = self.manager
        for group_keys, tpc in zip(keys, self._tokens_per_chunk, strict=True):
            out.extend(k for k in group_keys[num_computed // tpc :] if k not in manager)
        return out

    def _query(self, keys: list[OffloadKey]) -> list[list[bool]]:
        """Per tier, whether each key is present in every rank's namespace (runs on the query thread)."""
        result: list[list[bool]] = []
        for per_rank in self._lookup_tiers:
            present = [True] * len(keys)
            for tier in per_rank:
                found = tier.lookup(keys)
                present = [a and b for a, b in zip(present, found, strict=True)]
            result.append(present)
        return result

    def _promote(self, req_id: str, keys: Sequence[Sequence[OffloadKey]], num_computed: int, query: _Query) -> bool:
        """Allocate host chunks for the tier hits and queue one promotion job per tier; True if queued."""
        found = query.future.result()
        where: dict[OffloadKey, int] = {}
        for i, key in enumerate(query.keys):
            for t, present in enumerate(found):
                if present[i]:
                    where[key] = t
                    break
        if not where:
            return False
        wanted: list[OffloadKey] = []
        tokens: dict[OffloadKey, int] = {}
        for group_keys, tpc in zip(keys, self._tokens_per_chunk, strict=True):
            for key in group_keys[num_computed // tpc :]:
                if key in self.manager:
                    continue
                if key not in where:
                    break  # a prefix: nothing past the first chunk no tier has
                wanted.append(key)
                tokens[key] = tpc
        if not wanted:
            return False
        self._counters["tier_hits"] += len(wanted)
        plan = self.manager.prepare_store(wanted, request_id=req_id)
        if plan is None or not plan.keys_to_store:
            self._counters["promotions_refused"] += 1
            return False  # host memory is full: a MISS, the engine recomputes
        by_tier: dict[int, tuple[list[OffloadKey], list[int]]] = {}
        for key, chunk in zip(plan.keys_to_store, plan.chunk_ids, strict=True):
            tier_keys, chunks = by_tier.setdefault(where[key], ([], []))
            tier_keys.append(key)
            chunks.append(chunk)
        jobs = self._promoting.setdefault(req_id, set())
        for t, (tier_keys, chunks) in sorted(by_tier.items()):
            job = self._new_tier_job(t, True, tier_keys, chunks, req_id, sum(tokens[k] for k in tier_keys))
            jobs.add(job.job_id)
        return True

    def _new_tier_job(
        self, tier: int, is_promotion: bool, keys: list[OffloadKey], chunks: list[int], req_id: str | None, tokens: int
    ) -> TierJob:
        job = TierJob(
            job_id=self._next_tier_job,
            tier=tier,
            is_promotion=is_promotion,
            keys=tuple(keys),
            chunk_ids=pack_int64(chunks),
        )
        self._next_tier_job += 1
        self._tier_jobs[job.job_id] = _TierJobState(job, req_id, self._ranks_reporting, tokens)
        self._queued_tier_jobs.append(job)
        return job

    # ------------------------------------------------------------------------------------ plans

    def on_store_completed(self, keys: Sequence[OffloadKey]) -> None:
        """Queue the chunks for cascading to every tier with the next plan."""
        self._cascade_queue.extend(keys)

    def plan_tier_jobs(self) -> tuple[TierJob, ...]:
        """This step's promotions and the cascades of chunks stored since the last plan."""
        self._plan_cascades()
        jobs, self._queued_tier_jobs = self._queued_tier_jobs, []
        return tuple(jobs)

    def _plan_cascades(self) -> None:
        keys, self._cascade_queue = self._cascade_queue, []
        manager = self.manager
        # Pin the chunks that are still ready (one may be evicted or reset between its completion and this
        # plan); pinning is also the readiness check, so lookup statistics stay the engine's own.
        ready: list[OffloadKey] = []
        chunks: list[int] = []
        for key in dict.fromkeys(keys):
            try:
                chunks.extend(manager.prepare_load([key]))
            except InvalidStateError:
                continue
            ready.append(key)
        if not ready:
            return
        pinned = True  # the pin taken above goes to the first tier that takes the cascade
        for t, detector in enumerate(self._detectors):
            if detector.should_drop(len(ready)):
                self.stats[t].dropped_chunks += len(ready)
                continue
            if not pinned:
                manager.prepare_load(ready)  # one pin per tier job, released when every rank reported it
            pinned = False
            self._new_tier_job(t, False, list(ready), list(chunks), None, 0)
        if pinned:
            manager.complete_load(ready)  # every tier dropped it

    # ------------------------------------------------------------------------------------ reports

    def on_worker_reports(self, reports: Sequence[WorkerReport]) -> None:
        """Count tier-job results (cascades, promotions)."""
        for report in reports:
            for result in report.tier_results:
                self._on_tier_result(report.rank, result)

    def _on_tier_result(self, rank: int, result: TierJobResult) -> None:
        state = self._tier_jobs.get(result.job_id)
        if state is None or rank in state.reported:
            return
        state.reported.add(rank)
        state.failed.update(Int32Array.from_buffer(result.failed).tolist())
        if result.corrupt:
            self.stats[state.job.tier].corrupt_records += len(Int32Array.from_buffer(result.corrupt))
        state.num_bytes += result.num_bytes
        state.seconds = max(state.seconds, result.seconds)
        state.pending -= 1
        if state.pending == 0:
            self._finish_tier_job(state)

    def _finish_tier_job(self, state: _TierJobState) -> None:
        del self._tier_jobs[state.job.job_id]
        self._fence.discard(state.job.job_id)
        job = state.job
        row = self.stats[job.tier]
        keys = [OffloadKey(key) for key in job.keys]  # the wire type holds plain bytes
        bad = [keys[i] for i in sorted(state.failed) if i < len(keys)]
        good = [k for i, k in enumerate(keys) if i not in state.failed]
        if job.is_promotion:
            if state.req_id is not None:
                jobs = self._promoting.get(state.req_id)
                if jobs is not None:
                    jobs.discard(job.job_id)
                    if not jobs:
                        del self._promoting[state.req_id]
            if not state.stale:
                if good:
                    self.manager.complete_store(good, success=True)
                if bad:
                    self.manager.complete_store(bad, success=False)
            row.promoted_chunks += len(good)
            row.promotion_failures += len(bad)
            row.tokens_promoted += state.tokens * len(good) // max(1, len(keys))
            row.bytes_read += state.num_bytes
            row.read_seconds += state.seconds
        else:
            if not state.stale:
                self.manager.complete_load(keys)
            row.cascaded_chunks += len(good)
            row.cascade_failures += len(bad)
            row.bytes_written += state.num_bytes
            row.write_seconds += state.seconds
            per_rank = state.num_bytes // max(1, self._ranks_reporting)
            self._detectors[job.tier].record(per_rank, state.seconds, success=not bad)

    def fail_in_flight(self) -> None:
        """Fail every tier job in flight (a worker died): pins released, promoted chunks never ready."""
        for state in list(self._tier_jobs.values()):
            state.failed.update(range(len(state.job.keys)))
            self._finish_tier_job(state)

    def has_pending_work(self) -> bool:
        """Tier jobs in flight, cascades still to plan, or tier queries running."""
        return bool(self._tier_jobs or self._cascade_queue or self._queries or self._fence)

    def reset(self) -> None:
        """vLLM ``reset_cache``: tier jobs not yet sent are dropped (the reset frees their chunks), jobs in flight
        become stale (their results no longer touch the pool; the next plan has the workers finish them first),
        and until every stale job has reported, lookups answer from the host pool alone (a chunk only a tier
        holds is a MISS), as vLLM holds promotions until the reset is flushed."""
        unsent = {job.job_id for job in self._queued_tier_jobs}
        self._queued_tier_jobs = []
        for job_id in unsent:
            state = self._tier_jobs.pop(job_id)
            if state.req_id is not None:
                jobs = self._promoting.get(state.req_id)
                if jobs is not None:
                    jobs.discard(job_id)
                    if not jobs:
                        del self._promoting[state.req_id]
        for state in self._tier_jobs.values():
            state.stale = True
        self._fence = set(self._tier_jobs)
        self._cascade_queue.clear()
        self._queried.clear()
        self._queries.clear()
        for detector in self._detectors:
            detector.reset()

    def on_request_finished(self, req_id: str) -> None:
        """Forget the request's tier queries."""
        self._queried.pop(req_id, None)
        self._queries.pop(req_id, None)

    def counters(self) -> dict[str, int]:
        """Tier lookup counters: RETRY answers, promotions refused (host full), tier hits."""
        return dict(self._counters)

    def backpressure(self, tier: int) -> EMABackpressureDetector:
        """The backpressure detector of tier ``tier``."""
        return self._detectors[tier]

    def close(self) -> None:
        """Release the lookup tiers and the query thread."""
        self._query_pool.shutdown(wait=True)
        for per_rank in self._lookup_tiers:
            for tier in per_rank:
                tier.close()
        self._lookup_tiers = []
