"""The demo's simulated engine on the scheduler side: admission, step plans, decoding, and what it measured.

:class:`DemoEngine` plays vLLM's scheduler around the offload scheduler: it admits requests while its small
block pool lasts (asking the offload scheduler how many prompt tokens the host pool holds), sends each step's
plan to the workers with the blocks to fill (computed this step) and to verify (loaded this step), and decodes
a few tokens per request. The workers' hook (:mod:`kvoffload.demo.worker_hook`) does the filling and checking.

A failed load is handled as vLLM handles a failed asynchronous load with ``kv_load_failure_policy="recompute"``:
the request's blocks are freed, it goes back to the head of the waiting queue, and it is looked up and allocated
anew (under a fresh scheduler id). The loaded blocks are checked at the engine's own block ids, so a load or store
that still used the ids a request held before its restart is caught as mismatched blocks.
"""

from __future__ import annotations

import random
from collections import deque
from typing import TYPE_CHECKING

from kvoffload._generated import EngineSnapshot, OffloadingConfig, StepPlan
from kvoffload._packed import Int32Array
from kvoffload.assembly import build_scheduler
from kvoffload.demo.report import DemoResult
from kvoffload.demo.sim_engine import block_seed
from kvoffload.demo.worker_hook import step_attachments, step_stats
from kvoffload.demo.workload import BlockPool, DemoOptions, Request, Workload
from kvoffload.errors import ConfigError
from kvoffload.offload.keys import hash_token_blocks
from kvoffload.runtime.cluster import WorkerCluster
from kvoffload.translate import translate_snapshot

if TYPE_CHECKING:
    from kvoffload._events import KVEventPublisher
    from kvoffload.metrics import SchedulerMetrics

__all__ = ["DemoEngine"]


