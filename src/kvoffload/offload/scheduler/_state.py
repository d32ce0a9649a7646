"""The offload scheduler's state: chunk geometry per group, per-request and per-job bookkeeping, counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload._generated import MissReason, OffloadingConfig, TransferJob
from kvoffload._ints import cdiv
from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.keys import BlockHash, OffloadKey, chunk_keys, hashes_per_chunk
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.scheduler._misses import ChunkMiss

__all__ = ["GroupGeometry", "JobState", "RequestState", "SchedulerState"]


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """Chunk geometry of one offloaded group."""

    index: int
    group_id: int
    tokens_per_block: int
    tokens_per_chunk: int
    hashes_per_chunk: int
    window_chunks: int | None  # None: full attention (a prefix is needed), else chunks of the window


@dataclass(slots=True)
class JobState:
    job_id: int
    req_id: str
    is_store: bool
    keys: list[OffloadKey]
    pending: int
    num_tokens: int
    blocks: tuple[int, ...]
    failed: bool = False
    stale: bool = False
    reported: set[int] = field(default_factory=set)
    chunk_keys: dict[int, OffloadKey] = field(default_factory=dict)  # loads: chunk id -> key (integrity)
    corrupt: bool = False


@dataclass(slots=True)
class RequestState:
    req_id: str
    block_hashes: list[BlockHash]
    num_tokens: int
    prompt_len: int
    max_load_tokens: int | None
    max_offload_tokens: int | None
    keys: list[list[OffloadKey]]
    block_ids: list[list[int]]
    next_stored: list[int]
    num_computed: int = 0
    jobs: set[int] = field(default_factory=set)
    pinned: list[OffloadKey] = field(default_factory=list)
    hit_start: int = 0
    hit_end: int = 0
    finished: bool = False
    reused_keys: set[OffloadKey] = field(default_factory=set)
    # keys the request loaded, stored or found stored when offering -> (end-token position, group id)
    accessed: dict[OffloadKey, tuple[int, int]] = field(default_factory=dict)
    misses: tuple[ChunkMiss, ...] = ()


class SchedulerState:
    """The state an :class:`~kvoffload.offload.scheduler.OffloadScheduler` keeps, and the helpers its parts share.

    Holds the registered requests, the jobs in flight, the fenced engine blocks and the counters; the lookup,
    transfer-planning and report-handling parts of the scheduler build on it.
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
            GroupGeometry(
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
        self._requests: dict[str, RequestState] = {}
        self._jobs: dict[int, JobState] = {}
        self._next_job_id = 0
        self._step = 0
        self._pending_loads: list[TransferJob] = []
        self._flush: set[int] = set()
        self._fenced: dict[int, int] = {}  # engine block id -> in-flight store job id
        self._loading: dict[OffloadKey, int] = {}  # key -> loads in flight that read it
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

    def _request(self, req_id: str) -> RequestState:
        req = self._requests.get(req_id)
        if req is None:
            raise InvalidStateError(f"unknown request {req_id!r}")
        return req

    def _update_keys(self, req: RequestState) -> None:
        for g in self._groups:
            keys = req.keys[g.index]
            keys.extend(chunk_keys(req.block_hashes, g.group_id, g.hashes_per_chunk, start_chunk=len(keys)))

    def _load_range(self, g: GroupGeometry, start_tokens: int, end_tokens: int) -> tuple[int, int]:
        """Engine blocks [first, last) of group ``g`` a load of tokens [start, end) must fill."""
        tpb = g.tokens_per_block
        first = start_tokens // tpb
        last = end_tokens // tpb
        if g.window_chunks is not None:
            bpc = self.config.cache.blocks_per_chunk
            first = max(first, last - g.window_chunks * bpc)
        return first, last

    def _chunk_keys_of_blocks(self, req: RequestState, g: GroupGeometry, first: int, last: int) -> list[OffloadKey]:
        """Keys of the chunks holding engine blocks [first, last) of group ``g`` (partial chunks included)."""
        bpc = self.config.cache.blocks_per_chunk
        return req.keys[g.index][first // bpc : cdiv(last, bpc)]

    def _release_pins(self, req: RequestState) -> None:
        if req.pinned:
            self.manager.complete_load(req.pinned)
            req.pinned = []

    def _new_job(
        self, req: RequestState, *, is_store: bool, keys: list[OffloadKey], num_tokens: int, blocks: tuple[int, ...]
    ) -> JobState:
        job = JobState(
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

    def _release_load(self, job: JobState) -> None:
        """Unpin a finished (or withdrawn) load's chunks and stop counting them as being loaded."""
        for key in job.keys:
            left = self._loading.get(key, 0) - 1
            if left > 0:
                self._loading[key] = left
            else:
                self._loading.pop(key, None)
        if not job.stale:
            self.manager.complete_load(job.keys)

    def _drop(self, req: RequestState) -> None:
        self._requests.pop(req.req_id, None)
