"""The scheduler side: per-request lookup, load and store decisions, turned into one StepPlan per step.

``OffloadScheduler`` is engine-neutral. An engine drives it with a handful of calls per request::

    sched.add_request("r1", block_hashes, num_tokens=len(prompt))    # hashes at tokens_per_hash
    hit = sched.lookup("r1", num_computed_tokens=local_prefix_hit)    # tokens loadable from the host
    sched.on_blocks_allocated("r1", new_block_ids, num_external_tokens=hit or 0)
    ...forward pass...
    sched.on_tokens_computed("r1", num_computed_tokens)
    plan = sched.build_step_plan()                                    # -> every worker
    done = sched.on_worker_reports(reports)                           # <- from every worker
    sched.finish_request("r1")

Semantics follow vLLM 0.33's offloading connector scheduler: chunk keys are the hash of
the last hash-block of each chunk; a lookup finds the longest run of ready chunks (full attention) or the
rightmost ready window (sliding window) and defers (returns ``None``) while a needed chunk is still being
written; only prompt tokens are stored by default (``offload_prompt_only``); a job completes when
every one of ``world_size`` workers has reported it; a failed job never marks data ready and releases its
pins. One deliberate difference: chunks found by ``lookup`` are pinned right away (vLLM pins when blocks are
allocated), so a store planned between lookup and allocation can never evict them.

Shared loads (unlike vLLM 0.33, which defers a lookup while another request loads any of its chunks, the
convoy of vLLM issue 44294): chunks another request is loading are hits like any other; the request loads
them into its own blocks at once, from the same pinned host copies. Two options of vLLM's bound the waits:
``max_recompute_pending_tokens`` recomputes a short run of chunks still being stored instead of waiting for
it (vLLM PR 57959), and ``sync_load_budget_bytes`` loads hits inside the step while a per-step byte budget
lasts (:meth:`OffloadScheduler.is_sync_load`), as vLLM 0.33 does.

Integrity: every job carries the key tag of each chunk (``TransferJob.chunk_tags``); a load that a worker
reports with ``corrupt_chunk_ids`` fails (the request recomputes) and those chunks are dropped from the
manager, so they are never served again (``SchedulerStats.corrupt_loads`` / ``corrupted_chunks``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import msgspec

from kvoffload._generated import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    MissReason,
    OffloadingConfig,
    StepPlan,
    WorkerReport,
)
from kvoffload._ints import check_int, check_optional_int
from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.keys import BlockHash, OffloadKey, offload_key_group, offload_key_hash
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.scheduler._extension import SchedulerExtension
from kvoffload.offload.scheduler._lookups import Lookups
from kvoffload.offload.scheduler._misses import ChunkMiss
from kvoffload.offload.scheduler._reports import Reports
from kvoffload.offload.scheduler._results import ReportOutcome, SchedulerStats
from kvoffload.offload.scheduler._state import GroupGeometry, RequestState, SchedulerBook, check_retention_interval
from kvoffload.offload.scheduler._tier_filter import TierFilter
from kvoffload.offload.scheduler._transfers import Transfers

__all__ = ["OffloadScheduler"]


class OffloadScheduler:
    """Decides, per request, which chunks to load from and store into the host pool (vLLM 0.33 semantics).

    ``offload_prompt_only`` (True, vLLM's default; :func:`~kvoffload.build_scheduler` takes it from the decoded
    extra config): decode-phase KV is not offloaded unless it is turned off. ``null_block_id`` names the engine's
    placeholder block (vLLM uses 0 for blocks a sliding window dropped): chunks holding it are never stored.
    ``extension`` plugs in what lies below the host pool (:class:`~kvoffload.tiers.Tiering`); see
    :class:`SchedulerExtension` for when its hooks run. ``max_recompute_pending_tokens`` (0: always wait, vLLM
    0.33): a full-attention hit whose chunks from the first one still being stored to its end hold at most this
    many tokens (whole chunks) stops before them, and the engine recomputes them (``pending_recomputes``
    counts such lookups). ``sync_load_budget_bytes`` (0: off): per step, hits whose bytes (hit tokens x the KV
    bytes of one token on one worker) fit in what is left of the budget are loaded inside the step
    (:meth:`is_sync_load`, ``TransferJob.sync``), the others between steps.

    The engine's facts about its groups, by KV cache group id (each must be an offloaded group;
    :func:`~kvoffload.build_scheduler` reads them from the snapshot's ``KVCacheConfig``): ``eagle_group_ids``, the
    EAGLE/MTP draft groups (vLLM: ``is_eagle_group`` with ``speculative_config.use_eagle_block_drop()``), whose
    last offloadable chunk is not stored while a request decodes and whose lookups stop one chunk before the
    end of what they hold; ``mamba_align_group_ids``, the ``mamba_cache_mode="align"`` Mamba groups (offloaded
    as a window of one chunk), to whose chunk size every hit end is rounded down;
    ``prefix_cache_retention_interval`` (tokens, vLLM's cache config), checked as vLLM's scheduler checks it (>= 0,
    a multiple of every window group's tokens per chunk) and otherwise not used (see docs/limitations.md).
    """

    def __init__(
        self,
        config: OffloadingConfig,
        manager: HostBlockManager,
        *,
        offload_prompt_only: bool = True,
        null_block_id: int | None = None,
        extension: SchedulerExtension | None = None,
        max_recompute_pending_tokens: int = 0,
        sync_load_budget_bytes: int = 0,
        eagle_group_ids: Collection[int] = (),
        mamba_align_group_ids: Collection[int] = (),
        prefix_cache_retention_interval: int | None = None,
    ) -> None:
        self.config = config
        self.manager = manager
        self.extension = extension if extension is not None else SchedulerExtension()
        book = self._book = SchedulerBook(
            config, manager, eagle_group_ids=eagle_group_ids, mamba_align_group_ids=mamba_align_group_ids
        )
        self.prefix_cache_retention_interval = check_retention_interval(prefix_cache_retention_interval, book.groups)
        self.max_recompute_pending_tokens = check_int("max_recompute_pending_tokens", max_recompute_pending_tokens)
        self.sync_load_budget_bytes = check_int("sync_load_budget_bytes", sync_load_budget_bytes)
        self._lookups = Lookups(
            book,
            max_recompute_pending_tokens=self.max_recompute_pending_tokens,
            sync_load_budget_bytes=self.sync_load_budget_bytes,
        )
        self._transfers = Transfers(book, offload_prompt_only=offload_prompt_only, null_block_id=null_block_id)
        self._reports = Reports(book, self._transfers, self._store_completed)
        self._flush_tiers = False
        self._reset_fence: set[int] = set()  # copy jobs in flight at the last reset, not yet reported
        self.world_size = book.world_size

    @property
    def offload_prompt_only(self) -> bool:
        """Whether only prompt tokens are stored (decode-phase KV is not offloaded)."""
        return self._transfers.offload_prompt_only

    @property
    def null_block_id(self) -> int | None:
        """The engine's placeholder block id (never stored), or None."""
        return self._transfers.null_block_id

    @property
    def groups(self) -> tuple[GroupGeometry, ...]:
        """The chunk geometry of each offloaded group, in config order (``eagle``: an EAGLE draft group)."""
        return self._book.groups

    @property
    def mamba_align_tokens(self) -> int | None:
        """Tokens every hit end is rounded down to (the align-mode Mamba groups' chunk), or None without them."""
        return self._book.mamba_align

    # ------------------------------------------------------------------------------------------ requests

    def add_request(
        self,
        req_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        *,
        prompt_len: int | None = None,
        max_load_tokens: int | None = None,
        max_offload_tokens: int | None = None,
        load_tiers: TierFilter | None = None,
    ) -> None:
        """Register a request: its block hashes (at ``tokens_per_hash`` granularity) and its token count.

        ``prompt_len`` defaults to ``num_tokens``; ``max_load_tokens`` / ``max_offload_tokens`` cap what is
        loaded from / stored to the host for this request (vLLM's per-request ``kv_transfer_params``);
        ``load_tiers`` names the tiers below the host pool its loads may come from (``kv_load_tiers``, see
        :func:`~kvoffload.offload.scheduler.parse_load_tiers`; None: every tier). Host hits load either way.
        """
        if load_tiers is not None and not isinstance(load_tiers, TierFilter):
            raise ConfigError(f"load_tiers must be a TierFilter or None, got {load_tiers!r}")
        if req_id in self._book.requests:
            raise InvalidStateError(f"request {req_id!r} is already registered")
        num_tokens = check_int("num_tokens", num_tokens)
        prompt = num_tokens if prompt_len is None else check_int("prompt_len", prompt_len, 0, num_tokens)
        req = RequestState(
            req_id=req_id,
            block_hashes=list(block_hashes),
            num_tokens=num_tokens,
            prompt_len=prompt,
            max_load_tokens=check_optional_int("max_load_tokens", max_load_tokens),
            max_offload_tokens=check_optional_int("max_offload_tokens", max_offload_tokens),
            keys=[[] for _ in self._book.groups],
            block_ids=[[] for _ in self._book.groups],
            next_stored=[0 for _ in self._book.groups],
        )
        self._book.requests[req_id] = req
        self._book.update_keys(req)
        if load_tiers is not None:
            self.extension.on_new_request(req_id, load_tiers)

    def extend_request(self, req_id: str, new_block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Append block hashes and raise the token count as a request decodes."""
        req = self._book.request(req_id)
        if num_tokens < req.num_tokens:
            raise ConfigError(f"num_tokens of {req_id!r} cannot shrink ({req.num_tokens} -> {num_tokens})")
        req.block_hashes.extend(new_block_hashes)
        req.num_tokens = num_tokens
        self._book.update_keys(req)

    def on_tokens_computed(self, req_id: str, num_computed_tokens: int) -> None:
        """Advance a request's computed tokens; newly complete chunks are stored by the next step plan."""
        req = self._book.request(req_id)
        if num_computed_tokens > req.num_tokens:
            raise ConfigError(
                f"num_computed_tokens={num_computed_tokens} exceeds num_tokens={req.num_tokens} of {req_id!r}"
            )
        req.num_computed = max(req.num_computed, num_computed_tokens)

    # ---------------------------------------------------------------------------------------- lifecycle

    def finish_request(self, req_id: str) -> None:
        """The request finished: no more stores; its state goes once its in-flight jobs complete.

        Its engine blocks stay fenced until their stores complete: reallocating one flushes the store.
        """
        req = self._book.request(req_id)
        self._book.release_pins(req)
        req.finished = True
        # vLLM's order: every key the request loaded, stored or reused, by end-token position then group id;
        # the policy refreshes them so that the request's first chunk (a shared prefix) ends most recent.
        keys = sorted(req.accessed, key=req.accessed.__getitem__)
        self.manager.on_request_finished(keys, req.reused_keys, request_id=req_id)
        if not req.jobs:
            self._book.drop(req)
        self.extension.on_request_finished(req_id)

    def abort_request(self, req_id: str) -> None:
        """Abort a request mid-flight: pins released, in-flight stores flushed by the next step plan.

        In-flight loads still complete on the workers (copies cannot be recalled); their results only
        release the chunks.
        """
        req = self._book.request(req_id)
        for job_id in req.jobs:
            if self._book.jobs[job_id].is_store:
                self._transfers.flush(job_id)
        self._transfers.withdraw_loads(req)
        self.finish_request(req_id)

    def reset(self) -> None:
        """Drop every stored chunk (vLLM ``reset_cache``): in-flight jobs are flushed and become stale."""
        self.extension.reset()
        self._flush_tiers = True  # the workers finish their tier IO before the freed rows are reused
        for req in self._book.requests.values():
            self._book.release_pins(req)
            req.next_stored = [0 for _ in self._book.groups]
        for job in self._book.jobs.values():
            job.stale = True
            self._transfers.flush(job.job_id)
        self.manager.reset()
        self._reset_fence = set(self._book.jobs)
        if not self._reset_fence:
            self.extension.on_reset_flushed()

    def _count_down_reset_fence(self) -> None:
        """Tell the extension once every job in flight at the last reset has reported (vLLM's reset fence)."""
        if self._reset_fence:
            self._reset_fence.intersection_update(self._book.jobs)
            if not self._reset_fence:
                self.extension.on_reset_flushed()

    def has_pending_work(self) -> bool:
        """Whether copy jobs are in flight or queued, or the extension has work pending."""
        if self._book.jobs or self._transfers.has_queued_loads():
            return True
        return self.extension.has_pending_work()

    def close(self) -> None:
        """Release the extension's resources (threads, connections); the scheduler itself holds none."""
        self.extension.close()

    # ------------------------------------------------------------------------------------ lookups

    def lookup(self, req_id: str, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from the host, or None to ask again later.

        The hit is chunk-aligned, leaves at least the last token to compute, and its chunks are pinned
        until ``on_blocks_allocated`` turns them into a load job (or the next lookup/abort releases them).
        Chunks other requests are loading count as hits (shared loads: no request waits for another's load).
        ``None`` means a needed chunk is still being written (beyond ``max_recompute_pending_tokens``), the
        request has a job in flight, or the extension is still bringing chunks into the host pool.
        ``stats().lookups`` counts a request's final answers (an int), ``lookups_deferred`` its ``None`` answers
        (re-asks).
        """
        advice = self.extension.advise_lookup(req_id, self._book.request(req_id).keys, num_computed_tokens)
        if advice.defer:
            self._book.stats.lookups_deferred += 1
            return None
        return self._lookups.lookup(req_id, num_computed_tokens, advice.unavailable, advice.chained)

    def is_sync_load(self, req_id: str) -> bool:
        """Whether the hit of the request's last lookup loads inside the step (``sync_load_budget_bytes``).

        An engine computes such a request in the same step, after waiting for its load (vLLM: the lookup answers
        ``load_kv_async=False``); its load job has ``sync`` set. False for a request without a pending hit.
        """
        return self._book.request(req_id).sync_load

    def lookup_misses(self, req_id: str) -> tuple[ChunkMiss, ...]:
        """The chunks the request's last lookup wanted but did not load, each with its :class:`MissReason`.

        Empty before the first lookup, after a full hit, and for a lookup deferred for another reason than a
        pending store (the request has a job in flight, or the extension is still finding its chunks).
        """
        return self._book.request(req_id).misses

    def forget_chunk(self, key: OffloadKey, reason: MissReason) -> bool:
        """Drop one chunk from the pool for ``reason`` and remember it, so later misses on it say why.

        The hook for features that find a chunk unusable: a tier that cannot serve it
        (``MissReason.TIER_UNAVAILABLE``), or a checksum mismatch found elsewhere than in a load report
        (``MissReason.CORRUPT``; corrupt chunks named by worker reports are dropped already). Returns True when
        the chunk was resident and is dropped (a chunk pinned by loads is never served again and is freed at
        its last unpin); an absent one only has its reason remembered. A chunk whose store is in flight raises
        :class:`InvalidStateError`.
        """
        return self._lookups.forget_chunk(key, reason)

    # ------------------------------------------------------------------------------------ transfers

    def on_blocks_allocated(
        self, req_id: str, new_block_ids: Sequence[Sequence[int]], *, num_external_tokens: int = 0
    ) -> None:
        """Record engine blocks newly allocated to a request, one list per offloaded group (config order).

        With ``num_external_tokens`` > 0 (at most what ``lookup`` returned, chunk-aligned) a load job is
        queued for the next step plan; blocks that an in-flight store still reads are flushed first.
        """
        self._transfers.on_blocks_allocated(req_id, new_block_ids, num_external_tokens=num_external_tokens)

    def build_step_plan(self) -> StepPlan:
        """The StepPlan for this step: queued loads, stores of newly complete chunks, flushes, tier jobs."""
        # The extension plans first: chunks it pins are then safe from this step's store evictions.
        tier_jobs = self.extension.plan_tier_jobs()
        plan = self._transfers.build_step_plan(tier_jobs)
        self._lookups.new_step()
        if self._flush_tiers:
            self._flush_tiers = False
            plan = msgspec.structs.replace(plan, flush_tiers=True)
        return plan

    # ------------------------------------------------------------------------------------ reports

    def on_worker_reports(self, reports: Iterable[WorkerReport]) -> ReportOutcome:
        """Count worker results; a job completes once all ``world_size`` workers reported it.

        A job any worker failed is a failure: its stored chunks are freed (never marked ready) and a failed
        load's request must recompute. Reports of unknown or stale jobs are ignored. The extension then gets
        the same reports (its own jobs' results).
        """
        reports = list(reports)
        outcome = self._reports.on_worker_reports(reports)
        self.extension.on_worker_reports(reports)
        self._count_down_reset_fence()
        return outcome

    def fail_jobs(self, job_ids: Iterable[int]) -> ReportOutcome:
        """Fail copy jobs outright (e.g. a worker died before reporting them): pins released, data never ready."""
        outcome = self._reports.fail_jobs(job_ids)
        self._count_down_reset_fence()
        return outcome

    def fail_in_flight(self) -> ReportOutcome:
        """A worker died: fail every copy job in flight and every job of the extension's."""
        outcome = self._reports.fail_jobs(self.in_flight_job_ids())
        self.extension.fail_in_flight()
        self._count_down_reset_fence()
        return outcome

    def in_flight_job_ids(self) -> list[int]:
        """Ids of copy jobs not yet reported by every worker."""
        return sorted(self._book.jobs)

    def _store_completed(self, keys: list[OffloadKey]) -> None:
        self.extension.on_store_completed(keys)

    # ------------------------------------------------------------------------------------- stats, events

    def stats(self) -> SchedulerStats:
        """Counters since construction plus the manager's current cache usage (a copy; no side effect)."""
        return self._book.stats.snapshot(cache_usage=self.manager.usage, jobs_in_flight=len(self._book.jobs))

    def take_events(self) -> list[KVEvent]:
        """KV cache events since the last call, as schema types (vLLM's placeholder payloads).

        A stored chunk is announced by its last hash-block; failed stores that were never announced
        (metadata-only removals) publish nothing. Removals are grouped per group id. The extension's events
        (tier records, medium ``STORAGE``) follow the host pool's.
        """
        events: list[KVEvent] = []
        pool_events = self.manager.take_events()
        pool_events.extend(self.extension.take_events())
        for event in pool_events:
            if event.metadata_only:
                continue
            medium = event.medium
            by_group: dict[int, list[BlockHash]] = {}
            for key in event.keys:
                by_group.setdefault(offload_key_group(key), []).append(offload_key_hash(key))
            for group_idx, hashes in by_group.items():
                if event.removed:
                    events.append(BlockRemoved(block_hashes=tuple(hashes), group_idx=group_idx, medium=medium))
                else:
                    events.extend(BlockStored(block_hashes=(h,), group_idx=group_idx, medium=medium) for h in hashes)
        return events
