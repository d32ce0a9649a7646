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
written or loaded; only prompt tokens are stored by default (``offload_prompt_only``); a job completes when
every one of ``world_size`` workers has reported it; a failed job never marks data ready and releases its
pins. One deliberate difference: chunks found by ``lookup`` are pinned right away (vLLM pins when blocks are
allocated), so a store planned between lookup and allocation can never evict them.

Integrity: every job carries the key tag of each chunk (``TransferJob.chunk_tags``); a load that a worker
reports with ``corrupt_chunk_ids`` fails (the request recomputes) and those chunks are dropped from the
manager, so they are never served again (``SchedulerStats.corrupt_loads`` / ``corrupted_chunks``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload._generated import BlockRemoved, BlockStored, KVEvent
from kvoffload._ints import check_int, check_optional_int
from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.keys import BlockHash, offload_key_group, offload_key_hash
from kvoffload.offload.scheduler._lookups import SchedulerLookup
from kvoffload.offload.scheduler._reports import SchedulerReports
from kvoffload.offload.scheduler._results import SchedulerStats
from kvoffload.offload.scheduler._state import RequestState
from kvoffload.offload.scheduler._transfers import SchedulerTransfers

__all__ = ["OffloadScheduler"]


class OffloadScheduler(SchedulerLookup, SchedulerTransfers, SchedulerReports):
    """Decides, per request, which chunks to load from and store into the host pool (vLLM 0.33 semantics).

    ``offload_prompt_only`` defaults to ``extra_config["offload_prompt_only"]`` (True when absent, as in
    vLLM): decode-phase KV is not offloaded unless it is turned off. ``null_block_id`` names the engine's
    placeholder block (vLLM uses 0 for blocks a sliding window dropped): chunks holding it are never stored.
    """

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
    ) -> None:
        """Register a request: its block hashes (at ``tokens_per_hash`` granularity) and its token count.

        ``prompt_len`` defaults to ``num_tokens``; ``max_load_tokens`` / ``max_offload_tokens`` cap what is
        loaded from / stored to the host for this request (vLLM's per-request ``kv_transfer_params``).
        """
        if req_id in self._requests:
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
            keys=[[] for _ in self._groups],
            block_ids=[[] for _ in self._groups],
            next_stored=[0 for _ in self._groups],
        )
        self._requests[req_id] = req
        self._update_keys(req)

    def extend_request(self, req_id: str, new_block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Append block hashes and raise the token count as a request decodes."""
        req = self._request(req_id)
        if num_tokens < req.num_tokens:
            raise ConfigError(f"num_tokens of {req_id!r} cannot shrink ({req.num_tokens} -> {num_tokens})")
        req.block_hashes.extend(new_block_hashes)
        req.num_tokens = num_tokens
        self._update_keys(req)

    def on_tokens_computed(self, req_id: str, num_computed_tokens: int) -> None:
        """Advance a request's computed tokens; newly complete chunks are stored by the next step plan."""
        req = self._request(req_id)
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
        req = self._request(req_id)
        self._release_pins(req)
        req.finished = True
        # vLLM's order: every key the request loaded, stored or reused, by end-token position then group id;
        # the policy refreshes them so that the request's first chunk (a shared prefix) ends most recent.
        keys = sorted(req.accessed, key=req.accessed.__getitem__)
        self.manager.on_request_finished(keys, req.reused_keys, request_id=req_id)
        if not req.jobs:
            self._drop(req)

    def abort_request(self, req_id: str) -> None:
        """Abort a request mid-flight: pins released, in-flight stores flushed by the next step plan.

        In-flight loads still complete on the workers (copies cannot be recalled); their results only
        release the chunks.
        """
        req = self._request(req_id)
        for job_id in req.jobs:
            if self._jobs[job_id].is_store:
                self._flush.add(job_id)
        # A load not yet handed to the workers is dropped here: nothing will ever report it.
        unsent = {j.job_id for j in self._pending_loads if j.req_id == req_id}
        self._pending_loads = [j for j in self._pending_loads if j.req_id != req_id]
        for job_id in unsent:
            self._release_load(self._jobs.pop(job_id))
            req.jobs.discard(job_id)
        self.finish_request(req_id)

    def reset(self) -> None:
        """Drop every stored chunk (vLLM ``reset_cache``): in-flight jobs are flushed and become stale."""
        for req in self._requests.values():
            self._release_pins(req)
            req.next_stored = [0 for _ in self._groups]
        for job in self._jobs.values():
            job.stale = True
            self._flush.add(job.job_id)
        self.manager.reset()

    def has_pending_work(self) -> bool:
        """Whether jobs are in flight or queued."""
        return bool(self._jobs or self._pending_loads)

    # ------------------------------------------------------------------------------------- stats, events

    def stats(self) -> SchedulerStats:
        """Counters since construction plus the manager's current cache usage."""
        c = self._counters
        return SchedulerStats(
            lookups=c["lookups"],
            lookup_hits=c["lookup_hits"],
            lookup_misses=c["lookup_misses"],
            lookups_deferred=c["lookups_deferred"],
            tokens_loaded=c["tokens_loaded"],
            tokens_stored=c["tokens_stored"],
            allocation_failures=c["allocation_failures"],
            load_jobs=c["load_jobs"],
            store_jobs=c["store_jobs"],
            failed_jobs=c["failed_jobs"],
            bytes_loaded=c["bytes_loaded"],
            bytes_stored=c["bytes_stored"],
            load_seconds=self._seconds["load"],
            store_seconds=self._seconds["store"],
            cache_usage=self.manager.stats().usage,
            jobs_in_flight=len(self._jobs),
            corrupt_loads=c["corrupt_loads"],
            corrupted_chunks=c["corrupted_chunks"],
            lookup_miss_reasons=dict(self._lookup_misses),
            chunk_miss_reasons=dict(self._chunk_misses),
            chunks_removed=dict(self._removed),
            failed_loads=self._failed["load"],
            failed_stores=self._failed["store"],
        )

    def take_events(self) -> list[KVEvent]:
        """KV cache events since the last call, as schema types (vLLM's placeholder payloads).

        A stored chunk is announced by its last hash-block; failed stores that were never announced
        (metadata-only removals) publish nothing. Removals are grouped per group id.
        """
        events: list[KVEvent] = []
        for event in self.manager.take_events():
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
