"""The offload scheduler's transfer planning: a load job once a hit's blocks are allocated, store jobs for
newly complete chunks, and the StepPlan that carries both to the workers."""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload._generated import StepPlan, TierJob, TransferJob
from kvoffload._packed import pack_int32, pack_int64
from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload._direction import Direction
from kvoffload.offload.keys import OffloadKey, key_tags
from kvoffload.offload.scheduler._state import JobState, RequestState, SchedulerBook

__all__ = ["Transfers"]


class Transfers:
    """The transfer-planning part of the offload scheduler: load jobs on allocation, store jobs per step.

    Owns what only planning needs: the loads queued for the next plan, the jobs to flush, the engine blocks
    fenced by in-flight stores, and the step counter.
    """

    def __init__(self, book: SchedulerBook, *, offload_prompt_only: bool, null_block_id: int | None) -> None:
        self._book = book
        self._stats = book.stats
        self._manager = book.manager
        self.offload_prompt_only = offload_prompt_only
        self.null_block_id = null_block_id
        self._step = 0
        self._pending_loads: list[TransferJob] = []
        self._flush: set[int] = set()
        self._fenced: dict[int, int] = {}  # engine block id -> in-flight store job id

    def flush(self, job_id: int) -> None:
        """Have the workers flush job ``job_id`` (a store whose blocks are needed, or a stale job) next step."""
        self._flush.add(job_id)

    def unfence(self, job: JobState) -> None:
        """A store completed: its engine blocks may be reused without a flush."""
        for block in job.blocks:
            if self._fenced.get(block) == job.job_id:
                del self._fenced[block]

    def withdraw_loads(self, req: RequestState) -> None:
        """Drop the request's loads not yet handed to the workers: nothing will ever report them."""
        unsent = {j.job_id for j in self._pending_loads if j.req_id == req.req_id}
        self._pending_loads = [j for j in self._pending_loads if j.req_id != req.req_id]
        for job_id in unsent:
            self._book.release_load(self._book.jobs.pop(job_id))
            req.jobs.discard(job_id)

    def has_queued_loads(self) -> bool:
        return bool(self._pending_loads)

    def on_blocks_allocated(
        self, req_id: str, new_block_ids: Sequence[Sequence[int]], *, num_external_tokens: int = 0
    ) -> None:
        """Record newly allocated engine blocks and queue the load of the last lookup's hit, if any."""
        req = self._book.request(req_id)
        if len(new_block_ids) != len(self._book.groups):
            raise ConfigError(
                f"new_block_ids has {len(new_block_ids)} lists but the config offloads {len(self._book.groups)} groups"
            )
        for g, ids in zip(self._book.groups, new_block_ids, strict=True):
            for block in ids:
                job_id = self._fenced.get(block)
                if job_id is not None:
                    self._flush.add(job_id)
            req.block_ids[g.index].extend(ids)
        if num_external_tokens:
            self._queue_load(req, num_external_tokens)
        else:
            self._book.release_pins(req)
            req.sync_load = False

    def _queue_load(self, req: RequestState, num_external_tokens: int) -> None:
        start = req.hit_start
        end = start + num_external_tokens
        if not req.pinned or end > req.hit_end or num_external_tokens < 0:
            raise InvalidStateError(
                f"request {req.req_id!r}: num_external_tokens={num_external_tokens} exceeds the last lookup "
                f"hit ({req.hit_end - req.hit_start} tokens)"
            )
        group_sizes: list[int] = []
        block_indices: list[int] = []
        blocks: list[int] = []
        keys: list[OffloadKey] = []
        own = req.accessed.keys() - req.reused_keys  # chunks this request stored itself
        for g in self._book.groups:
            if end % g.tokens_per_chunk and end != req.hit_end:
                raise InvalidStateError(
                    f"request {req.req_id!r}: num_external_tokens={num_external_tokens} is not chunk-aligned "
                    f"({g.tokens_per_chunk} tokens per chunk in group {g.group_id})"
                )
            first, last = self._book.load_range(g, start, end)
            ids = req.block_ids[g.index]
            if last > len(ids):
                raise InvalidStateError(
                    f"request {req.req_id!r}: group {g.group_id} has {len(ids)} blocks allocated, the load needs {last}"
                )
            group_sizes.append(max(0, last - first))
            block_indices.append(first)
            blocks.extend(ids[first:last])
            group_keys = self._book.chunk_keys_of_blocks(req, g, first, last)
            keys.extend(group_keys)
            bpc = self._book.blocks_per_chunk
            for chunk, key in enumerate(group_keys, start=first // bpc):
                req.accessed[key] = ((chunk + 1) * g.tokens_per_chunk, g.group_id)
        used = set(keys)
        unused = [k for k in req.pinned if k not in used]
        if unused:
            self._manager.complete_load(unused)
        req.pinned = []
        chunk_ids = [self._manager.chunk_id(k) for k in keys]
        job = self._book.new_job(req, Direction.LOAD, keys=keys, num_tokens=num_external_tokens, blocks=())
        job.chunk_keys = {c: k for c, k in zip(chunk_ids, keys, strict=True) if c is not None}
        # Shared loads: chunks that other requests' loads are reading are read again by this job, into this
        # request's own blocks, right away (in plan order, after those loads on the workers' load lane). The
        # host copies are ready and pinned by every load that reads them, so each load gets the same bytes and
        # none waits for another (the engine cannot hand one request's blocks to another before they land).
        loading = self._book.loading
        if any(key in loading for key in keys):
            self._stats.shared_loads += 1
        for key in keys:
            loading[key] = loading.get(key, 0) + 1
        sync = req.sync_load
        req.sync_load = False
        if sync:
            self._stats.sync_loads += 1
        req.reused_keys.update(k for k in keys if k not in own)  # vLLM: re-reading its own chunk is no reuse
        self._pending_loads.append(
            TransferJob(
                job_id=job.job_id,
                req_id=req.req_id,
                group_sizes=pack_int32(group_sizes),
                block_indices=pack_int32(block_indices),
                block_ids=pack_int64(blocks),
                chunk_ids=pack_int64([c if c is not None else -1 for c in chunk_ids]),
                sync=sync,
                chunk_tags=pack_int64(key_tags(keys)),
            )
        )
        # Loaded chunks are already on the host: do not store them again (vLLM's CHUNK_LEVEL policy).
        for g in self._book.groups:
            req.next_stored[g.index] = max(req.next_stored[g.index], end // g.tokens_per_chunk)

    # ------------------------------------------------------------------------------------------ step plan

    def build_step_plan(self, tier_jobs: tuple[TierJob, ...] = ()) -> StepPlan:
        """The StepPlan for this step: queued loads, stores of newly complete chunks, flushes and ``tier_jobs``."""
        store_jobs = [job for req in list(self._book.requests.values()) if (job := self._plan_store(req))]
        plan = StepPlan(
            step=self._step,
            load_jobs=tuple(self._pending_loads),
            store_jobs=tuple(store_jobs),
            flush=pack_int64(sorted(self._flush)),
            tier_jobs=tier_jobs,
        )
        self._step += 1
        self._pending_loads = []
        self._flush = set()
        return plan

    def _offloadable_tokens(self, req: RequestState) -> int:
        tokens = min(req.num_computed, req.num_tokens)
        if req.max_offload_tokens is not None:
            tokens = min(tokens, req.max_offload_tokens)
        if self.offload_prompt_only:
            tokens = min(tokens, req.prompt_len)
        return tokens

    def _plan_store(self, req: RequestState) -> TransferJob | None:
        if req.finished:
            return None
        bpc = self._book.blocks_per_chunk
        tokens = self._offloadable_tokens(req)
        null = self.null_block_id
        ranges: list[tuple[int, int]] = []
        offered: list[OffloadKey] = []
        positions: dict[OffloadKey, tuple[int, int]] = {}
        # vLLM 0.33's storable chunks (§5.4): while an unfinished request decodes, an EAGLE group's last offloadable
        # chunk is volatile (a rejected draft rewrites it) and waits for the next one. (vLLM lifts the rule once
        # the request finished; kvoffload plans no stores for a finished request, see above.)
        decoding = tokens > req.prompt_len
        for g in self._book.groups:
            ids = req.block_ids[g.index]
            complete = tokens // g.tokens_per_chunk
            if g.eagle and decoding:
                complete = max(0, complete - 1)
            end = min(complete, len(ids) // bpc, len(req.keys[g.index]))
            start = req.next_stored[g.index]
            ranges.append((start, end))
            for chunk in range(start, end):
                if null is None or null not in ids[chunk * bpc : (chunk + 1) * bpc]:
                    key = req.keys[g.index][chunk]
                    offered.append(key)
                    positions[key] = ((chunk + 1) * g.tokens_per_chunk, g.group_id)
        if not offered:
            for g, (start, end) in zip(self._book.groups, ranges, strict=True):
                req.next_stored[g.index] = max(start, end)
            return None
        # As vLLM's manager, the request's accesses are the offered keys already stored (reused) and the
        # keys it stores; the order the policy sees at finish comes from their positions.
        ready = self._manager.ready_keys(offered)
        req.reused_keys.update(ready)
        for key in ready:
            req.accessed[key] = positions[key]
        plan = self._manager.prepare_store(offered, request_id=req.req_id)
        if plan is None:
            self._stats.allocation_failures += 1
            return None  # no progress: retried next step, as vLLM does
        for g, (start, end) in zip(self._book.groups, ranges, strict=True):
            req.next_stored[g.index] = max(start, end)
        accepted = set(plan.keys_to_store)
        for key in plan.keys_to_store:
            req.accessed[key] = positions[key]
        if not accepted:
            return None
        group_sizes: list[int] = []
        block_indices: list[int] = []
        blocks: list[int] = []
        keys: list[OffloadKey] = []
        num_tokens = 0
        for g, (start, end) in zip(self._book.groups, ranges, strict=True):
            first_block: int | None = None
            size = 0
            for chunk in range(start, end):
                key = req.keys[g.index][chunk]
                if key not in accepted:
                    continue
                if first_block is None:
                    first_block = chunk * bpc
                blocks.extend(req.block_ids[g.index][chunk * bpc : (chunk + 1) * bpc])
                keys.append(key)
                size += bpc
            group_sizes.append(size)
            block_indices.append(first_block or 0)
            num_tokens = max(num_tokens, size // bpc * g.tokens_per_chunk)
        chunk_of = dict(zip(plan.keys_to_store, plan.chunk_ids, strict=True))
        job = self._book.new_job(req, Direction.STORE, keys=keys, num_tokens=num_tokens, blocks=tuple(blocks))
        for block in blocks:
            self._fenced[block] = job.job_id
        return TransferJob(
            job_id=job.job_id,
            req_id=req.req_id,
            group_sizes=pack_int32(group_sizes),
            block_indices=pack_int32(block_indices),
            block_ids=pack_int64(blocks),
            chunk_ids=pack_int64([chunk_of[k] for k in keys]),
            chunk_tags=pack_int64(key_tags(keys)),
        )
