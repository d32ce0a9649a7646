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

Semantics follow vLLM 0.33's offloading connector scheduler (reference §5.3-5.5): chunk keys are the hash of
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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .._generated import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    MissReason,
    OffloadingConfig,
    StepPlan,
    TransferJob,
    WorkerReport,
)
from ..errors import ConfigError, InvalidStateError
from ..packed import Int64Array, pack_int32, pack_int64
from .integrity import key_tags
from .keys import chunk_keys, hashes_per_chunk, offload_key_group, offload_key_hash
from .lookup import maximal_prefix_lookup, sliding_window_lookup
from .manager import HostBlockManager
from .misses import ChunkMiss, GroupKeys, explain_lookup, primary_reason

__all__ = ["OffloadScheduler", "ReportOutcome", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class _Group:
    """Chunk geometry of one offloaded group."""

    index: int
    group_id: int
    tokens_per_block: int
    tokens_per_chunk: int
    hashes_per_chunk: int
    window_chunks: int | None  # None: full attention (a prefix is needed), else chunks of the window


@dataclass(slots=True)
class _Job:
    job_id: int
    req_id: str
    is_store: bool
    keys: list[bytes]
    pending: int
    num_tokens: int
    blocks: tuple[int, ...]
    failed: bool = False
    stale: bool = False
    reported: set[int] = field(default_factory=set)
    chunk_keys: dict[int, bytes] = field(default_factory=dict)  # loads: chunk id -> key (integrity)
    corrupt: bool = False


@dataclass(slots=True)
class _Request:
    req_id: str
    block_hashes: list[bytes]
    num_tokens: int
    prompt_len: int
    max_load_tokens: int | None
    max_offload_tokens: int | None
    keys: list[list[bytes]]
    block_ids: list[list[int]]
    next_stored: list[int]
    num_computed: int = 0
    jobs: set[int] = field(default_factory=set)
    pinned: list[bytes] = field(default_factory=list)
    hit_start: int = 0
    hit_end: int = 0
    finished: bool = False
    reused_keys: set[bytes] = field(default_factory=set)
    # keys the request loaded, stored or found stored when offering -> (end-token position, group id)
    accessed: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    misses: tuple[ChunkMiss, ...] = ()


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    """What worker reports completed: requests whose loads finished (ready to run) or failed (recompute)."""

    finished_loads: tuple[str, ...]
    failed_loads: tuple[str, ...]
    failed_stores: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Totals since construction (cache usage is the manager's current gauge)."""

    lookups: int
    lookup_hits: int
    lookup_misses: int
    lookups_deferred: int
    tokens_loaded: int
    tokens_stored: int
    allocation_failures: int
    load_jobs: int
    store_jobs: int
    failed_jobs: int
    bytes_loaded: int
    bytes_stored: int
    load_seconds: float
    store_seconds: float
    cache_usage: float
    jobs_in_flight: int
    corrupt_loads: int = 0
    """Load jobs failed because a worker found a host chunk corrupt (integrity); the request recomputes."""
    corrupted_chunks: int = 0
    """Keys dropped from the manager because their host chunk did not verify."""
    # -- observability (issue 13)
    lookup_miss_reasons: Mapping[MissReason, int] = field(default_factory=dict)
    """Lookups that loaded nothing (or were deferred by a pending store), by the reason of their first miss."""
    chunk_miss_reasons: Mapping[MissReason, int] = field(default_factory=dict)
    """Wanted chunks that lookups did not load, by reason (a chunk counts once per lookup)."""
    chunks_removed: Mapping[MissReason, int] = field(default_factory=dict)
    """Chunks dropped as corrupt by load reports (integrity) or through :meth:`OffloadScheduler.forget_chunk`."""
    failed_loads: int = 0
    failed_stores: int = 0


def _opt_limit(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative int or None, got {value!r}")
    return value


class OffloadScheduler:
    """Decides, per request, which chunks to load from and store into the host pool (vLLM 0.33 semantics).

    ``offload_prompt_only`` defaults to ``extra_config["offload_prompt_only"]`` (True when absent, as in
    vLLM): decode-phase KV is not offloaded unless it is turned off. ``null_block_id`` names the engine's
    placeholder block (vLLM uses 0 for blocks a sliding window dropped): chunks holding it are never stored.
    """

    def __init__(
        self,
        config: OffloadingConfig,
        manager: HostBlockManager,
        *,
        offload_prompt_only: bool | None = None,
        null_block_id: int | None = None,
    ) -> None:
        if not config.groups:
            raise ConfigError("OffloadingConfig.groups is empty: nothing to offload")
        self.config = config
        self.manager = manager
        bpc = config.cache.blocks_per_chunk
        tph = config.cache.tokens_per_hash
        groups = [
            _Group(
                index=i,
                group_id=g.group_id,
                tokens_per_block=g.tokens_per_block,
                tokens_per_chunk=g.tokens_per_block * bpc,
                hashes_per_chunk=hashes_per_chunk(g.tokens_per_block, bpc, tph),
                window_chunks=g.sliding_window_size_in_chunks,
            )
            for i, g in enumerate(config.groups)
        ]
        self._groups = tuple(groups)
        # vLLM visits full attention first, then sliding windows from the largest window down.
        self._lookup_order = tuple(sorted(groups, key=lambda g: (g.window_chunks is not None, -(g.window_chunks or 0))))
        self._window_groups = tuple(g for g in self._lookup_order if g.window_chunks is not None)
        if offload_prompt_only is None:
            offload_prompt_only = bool(config.extra_config.get("offload_prompt_only", True))
        self.offload_prompt_only = offload_prompt_only
        self.null_block_id = null_block_id
        self.world_size = config.parallel.world_size
        self._requests: dict[str, _Request] = {}
        self._jobs: dict[int, _Job] = {}
        self._next_job_id = 0
        self._step = 0
        self._pending_loads: list[TransferJob] = []
        self._flush: set[int] = set()
        self._fenced: dict[int, int] = {}  # engine block id -> in-flight store job id
        self._loading: dict[bytes, int] = {}  # key -> loads in flight that read it
        self._counters = dict.fromkeys(
            (
                "lookups",
                "lookup_hits",
                "lookup_misses",
                "lookups_deferred",
                "tokens_loaded",
                "tokens_stored",
                "allocation_failures",
                "load_jobs",
                "store_jobs",
                "failed_jobs",
                "bytes_loaded",
                "bytes_stored",
                "corrupt_loads",
                "corrupted_chunks",
            ),
            0,
        )
        self._seconds = {"load": 0.0, "store": 0.0}
        self._lookup_misses: dict[MissReason, int] = {}
        self._chunk_misses: dict[MissReason, int] = {}
        self._removed: dict[MissReason, int] = {}
        self._failed = {"load": 0, "store": 0}

    # ------------------------------------------------------------------------------------------ requests

    def add_request(
        self,
        req_id: str,
        block_hashes: Sequence[bytes],
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
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ConfigError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        prompt = num_tokens if prompt_len is None else prompt_len
        if isinstance(prompt, bool) or not isinstance(prompt, int) or not 0 <= prompt <= num_tokens:
            raise ConfigError(f"prompt_len must be an int in [0, num_tokens={num_tokens}], got {prompt!r}")
        req = _Request(
            req_id=req_id,
            block_hashes=list(block_hashes),
            num_tokens=num_tokens,
            prompt_len=prompt,
            max_load_tokens=_opt_limit("max_load_tokens", max_load_tokens),
            max_offload_tokens=_opt_limit("max_offload_tokens", max_offload_tokens),
            keys=[[] for _ in self._groups],
            block_ids=[[] for _ in self._groups],
            next_stored=[0 for _ in self._groups],
        )
        self._requests[req_id] = req
        self._update_keys(req)

    def extend_request(self, req_id: str, new_block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """Append block hashes and raise the token count as a request decodes."""
        req = self._request(req_id)
        if num_tokens < req.num_tokens:
            raise ConfigError(f"num_tokens of {req_id!r} cannot shrink ({req.num_tokens} -> {num_tokens})")
        req.block_hashes.extend(new_block_hashes)
        req.num_tokens = num_tokens
        self._update_keys(req)

    def _request(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise InvalidStateError(f"unknown request {req_id!r}")
        return req

    def _update_keys(self, req: _Request) -> None:
        for g in self._groups:
            keys = req.keys[g.index]
            keys.extend(chunk_keys(req.block_hashes, g.group_id, g.hashes_per_chunk, start_chunk=len(keys)))

    # -------------------------------------------------------------------------------------------- lookup

    def lookup(self, req_id: str, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from the host, or None to ask again later.

        The hit is chunk-aligned, leaves at least the last token to compute, and its chunks are pinned
        until ``on_blocks_allocated`` turns them into a load job (or the next lookup/abort releases them).
        ``None`` means a needed chunk is still being written or loaded, or the request has a job in flight.
        """
        req = self._request(req_id)
        self._counters["lookups"] += 1
        self._release_pins(req)
        req.misses = ()
        if req.jobs:
            self._counters["lookups_deferred"] += 1
            return None
        max_hit = req.num_tokens - 1
        if req.max_load_tokens is not None:
            max_hit = min(max_hit, num_computed_tokens + req.max_load_tokens)
        hit = self._lookup_groups(req, num_computed_tokens, max_hit)
        if hit is None:
            self._counters["lookups_deferred"] += 1
            self._explain(req, num_computed_tokens, num_computed_tokens, pending_only=True)
            return None
        if hit <= 0:
            self._counters["lookup_misses"] += 1
            self._explain(req, num_computed_tokens, num_computed_tokens)
            return 0
        max_hit = num_computed_tokens + hit
        keys = self._hit_keys(req, num_computed_tokens, max_hit)
        if any(k in self._loading for k in keys):
            # Another request is loading these chunks into engine blocks; the engine's prefix cache will
            # serve them once it finishes (vLLM waits for the same reason).
            self._counters["lookups_deferred"] += 1
            return None
        self.manager.prepare_load(keys)
        self.manager.touch(keys)
        req.pinned = keys
        req.hit_start, req.hit_end = num_computed_tokens, max_hit
        self._counters["lookup_hits"] += 1
        self._explain(req, num_computed_tokens, max_hit)
        return max_hit - num_computed_tokens

    def _explain(self, req: _Request, num_computed: int, hit_end: int, *, pending_only: bool = False) -> None:
        """Record why the wanted chunks outside ``[num_computed, hit_end)`` were not loaded (stats + per request)."""
        groups = [GroupKeys(g.group_id, g.tokens_per_chunk, g.window_chunks, req.keys[g.index]) for g in self._groups]
        misses = explain_lookup(
            self.manager,
            groups,
            num_computed=num_computed,
            num_tokens=req.num_tokens,
            hit_end=hit_end,
            max_load_tokens=req.max_load_tokens,
        )
        if pending_only:
            misses = [m for m in misses if m.reason is MissReason.STORE_PENDING]
        req.misses = tuple(misses)
        counts = self._chunk_misses
        for miss in misses:
            counts[miss.reason] = counts.get(miss.reason, 0) + 1
        if hit_end <= num_computed and (misses or not pending_only):
            reason = MissReason.STORE_PENDING if pending_only else primary_reason(misses)
            self._lookup_misses[reason] = self._lookup_misses.get(reason, 0) + 1

    def lookup_misses(self, req_id: str) -> tuple[ChunkMiss, ...]:
        """The chunks the request's last lookup wanted but did not load, each with its :class:`MissReason`.

        Empty before the first lookup, after a full hit, and for a lookup deferred for another reason than a
        pending store (the request has a job in flight, or another request is loading the chunks).
        """
        return self._request(req_id).misses

    def forget_chunk(self, key: bytes, reason: MissReason) -> bool:
        """Drop one chunk from the pool for ``reason`` and remember it, so later misses on it say why.

        The hook for features that find a chunk unusable: a tier that cannot serve it
        (``MissReason.TIER_UNAVAILABLE``), or a checksum mismatch found elsewhere than in a load report
        (``MissReason.CORRUPT``; corrupt chunks named by worker reports are dropped already). Returns True when
        the chunk was resident and is dropped (a chunk pinned by loads is never served again and is freed at
        its last unpin); an absent one only has its reason remembered. A chunk whose store is in flight raises
        :class:`InvalidStateError`.
        """
        dropped = bool(self.manager.remove([key], reason))
        self._removed[reason] = self._removed.get(reason, 0) + 1
        return dropped

    def _lookup_groups(self, req: _Request, num_computed: int, max_hit: int) -> int | None:
        """Tokens beyond ``num_computed`` that every group can load, or None to defer (vLLM's ``_lookup``).

        Groups are visited full attention first, then sliding windows by decreasing window; each tightens
        ``max_hit`` to its chunk granularity. A group that defers does not stop the others (a later group
        may still answer "no hit"); when a later group shrinks the hit, a deferral is re-checked by
        visiting every group again, and earlier sliding windows are re-checked at the new end.
        Unlike vLLM, hit ends stay chunk-aligned (the scan ends at the last chunk wholly below ``max_hit``).
        """
        lookup = self.manager.lookup
        hit = 0
        defer = False
        to_visit = self._lookup_order
        while to_visit:
            looked_up_window = False
            visiting, to_visit = to_visit, ()
            for g in visiting:
                tpc = g.tokens_per_chunk
                keys = req.keys[g.index]
                max_hit = min(max_hit, len(keys) * tpc)
                if max_hit - num_computed < tpc:
                    return 0
                start = num_computed // tpc
                scanned = keys[start : max_hit // tpc]
                if g.window_chunks is None:
                    chunks = maximal_prefix_lookup(lookup, scanned)
                else:
                    chunks = sliding_window_lookup(lookup, scanned, max(1, g.window_chunks))
                if chunks == 0:
                    return 0
                if chunks is None:
                    defer = True
                else:
                    max_hit = min(max_hit, (start + chunks) * tpc)
                new_hit = max_hit - num_computed
                if new_hit < tpc:
                    return 0
                if new_hit < hit:
                    if defer:
                        defer = False
                        to_visit = self._lookup_order
                    elif looked_up_window and not to_visit:
                        to_visit = self._window_groups
                looked_up_window = looked_up_window or g.window_chunks is not None
                hit = new_hit
        return None if defer else hit

    def _load_range(self, g: _Group, start_tokens: int, end_tokens: int) -> tuple[int, int]:
        """Engine blocks [first, last) of group ``g`` a load of tokens [start, end) must fill."""
        tpb = g.tokens_per_block
        first = start_tokens // tpb
        last = end_tokens // tpb
        if g.window_chunks is not None:
            bpc = self.config.cache.blocks_per_chunk
            first = max(first, last - g.window_chunks * bpc)
        return first, last

    def _chunk_keys_of_blocks(self, req: _Request, g: _Group, first: int, last: int) -> list[bytes]:
        """Keys of the chunks holding engine blocks [first, last) of group ``g`` (partial chunks included)."""
        bpc = self.config.cache.blocks_per_chunk
        return req.keys[g.index][first // bpc : -(-last // bpc)]

    def _hit_keys(self, req: _Request, start: int, end: int) -> list[bytes]:
        return [
            key for g in self._groups for key in self._chunk_keys_of_blocks(req, g, *self._load_range(g, start, end))
        ]

    def _release_pins(self, req: _Request) -> None:
        if req.pinned:
            self.manager.complete_load(req.pinned)
            req.pinned = []

    # ---------------------------------------------------------------------------------- allocation, compute

    def on_blocks_allocated(
        self, req_id: str, new_block_ids: Sequence[Sequence[int]], *, num_external_tokens: int = 0
    ) -> None:
        """Record engine blocks newly allocated to a request, one list per offloaded group (config order).

        With ``num_external_tokens`` > 0 (at most what ``lookup`` returned, chunk-aligned) a load job is
        queued for the next step plan; blocks that an in-flight store still reads are flushed first.
        """
        req = self._request(req_id)
        if len(new_block_ids) != len(self._groups):
            raise ConfigError(
                f"new_block_ids has {len(new_block_ids)} lists but the config offloads {len(self._groups)} groups"
            )
        for g, ids in zip(self._groups, new_block_ids, strict=True):
            for block in ids:
                job_id = self._fenced.get(block)
                if job_id is not None:
                    self._flush.add(job_id)
            req.block_ids[g.index].extend(ids)
        if num_external_tokens:
            self._queue_load(req, num_external_tokens)
        else:
            self._release_pins(req)

    def _queue_load(self, req: _Request, num_external_tokens: int) -> None:
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
        keys: list[bytes] = []
        for g in self._groups:
            if end % g.tokens_per_chunk and end != req.hit_end:
                raise InvalidStateError(
                    f"request {req.req_id!r}: num_external_tokens={num_external_tokens} is not chunk-aligned "
                    f"({g.tokens_per_chunk} tokens per chunk in group {g.group_id})"
                )
            first, last = self._load_range(g, start, end)
            ids = req.block_ids[g.index]
            if last > len(ids):
                raise InvalidStateError(
                    f"request {req.req_id!r}: group {g.group_id} has {len(ids)} blocks allocated, the load needs {last}"
                )
            group_sizes.append(max(0, last - first))
            block_indices.append(first)
            blocks.extend(ids[first:last])
            group_keys = self._chunk_keys_of_blocks(req, g, first, last)
            keys.extend(group_keys)
            bpc = self.config.cache.blocks_per_chunk
            for chunk, key in enumerate(group_keys, start=first // bpc):
                req.accessed[key] = ((chunk + 1) * g.tokens_per_chunk, g.group_id)
        used = set(keys)
        unused = [k for k in req.pinned if k not in used]
        if unused:
            self.manager.complete_load(unused)
        req.pinned = []
        chunk_ids = [self.manager.chunk_id(k) for k in keys]
        job = self._new_job(req, is_store=False, keys=keys, num_tokens=num_external_tokens, blocks=())
        job.chunk_keys = {c: k for c, k in zip(chunk_ids, keys, strict=True) if c is not None}
        for key in keys:
            self._loading[key] = self._loading.get(key, 0) + 1
        req.reused_keys.update(keys)
        self._pending_loads.append(
            TransferJob(
                job_id=job.job_id,
                req_id=req.req_id,
                group_sizes=pack_int32(group_sizes),
                block_indices=pack_int32(block_indices),
                block_ids=pack_int64(blocks),
                chunk_ids=pack_int64([c if c is not None else -1 for c in chunk_ids]),
                chunk_tags=pack_int64(key_tags(keys)),
            )
        )
        # Loaded chunks are already on the host: do not store them again (vLLM's CHUNK_LEVEL policy).
        for g in self._groups:
            req.next_stored[g.index] = max(req.next_stored[g.index], end // g.tokens_per_chunk)

    def on_tokens_computed(self, req_id: str, num_computed_tokens: int) -> None:
        """Advance a request's computed tokens; newly complete chunks are stored by the next step plan."""
        req = self._request(req_id)
        if num_computed_tokens > req.num_tokens:
            raise ConfigError(
                f"num_computed_tokens={num_computed_tokens} exceeds num_tokens={req.num_tokens} of {req_id!r}"
            )
        req.num_computed = max(req.num_computed, num_computed_tokens)

    def _new_job(
        self, req: _Request, *, is_store: bool, keys: list[bytes], num_tokens: int, blocks: tuple[int, ...]
    ) -> _Job:
        job = _Job(
            job_id=self._next_job_id,
            req_id=req.req_id,
            is_store=is_store,
            keys=keys,
            pending=self.world_size,
            num_tokens=num_tokens,
            blocks=blocks,
        )
        self._next_job_id += 1
        self._jobs[job.job_id] = job
        req.jobs.add(job.job_id)
        self._counters["store_jobs" if is_store else "load_jobs"] += 1
        return job

    # ------------------------------------------------------------------------------------------ step plan

    def build_step_plan(self) -> StepPlan:
        """The StepPlan for this step: queued loads, stores of newly complete chunks, and flushes."""
        store_jobs = [job for req in list(self._requests.values()) if (job := self._plan_store(req))]
        plan = StepPlan(
            step=self._step,
            load_jobs=tuple(self._pending_loads),
            store_jobs=tuple(store_jobs),
            flush=pack_int64(sorted(self._flush)),
        )
        self._step += 1
        self._pending_loads = []
        self._flush = set()
        return plan

    def _offloadable_tokens(self, req: _Request) -> int:
        tokens = min(req.num_computed, req.num_tokens)
        if req.max_offload_tokens is not None:
            tokens = min(tokens, req.max_offload_tokens)
        if self.offload_prompt_only:
            tokens = min(tokens, req.prompt_len)
        return tokens

    def _plan_store(self, req: _Request) -> TransferJob | None:
        if req.finished:
            return None
        bpc = self.config.cache.blocks_per_chunk
        tokens = self._offloadable_tokens(req)
        null = self.null_block_id
        ranges: list[tuple[int, int]] = []
        offered: list[bytes] = []
        positions: dict[bytes, tuple[int, int]] = {}
        for g in self._groups:
            ids = req.block_ids[g.index]
            end = min(tokens // g.tokens_per_chunk, len(ids) // bpc, len(req.keys[g.index]))
            start = req.next_stored[g.index]
            ranges.append((start, end))
            for chunk in range(start, end):
                if null is None or null not in ids[chunk * bpc : (chunk + 1) * bpc]:
                    key = req.keys[g.index][chunk]
                    offered.append(key)
                    positions[key] = ((chunk + 1) * g.tokens_per_chunk, g.group_id)
        if not offered:
            for g, (start, end) in zip(self._groups, ranges, strict=True):
                req.next_stored[g.index] = max(start, end)
            return None
        # As vLLM's manager, the request's accesses are the offered keys already stored (reused) and the
        # keys it stores; the order the policy sees at finish comes from their positions.
        ready = [key for key in offered if self.manager.is_ready(key)]
        req.reused_keys.update(ready)
        for key in ready:
            req.accessed[key] = positions[key]
        plan = self.manager.prepare_store(offered, request_id=req.req_id)
        if plan is None:
            self._counters["allocation_failures"] += 1
            return None  # no progress: retried next step, as vLLM does
        for g, (start, end) in zip(self._groups, ranges, strict=True):
            req.next_stored[g.index] = max(start, end)
        accepted = set(plan.keys_to_store)
        for key in plan.keys_to_store:
            req.accessed[key] = positions[key]
        if not accepted:
            return None
        group_sizes: list[int] = []
        block_indices: list[int] = []
        blocks: list[int] = []
        keys: list[bytes] = []
        num_tokens = 0
        for g, (start, end) in zip(self._groups, ranges, strict=True):
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
        job = self._new_job(req, is_store=True, keys=keys, num_tokens=num_tokens, blocks=tuple(blocks))
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

    # --------------------------------------------------------------------------------------- completions

    def on_worker_reports(self, reports: Iterable[WorkerReport]) -> ReportOutcome:
        """Count worker results; a job completes once all ``world_size`` workers reported it.

        A job any worker failed is a failure: its stored chunks are freed (never marked ready) and a failed
        load's request must recompute. Reports of unknown or stale jobs are ignored.
        """
        finished: list[str] = []
        failed_loads: list[str] = []
        failed_stores: list[str] = []
        for report in reports:
            for result in report.results:
                job = self._jobs.get(result.job_id)
                if job is None or report.rank in job.reported:
                    continue  # unknown, already completed, or a repeated report from the same worker
                job.reported.add(report.rank)
                if result.corrupt_chunk_ids and not job.is_store:
                    self._drop_corrupt(job, Int64Array.from_buffer(result.corrupt_chunk_ids).tolist())
                self._counters["bytes_stored" if job.is_store else "bytes_loaded"] += result.num_bytes
                self._seconds["store" if job.is_store else "load"] += result.seconds
                job.failed = job.failed or not result.success
                job.pending -= 1
                if job.pending > 0:
                    continue
                self._complete(job, finished, failed_loads, failed_stores)
        return ReportOutcome(tuple(finished), tuple(failed_loads), tuple(failed_stores))

    def _drop_corrupt(self, job: _Job, chunk_ids: list[int]) -> None:
        """A worker found chunks of this load corrupt: drop their keys so they are never served again."""
        if not job.corrupt:
            job.corrupt = True
            self._counters["corrupt_loads"] += 1
        if job.stale:
            return  # reset since: the ids may name chunks of the new generation
        keys = [job.chunk_keys[c] for c in chunk_ids if c in job.chunk_keys]
        dropped = len(self.manager.drop(keys, MissReason.CORRUPT))
        self._counters["corrupted_chunks"] += dropped
        if dropped:
            self._removed[MissReason.CORRUPT] = self._removed.get(MissReason.CORRUPT, 0) + dropped

    def fail_jobs(self, job_ids: Iterable[int]) -> ReportOutcome:
        """Fail jobs outright (e.g. a worker died before reporting them): pins released, data never ready."""
        finished: list[str] = []
        failed_loads: list[str] = []
        failed_stores: list[str] = []
        for job_id in list(job_ids):
            job = self._jobs.get(job_id)
            if job is not None:
                job.failed = True
                self._complete(job, finished, failed_loads, failed_stores)
        return ReportOutcome(tuple(finished), tuple(failed_loads), tuple(failed_stores))

    def in_flight_job_ids(self) -> list[int]:
        """Ids of jobs not yet reported by every worker."""
        return sorted(self._jobs)

    def _complete(self, job: _Job, finished: list[str], failed_loads: list[str], failed_stores: list[str]) -> None:
        del self._jobs[job.job_id]
        req = self._requests.get(job.req_id)
        if job.is_store:
            for block in job.blocks:
                if self._fenced.get(block) == job.job_id:
                    del self._fenced[block]
            if not job.stale:
                self.manager.complete_store(job.keys, success=not job.failed)
            if job.failed:
                self._counters["failed_jobs"] += 1
                self._failed["store"] += 1
                failed_stores.append(job.req_id)
            elif not job.stale:
                self._counters["tokens_stored"] += job.num_tokens
        else:
            self._release_load(job)
            if job.failed:
                self._counters["failed_jobs"] += 1
                self._failed["load"] += 1
                failed_loads.append(job.req_id)
            else:
                self._counters["tokens_loaded"] += job.num_tokens
                if req is not None and not req.finished:
                    finished.append(job.req_id)
        if req is not None:
            req.jobs.discard(job.job_id)
            if req.finished and not req.jobs:
                self._drop(req)

    def _release_load(self, job: _Job) -> None:
        """Unpin a finished (or withdrawn) load's chunks and stop counting them as being loaded."""
        for key in job.keys:
            left = self._loading.get(key, 0) - 1
            if left > 0:
                self._loading[key] = left
            else:
                self._loading.pop(key, None)
        if not job.stale:
            self.manager.complete_load(job.keys)

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

    def _drop(self, req: _Request) -> None:
        self._requests.pop(req.req_id, None)

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
            by_group: dict[int, list[bytes]] = {}
            for key in event.keys:
                by_group.setdefault(offload_key_group(key), []).append(offload_key_hash(key))
            for group_idx, hashes in by_group.items():
                if event.removed:
                    events.append(BlockRemoved(block_hashes=tuple(hashes), group_idx=group_idx, medium=medium))
                else:
                    events.extend(BlockStored(block_hashes=(h,), group_idx=group_idx, medium=medium) for h in hashes)
        return events
