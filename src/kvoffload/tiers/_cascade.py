"""vLLM 0.33's tiering semantics on top of the host pool: cascade every stored chunk, promote tier hits.

Where the work runs, and why: kvoffload's host pool rows live in the worker processes (one ``HostPool`` per
rank, or one shared ``/dev/shm`` region), so the tier IO runs in each worker on its own rows
(:class:`~kvoffload.tiers.TierWorker`), reading and writing its own namespace (rank-specific unless the
offload is replicated). The scheduler decides (:class:`Tiering`, this module, composed into the scheduler);
it ships the decisions as ``TierJob`` lists on the ``StepPlan`` and gets ``TierJobResult`` lists back on each
``WorkerReport``, like copy jobs. A tier chunk counts as present only when every rank's namespace has it.
Lookups are metadata queries (a stat, an EXISTS) that the scheduler runs itself, on a background thread, for at
most ``tier_lookup_timeout_s`` per request (:mod:`~kvoffload.tiers._lookup_gate`; outages: ``_health``).

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
* **Chained promotions** (``chain_promotions``, for engines whose workers finish a step's promotions within the
  step: the CPU engines, each rank promoting its own rows). The lookup that queues a promotion answers with the
  hit at once, pinning the chunks before their write completes; any request's lookup in the same step may load
  chunks queued for promotion in it. The workers run the promotion before the loads that read its chunks, so
  the tier hit loads in the step it is promoted instead of one step later. A promoted chunk that fails (a
  corrupt record) is never sealed, so the load reading it fails its integrity check and the engine recomputes;
  a promotion not done within ``promotion_wait_s`` fails its chained loads without copying.
* **Per request and per tier.** A request's ``kv_load_tiers`` (``on_new_request``) limits the tiers it is promoted
  from (host hits load either way); a tier with ``enable_kv_events`` announces its records (``take_events``:
  stored when a cascade completes, removed when a bad record is deleted, medium ``STORAGE``).

Tier work never blocks an engine step: queries run on a thread, IO on the workers' tier threads, results
are polled at each step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvoffload._generated import OffloadingConfig, TieringConfig, TierJob, TierJobResult, WorkerReport
from kvoffload.errors import InvalidStateError
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager import HostBlockManager, OffloadEvent
from kvoffload.offload.scheduler import (
    ExtensionFigures,
    Locality,
    LookupAdvice,
    SchedulerExtension,
    TierFilter,
    TierStatsRow,
)
from kvoffload.tiers._backpressure import EMABackpressureDetector, resolve_backpressure
from kvoffload.tiers._base import SecondaryTier, TierBase
from kvoffload.tiers._config import open_tier
from kvoffload.tiers._health import TierHealth, tier_is_healthy, tier_type
from kvoffload.tiers._jobs import TierJobBook, TierJobState, count_finished
from kvoffload.tiers._load_filters import LoadFilters, configured_locality, tier_place
from kvoffload.tiers._lookup_gate import LookupGate, Query, QueryAnswer
from kvoffload.tiers._namespace import namespaces_for_all_ranks
from kvoffload.tiers._summary import describe_tier
from kvoffload.tiers._tier_events import TierEvents

__all__ = ["TierStatsRow", "Tiering"]

logger = logging.getLogger(__name__)


_DEFER = LookupAdvice(defer=True)


class Tiering(SchedulerExtension):
    """Secondary tiers below the host pool, composed into an :class:`~kvoffload.offload.scheduler.OffloadScheduler`.

    Implements :class:`~kvoffload.offload.scheduler.SchedulerExtension` (see the module docstring for the
    semantics): ``OffloadScheduler(config, manager, extension=Tiering(config, manager, tiering))``, with the same
    ``config`` and ``manager``. ``tiering`` lists the tiers; valkey tiers need a url here (see
    :func:`start_embedded_servers`). It opens one lookup instance per tier and rank namespace; ``close()``
    (the scheduler's ``close()`` calls it) releases them.
    """

    def __init__(
        self,
        config: OffloadingConfig,
        manager: HostBlockManager,
        tiering: TieringConfig,
        *,
        log: logging.Logger | None = None,
        chain_promotions: bool = False,
    ) -> None:
        self.config = config
        self.chain_promotions = chain_promotions
        self.manager = manager
        self.tiering = tiering
        self._log = logger if log is None else log
        bpc = config.cache.blocks_per_chunk
        self._tokens_per_chunk = tuple(g.tokens_per_block * bpc for g in config.groups)
        namespaces = namespaces_for_all_ranks(config)
        self._jobs = TierJobBook(config.parallel.world_size)
        self._lookup_tiers: list[list[SecondaryTier]] = []
        self._gate = LookupGate(
            self._lookup_tiers, tiering.tier_lookup_timeout_s, tiering.tier_down_after_s, log=self._log
        )
        self.stats = [TierStatsRow(tier_type(t), index=i) for i, t in enumerate(tiering.secondary_tiers)]
        """What each tier did, in config order (with its availability as the scheduler sees it)."""
        self._residency: list[dict[int, tuple[int, int]]] = [{} for _ in self.stats]  # per tier: rank -> held
        self._health = TierHealth(self.stats, self._log)
        self._unusable_at_start: list[str | None] = []
        try:
            for i, tier_config in enumerate(tiering.secondary_tiers):
                self._lookup_tiers.append([open_tier(tier_config, ns, lookups_only=True, index=i) for ns in namespaces])
            self._unusable_at_start = self._health.check_at_start(tiering, self._lookup_tiers)
        except BaseException:
            self.close()
            raise
        self._detectors = [
            EMABackpressureDetector(
                resolve_backpressure(
                    tier_type(t), tiering.backpressure, t.backpressure, remote=configured_locality(t) is Locality.REMOTE
                )
            )
            for t in tiering.secondary_tiers
        ]
        self._events = TierEvents(tiering.secondary_tiers)
        places = zip(tiering.secondary_tiers, self._lookup_tiers, strict=True)
        self._filters = LoadFilters([tier_place(config, per_rank[0]) for config, per_rank in places])
        self._queries: dict[str, Query] = {}
        self._queried: dict[str, set[OffloadKey]] = {}
        self._unreachable: dict[str, set[OffloadKey]] = {}  # host misses a tier could not be asked for
        self._chained: set[OffloadKey] = set()  # keys promoted by the plan being built (chain_promotions)
        self._cascade_queue: list[OffloadKey] = []
        self._reset_held = False  # from a reset until the scheduler's copy jobs of before it have all reported
        self._counters = {"tier_lookups_retry": 0, "promotions_refused": 0, "tier_hits": 0}
        self._poll_s = tiering.tier_poll_interval_s
        if any(reason is None for reason in self._unusable_at_start):
            self._gate.warm(self._gate.down_after_s)

    def describe(self) -> list[str]:
        """One phrase per tier for a start line: kind, where, capacity, records a restart found (disk)."""
        return [
            describe_tier(i, config, per_rank, unusable)
            for i, (config, per_rank, unusable) in enumerate(
                zip(self.tiering.secondary_tiers, self._lookup_tiers, self._unusable_at_start, strict=True)
            )
        ]

    # ------------------------------------------------------------------------------------ lookups

    def advise_lookup(
        self, req_id: str, keys: Sequence[Sequence[OffloadKey]], num_computed_tokens: int
    ) -> LookupAdvice:
        """Defer the lookup while the tiers are asked for the chunks the host pool misses (see :meth:`_defer`);
        else name the misses no tier could be asked for and the keys chained into this step's plan."""
        if self._defer(req_id, keys, num_computed_tokens):
            return _DEFER
        return LookupAdvice(unavailable=self._unreachable.get(req_id, frozenset()), chained=self._chained)

    def _defer(self, req_id: str, keys: Sequence[Sequence[OffloadKey]], num_computed_tokens: int) -> bool:
        """Ask the tiers for chunks the host pool misses: True (ask again later) while a tier query runs
        (RETRY, at most ``tier_lookup_timeout_s``) or a promotion is in flight (HIT_PENDING)."""
        if not self._lookup_tiers or self._jobs.fence or self._reset_held:
            return False  # no tiers, or a reset not yet flushed: the host pool answers alone (a tier-only chunk misses)
        allowed = self._filters.allowed(req_id)
        if not any(allowed):
            return False  # its kv_load_tiers allows no tier: the request loads host hits only
        if self._jobs.promoting(req_id):
            return True
        query = self._queries.get(req_id)
        if query is None:
            asked = self._queried.setdefault(req_id, set())
            candidates = [k for k in self._host_misses(keys, num_computed_tokens) if k not in asked]
            if not candidates:
                return False
            healthy = any(a and self.is_healthy(t) for t, a in enumerate(allowed))  # no IO: the hot path
            query = self._gate.submit(candidates, self._health) if healthy else None
            if query is None:  # every tier is down or backs off, or the query thread is stuck: answer at once
                self._unreachable.setdefault(req_id, set()).update(candidates)
                return False
            asked.update(candidates)
            self._queries[req_id] = query
            # A fresh query gets one poll interval to answer before the lookup says RETRY; with no
            # interval its answer is used by the next lookup (the engine asks again next step).
            if self._poll_s <= 0:
                self._counters["tier_lookups_retry"] += 1
                return True
            self._gate.wait(query, self._poll_s)
        if not query.future.done():
            if not self._gate.expired(query):
                self._counters["tier_lookups_retry"] += 1
                return True
            del self._queries[req_id]  # past tier_lookup_timeout_s: the host pool answers, the tier misses
            self._gate.abandon(query, late=True)
            self._mark_unreachable(req_id, query.keys)
            self._gate.watch(self._health)
            return False
        del self._queries[req_id]
        answer = query.future.result()
        self._health.apply(answer.faults)
        for row, present, fault in zip(self.stats, answer.found, answer.faults, strict=True):
            row.chunk_queries += len(query.keys) if fault is None else 0
            row.chunk_hits += sum(present) if fault is None else 0
        if any(f is not None and a for f, a in zip(answer.faults, allowed, strict=True)):
            hits = [p for p, a in zip(answer.found, allowed, strict=True) if a]  # the tiers it may load from
            found = {k for i, k in enumerate(query.keys) if any(p[i] for p in hits)}
            self._mark_unreachable(req_id, [k for k in query.keys if k not in found])
        elif req_id in self._unreachable:
            self._unreachable[req_id].difference_update(query.keys)
        # HIT_PENDING until it completes, unless the promotion is chained to the request's load in this plan
        return self._promote(req_id, keys, num_computed_tokens, query, answer) and not self.chain_promotions

    def _mark_unreachable(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        """Host misses no tier could be asked for: their misses count as ``tier_unavailable``; asked again later."""
        self._unreachable.setdefault(req_id, set()).update(keys)
        asked = self._queried.get(req_id)
        if asked is not None:
            asked.difference_update(keys)

    def _host_misses(self, keys: Sequence[Sequence[OffloadKey]], num_computed: int) -> list[OffloadKey]:
        """Keys of the request's chunks past ``num_computed`` that the host pool does not hold, in order."""
        out: list[OffloadKey] = []
        manager = self.manager
        for group_keys, tpc in zip(keys, self._tokens_per_chunk, strict=True):
            out.extend(k for k in group_keys[num_computed // tpc :] if k not in manager)
        return out

    def _promote(
        self, req_id: str, keys: Sequence[Sequence[OffloadKey]], num_computed: int, query: Query, answer: QueryAnswer
    ) -> bool:
        """Allocate host chunks for the tier hits and queue one promotion job per tier; True if queued."""
        found, allowed = answer.found, self._filters.allowed(req_id)
        where: dict[OffloadKey, int] = {}
        for i, key in enumerate(query.keys):
            for t, present in enumerate(found):
                if present[i] and allowed[t]:
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
        for t, (tier_keys, chunks) in sorted(by_tier.items()):
            self._jobs.new(t, True, tier_keys, chunks, req_id, sum(tokens[k] for k in tier_keys))
        if self.chain_promotions:
            self._chained.update(plan.keys_to_store)
        return True

    # ------------------------------------------------------------------------------------ plans

    def on_store_completed(self, keys: Sequence[OffloadKey]) -> None:
        """Queue the chunks for cascading to every tier with the next plan."""
        self._cascade_queue.extend(keys)

    def plan_tier_jobs(self) -> tuple[TierJob, ...]:
        """This step's promotions and the cascades of chunks stored since the last plan."""
        self._chained.clear()  # a chained hit is loaded in this plan or not at all
        self._gate.watch(self._health)
        self._plan_cascades()
        return self._jobs.take_queued()

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
            self._jobs.new(t, False, list(ready), list(chunks), None, 0)
        if pinned:
            manager.complete_load(ready)  # every tier dropped it

    # ------------------------------------------------------------------------------------ reports

    def on_worker_reports(self, reports: Sequence[WorkerReport]) -> None:
        """Count tier-job results (cascades, promotions)."""
        for report in reports:
            for result in report.tier_results:
                self._on_tier_result(report.rank, result)

    def _on_tier_result(self, rank: int, result: TierJobResult) -> None:
        job = self._jobs.jobs.get(result.job_id)
        if job is not None and (result.resident_bytes or result.resident_records):
            # A rank that did none of the job's IO (another rank writes a shared pool's rows) reports zeros.
            held = self._residency[job.job.tier]
            held[rank] = (result.resident_bytes, result.resident_records)
            row = self.stats[job.job.tier]
            row.resident_bytes = sum(b for b, _ in held.values())
            row.resident_records = sum(n for _, n in held.values())
        state = self._jobs.on_result(rank, result)
        if state is not None:
            self._finish_tier_job(state)

    def _finish_tier_job(self, state: TierJobState) -> None:
        self._jobs.finish(state)
        job = state.job
        row = self.stats[job.tier]
        keys = [OffloadKey(key) for key in job.keys]  # the wire type holds plain bytes
        bad = [keys[i] for i in sorted(state.failed) if i < len(keys)]
        good = [k for i, k in enumerate(keys) if i not in state.failed]
        if job.is_promotion:
            if bad:  # a lookup instance that remembers them as present (obj's known cache) must ask again
                for tier in self._lookup_tiers[job.tier] if job.tier < len(self._lookup_tiers) else ():
                    if isinstance(tier, TierBase):
                        tier.forget(bad)
            if not state.stale:
                if good:
                    self.manager.complete_store(good, success=True)
                if bad:
                    self.manager.complete_store(bad, success=False)
        else:
            if not state.stale:
                self.manager.complete_load(keys)
            self._events.stored(job.tier, good)  # in every rank's namespace now
            per_rank = state.num_bytes // max(1, self._jobs.ranks)
            self._detectors[job.tier].record(per_rank, state.seconds, success=not bad)
        count_finished(row, state, len(good), len(bad))
        self._events.removed(job.tier, [keys[i] for i in sorted(state.corrupt) if i < len(keys)])

    def fail_in_flight(self) -> None:
        """Fail every tier job in flight (a worker died): pins released, promoted chunks never ready."""
        for state in list(self._jobs.jobs.values()):
            state.failed.update(range(len(state.job.keys)))
            self._finish_tier_job(state)

    def has_pending_work(self) -> bool:
        """Tier jobs in flight, cascades still to plan, or tier queries running."""
        return bool(self._jobs.jobs or self._cascade_queue or self._queries)

    def reset(self) -> None:
        """vLLM ``reset_cache``: tier jobs not yet sent are dropped (the reset frees their chunks), jobs in flight
        become stale (their results no longer touch the pool; the next plan has the workers finish them first),
        and until every stale job has reported, lookups answer from the host pool alone (a chunk only a tier
        holds is a MISS), as vLLM holds promotions until the reset is flushed: until :meth:`on_reset_flushed` too,
        even when no tier job was in flight."""
        self._jobs.reset()
        self._chained.clear()
        self._cascade_queue.clear()
        self._queried.clear()
        self._unreachable.clear()
        for query in self._queries.values():
            self._gate.abandon(query)
        self._queries.clear()
        for detector in self._detectors:
            detector.reset()
        self._reset_held = bool(self._lookup_tiers)

    def on_reset_flushed(self) -> None:
        """The scheduler's copy jobs of before the last reset have all reported: promotions may fill host rows
        again (once the stale tier jobs have reported too)."""
        self._reset_held = False

    def on_new_request(self, req_id: str, load_tiers: TierFilter) -> None:
        """The request loads only from the tiers ``load_tiers`` allows (vLLM's ``kv_load_tiers``)."""
        self._filters.set(req_id, load_tiers)

    def on_request_finished(self, req_id: str) -> None:
        """Forget the request's tier queries (one still running is left to finish, for tier health)."""
        self._filters.forget(req_id)
        self._queried.pop(req_id, None)
        self._unreachable.pop(req_id, None)
        query = self._queries.pop(req_id, None)
        if query is not None:
            self._gate.abandon(query)

    def take_events(self) -> list[OffloadEvent]:
        """Records stored and removed (medium STORAGE) in the tiers with ``enable_kv_events``, since the last call."""
        return self._events.take()

    def is_healthy(self, tier: int) -> bool:
        """Whether tier ``tier`` is worth asking, without IO: the scheduler saw it answer last, and no rank's
        instance is in a fault (``TierBase.is_healthy``). Lookups check it before queueing a tier query."""
        return self.stats[tier].available and all(tier_is_healthy(t) for t in self._lookup_tiers[tier])

    def counters(self) -> dict[str, int]:
        """Tier lookup counters: RETRY answers, lookups past the timeout, promotions refused (host full), tier
        hits."""
        return {**self._counters, "tier_lookups_late": self._gate.late}

    def figures(self) -> ExtensionFigures:
        """Each tier's row (live) and the lookup counters, for metrics and logs."""
        return ExtensionFigures(tuple(self.stats), self.counters())

    def backpressure(self, tier: int) -> EMABackpressureDetector:
        """The backpressure detector of tier ``tier``."""
        return self._detectors[tier]

    def close(self) -> None:
        """Release the query thread (a query hung past the timeout is not waited for) and the lookup tiers."""
        self._gate.close()
        for per_rank in self._lookup_tiers:
            for tier in per_rank:
                tier.close()
        self._lookup_tiers = []