class DemoEngine:
    """The scheduler side of the simulated engine (module docstring); ``step`` runs one engine step."""

    def __init__(
        self,
        snapshot: EngineSnapshot,
        options: DemoOptions,
        metrics: SchedulerMetrics | None = None,
        events: KVEventPublisher | None = None,
    ) -> None:
        self.options = options
        self.metrics = metrics
        self.events = events
        self.config: OffloadingConfig = translate_snapshot(snapshot)
        # The demo's workers wait for each step's promotions, so a tier hit loads in the step it is promoted
        # (not with a shared pool across ranks: its writer promotes the rows the other ranks load).
        chain = not options.shared_pool or self.config.parallel.world_size == 1
        self.sched = build_scheduler(
            self.config,
            tiering=options.tiering,
            enable_events=events is not None,
            chain_promotions=chain,
            kv_cache_config=snapshot.kv_cache_config,  # EAGLE and align-mode Mamba groups, retention interval
        )
        self.manager = self.sched.manager
        self.num_chunks = self.manager.num_chunks
        self.groups = self.config.groups
        self.tph = self.config.cache.tokens_per_hash
        self.num_blocks = snapshot.kv_cache_config.num_blocks
        self.pool = BlockPool(self.num_blocks)
        self.workload = Workload(options, self.tph)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.result = DemoResult(host_chunks=self.num_chunks)
        self.any_dead = False
        self.registered: set[str] = set()

    def seed_of(self, req: Request, group: int, block: int) -> int:
        per_block = self.groups[group].tokens_per_block // self.tph
        return block_seed(req.hashes[(block + 1) * per_block - 1])

    def admit(self) -> list[tuple[Request, int, int]]:
        """Continue running prompts, then admit waiting requests while blocks and this step's token budget last;
        returns the (request, first, last) tokens to compute (a prompt longer than the budget takes steps)."""
        while (req := self.workload.next_request()) is not None:
            self.waiting.append(req)
        computes: list[tuple[Request, int, int]] = []
        decoding = sum(r.num_computed >= r.prompt_len for r in self.running.values())
        budget = self.options.max_batched_tokens - decoding
        for req in self.running.values():
            if req.num_computed < req.prompt_len and budget > 0:
                last = min(req.prompt_len, req.num_computed + budget)
                computes.append((req, req.num_computed, last))
                budget -= last - req.num_computed
        skipped: list[Request] = []
        while self.waiting and len(self.running) < self.options.max_running and budget > 0:
            req = self.waiting[0]
            if req.sid not in self.registered:
                self.sched.add_request(req.sid, req.hashes, req.prompt_len)
                self.registered.add(req.sid)
            hit = self.sched.lookup(req.sid, 0)
            if hit is None:  # as vLLM: the request waits (tier query, promotion) and the next one is tried
                self.result.deferred_lookups += 1
                skipped.append(self.waiting.popleft())
                continue
            total = req.prompt_len + req.decode_left
            need = [-(-total // g.tokens_per_block) for g in self.groups]
            if sum(need) > self.num_blocks:
                raise ConfigError(
                    f"request {req.req_id} needs {sum(need)} engine blocks ({total} tokens) but the engine block "
                    f"pool has num_blocks={self.num_blocks}: it can never run (use fewer --requests per "
                    "conversation, more --conversations, or a snapshot with more num_blocks)"
                )
            blocks = self.pool.allocate(sum(need))
            if blocks is None:
                self.sched.on_blocks_allocated(req.sid, [[] for _ in self.groups])  # release the pins
                break
            self.waiting.popleft()
            split, at = [], 0
            for n in need:
                split.append(blocks[at : at + n])
                at += n
            req.blocks = split
            req.loaded = hit
            self.sched.on_blocks_allocated(req.sid, split, num_external_tokens=hit)
            self.running[req.sid] = req
            if not req.attempt:
                self.result.requests += 1
                self.result.prompt_tokens += req.prompt_len
            self.result.requests_with_hit += hit > 0
            self.result.tokens_loaded += hit
            req.num_computed = hit
            last = min(req.prompt_len, hit + budget)
            computes.append((req, hit, last))
            budget -= last - hit
        self.waiting.extendleft(reversed(skipped))
        return computes

    def fill_entries(self, computes: list[tuple[Request, int, int]]) -> list[int]:
        flat: list[int] = []
        for req, first, last in computes:
            for g, group in enumerate(self.groups):
                tpb = group.tokens_per_block
                for block in range(first // tpb, last // tpb):
                    flat += (g, req.blocks[g][block], self.seed_of(req, g, block))
        return flat

    def verify_entries(self, plan: StepPlan) -> list[int]:
        """``(job, group, block, seed)`` for every block a load job fills, at the block id the engine holds for
        that position (not the job's), so a load into blocks the request no longer holds is caught."""
        flat: list[int] = []
        for job in plan.load_jobs:
            req = self.running[job.req_id]
            sizes = Int32Array.from_buffer(job.group_sizes).tolist()
            starts = Int32Array.from_buffer(job.block_indices).tolist()
            for g, (size, start) in enumerate(zip(sizes, starts, strict=True)):
                for i in range(start, start + size):
                    flat += (job.job_id, g, req.blocks[g][i], self.seed_of(req, g, i))
        return flat

    def step(self, cluster: WorkerCluster) -> None:
        computes = self.admit()
        plan = self.sched.build_step_plan()
        fill = self.fill_entries(computes)
        verify = self.verify_entries(plan)
        outcome = cluster.step(plan, step_attachments(fill, verify))
        self.result.steps += 1
        report = self.sched.on_worker_reports(outcome.reports)
        for extras in outcome.attachments.values():
            checked, bad = step_stats(extras)
            self.result.blocks_verified += checked
            self.result.mismatched_blocks.extend(bad)
        if outcome.newly_dead:
            self.result.dead_workers.extend(outcome.newly_dead)
            self.result.worker_errors.update(outcome.errors)
            self.any_dead = True
        if self.any_dead:
            # A dead rank never reports its jobs: copies and tier jobs fail, promotions are never ready.
            report_failed = self.sched.fail_in_flight()
            self.result.failed_jobs += len(report_failed.failed_loads) + len(report_failed.failed_stores)
        self.result.failed_jobs += len(report.failed_loads) + len(report.failed_stores)
        self.result.tier_missed_loads += len(report.tier_missed_loads)
        # A failed load, or one that missed on a tier: the engine frees the request's blocks and admits it again.
        restarted = [req for sid in report.recompute if (req := self.running.get(sid)) is not None]
        for req in restarted:
            self._restart(req)
        for req, first, last in computes:
            self.result.tokens_recomputed += last - first
            if any(req is r for r in restarted):
                continue  # computed on top of a failed load: thrown away, computed again after its new admission
            req.num_computed = last
            self.sched.on_tokens_computed(req.sid, last)
        for req in list(self.running.values()):
            if req.num_computed < req.prompt_len or any(req is c[0] for c in computes):
                continue
            self._decode(req)
        self.observe()

    def _restart(self, req: Request) -> None:
        """vLLM's handling of a failed asynchronous load that left no valid block before the first invalid one:
        the request's blocks are freed and it waits again at the head of the queue, under a fresh scheduler id."""
        self.result.load_restarts += 1
        self.result.tokens_loaded -= req.loaded
        self.result.requests_with_hit -= req.loaded > 0
        self.sched.abort_request(req.sid)
        del self.running[req.sid]
        self.pool.release([b for blocks in req.blocks for b in blocks])
        req.blocks, req.loaded, req.num_computed = [], 0, 0
        req.attempt += 1
        self.waiting.appendleft(req)

    def observe(self, *, final: bool = False) -> None:
        """Publish this step's KV events and bring the metrics up to date (rate-limited unless ``final``)."""
        if self.events is not None:
            self.events.publish(self.sched.take_events())
        if self.metrics is not None:
            if self.events is not None:
                self.metrics.record_event_batches(self.events.sent, self.events.dropped)
            self.metrics.observe(self.sched, force=final)

    def _decode(self, req: Request) -> None:
        req.tokens.append(random.Random(f"{req.req_id}:{len(req.tokens)}").randrange(1, 32000))
        req.decode_left -= 1
        new_hashes = hash_token_blocks(
            req.tokens[len(req.hashes) * self.tph :],
            self.tph,
            parent=req.hashes[-1] if req.hashes else None,
        )
        req.hashes.extend(new_hashes)
        self.sched.extend_request(req.sid, new_hashes, len(req.tokens))
        self.sched.on_tokens_computed(req.sid, len(req.tokens))
        if req.decode_left == 0:
            self.sched.finish_request(req.sid)
            del self.running[req.sid]
            self.pool.release([b for blocks in req.blocks for b in blocks])
            self.workload.finished(req)

    @property
    def done(self) -> bool:
        return (
            self.workload.issued >= self.options.requests
            and not self.waiting
            and not self.running
            and not self.sched.has_pending_work()
        )
