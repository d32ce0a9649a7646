"""The offload scheduler's book: chunk geometry per group, the registered requests, the jobs in flight, counters.

One :class:`SchedulerBook` is shared by the scheduler's parts (lookups, transfer planning, report handling):
it holds what all of them read and the few operations on it that all of them need (a request by id, a new job,
releasing pins and loads). What only one part uses stays in that part.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from kvoffload._generated import OffloadingConfig
from kvoffload._ints import cdiv
from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload._direction import Direction
from kvoffload.offload.keys import BlockHash, OffloadKey, chunk_keys, hashes_per_chunk
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.scheduler._misses import ChunkMiss
from kvoffload.offload.scheduler._results import SchedulerStats

__all__ = ["GroupGeometry", "JobState", "RequestState", "SchedulerBook", "check_retention_interval"]


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """Chunk geometry of one offloaded group."""

    index: int
    group_id: int
    tokens_per_block: int
    tokens_per_chunk: int
    hashes_per_chunk: int
    window_chunks: int | None  # None: full attention (a prefix is needed), else chunks of the window
    eagle: bool = False  # an EAGLE/MTP draft group: its trailing chunk is volatile (vLLM 0.33 §5.4, §5.5)


@dataclass(slots=True)
class JobState:
    job_id: int
    req_id: str
    direction: Direction
    keys: list[OffloadKey]
    pending: int
    num_tokens: int
    blocks: tuple[int, ...]
    failed: bool = False
    tier_miss: bool = True
    """While failed: every failure reported was a tier miss (a promotion it reads failed), so far."""
    stale: bool = False
    reported: set[int] = field(default_factory=set)
    chunk_keys: dict[int, OffloadKey] = field(default_factory=dict)  # loads: chunk id -> key (integrity)
    corrupt: bool = False

    @property
    def is_store(self) -> bool:
        return self.direction is Direction.STORE


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
    sync_load: bool = False  # the last lookup's hit loads inside the step (sync_load_budget_bytes)


def group_geometry(config: OffloadingConfig, eagle_group_ids: Collection[int] = ()) -> tuple[GroupGeometry, ...]:
    """The chunk geometry of each offloaded group of ``config``, in config order (``eagle_group_ids``: the
    group ids of EAGLE draft groups)."""
    bpc = config.cache.blocks_per_chunk
    tph = config.cache.tokens_per_hash
    return tuple(
        GroupGeometry(
            index=i,
            group_id=g.group_id,
            tokens_per_block=g.tokens_per_block,
            tokens_per_chunk=g.tokens_per_block * bpc,
            hashes_per_chunk=hashes_per_chunk(g.tokens_per_block, bpc, tph),
            window_chunks=g.sliding_window_size_in_chunks,
            eagle=g.group_id in eagle_group_ids,
        )
        for i, g in enumerate(config.groups)
    )


def offloaded_group_ids(name: str, ids: object, config: OffloadingConfig) -> frozenset[int]:
    """``ids`` checked to be a collection of ids of groups ``config`` offloads; a ConfigError names ``name``."""
    offloaded = [g.group_id for g in config.groups]
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Collection):
        raise ConfigError(f"{name} must be a collection of KV cache group ids, got {ids!r}")
    out: set[int] = set()
    for gid in ids:
        if isinstance(gid, bool) or not isinstance(gid, int):
            raise ConfigError(f"{name} must hold int group ids, got {gid!r}")
        if gid not in offloaded:
            raise ConfigError(f"{name}: group {gid} is not an offloaded group (offloaded group ids: {offloaded})")
        out.add(gid)
    return frozenset(out)


def mamba_alignment(groups: tuple[GroupGeometry, ...], mamba_ids: frozenset[int]) -> int | None:
    """Tokens a hit end is rounded down to with align-mode Mamba groups (their tokens per chunk), or None.

    vLLM 0.33 (§5.5): ``round_down(max_hit, tokens_per_block * blocks_per_chunk)`` of the align-mode Mamba
    group; a Mamba group is offloaded as a window of one chunk, and all such groups must agree on the size."""
    sizes: set[int] = set()
    for g in groups:
        if g.group_id not in mamba_ids:
            continue
        if g.window_chunks != 1:
            raise ConfigError(
                f"mamba_align_group_ids: group {g.group_id} has sliding_window_size_in_chunks={g.window_chunks}, "
                "but a Mamba group is offloaded as a window of 1 chunk"
            )
        sizes.add(g.tokens_per_chunk)
    if len(sizes) > 1:
        raise ConfigError(
            f"mamba_align_group_ids: the align-mode Mamba groups have different tokens per chunk {sorted(sizes)}; "
            "a hit can be rounded down to one Mamba alignment only"
        )
    return sizes.pop() if sizes else None


def check_retention_interval(value: object, groups: tuple[GroupGeometry, ...]) -> int | None:
    """``prefix_cache_retention_interval`` as vLLM 0.33's scheduler checks it (§2.4): None, or an int >= 0 that
    is a multiple of every window group's (sliding window, chunked local, Mamba) tokens per chunk."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"prefix_cache_retention_interval must be an int or None, got {value!r}")
    if value < 0:
        raise ConfigError(f"prefix_cache_retention_interval ({value}) must be non-negative.")
    for g in groups:
        if g.window_chunks is not None and value % g.tokens_per_chunk:
            raise ConfigError(
                f"prefix_cache_retention_interval ({value}) must be a multiple of tokens_per_chunk "
                f"({g.tokens_per_chunk})."
            )
    return value


class SchedulerBook:
    """What every part of an :class:`~kvoffload.offload.scheduler.OffloadScheduler` reads and writes.

    The groups' geometry, the registered requests, the jobs not yet reported by every worker, the keys being
    loaded into engine blocks, and the counters (one :class:`SchedulerStats`).
    """

    def __init__(
        self,
        config: OffloadingConfig,
        manager: HostBlockManager,
        *,
        eagle_group_ids: Collection[int] = (),
        mamba_align_group_ids: Collection[int] = (),
    ) -> None:
        if not config.groups:
            raise ConfigError("OffloadingConfig.groups is empty: nothing to offload")
        self.config = config
        self.manager = manager
        self.blocks_per_chunk = config.cache.blocks_per_chunk
        self.world_size = config.parallel.world_size
        eagle = offloaded_group_ids("eagle_group_ids", eagle_group_ids, config)
        self.groups = group_geometry(config, eagle)
        self.mamba_align = mamba_alignment(
            self.groups, offloaded_group_ids("mamba_align_group_ids", mamba_align_group_ids, config)
        )
        # vLLM visits full attention first, then sliding windows from the largest window down.
        self.lookup_order = tuple(
            sorted(self.groups, key=lambda g: (g.window_chunks is not None, -(g.window_chunks or 0)))
        )
        self.window_groups = tuple(g for g in self.lookup_order if g.window_chunks is not None)
        self.requests: dict[str, RequestState] = {}
        self.jobs: dict[int, JobState] = {}
        self.loading: dict[OffloadKey, int] = {}  # key -> loads in flight that read it (shared, never waited on)
        self.stats = SchedulerStats()
        self._next_job_id = 0

    def request(self, req_id: str) -> RequestState:
        req = self.requests.get(req_id)
        if req is None:
            raise InvalidStateError(f"unknown request {req_id!r}")
        return req

    def update_keys(self, req: RequestState) -> None:
        """Extend the request's per-group chunk keys to cover its block hashes, recording each new key's end-token
        position ``(i + 1) x tokens_per_chunk`` in the request's manager context (vLLM's ``update_offload_keys``)."""
        ctx = self.manager.request_context(req.req_id)
        for g in self.groups:
            keys = req.keys[g.index]
            start = len(keys)
            keys.extend(chunk_keys(req.block_hashes, g.group_id, g.hashes_per_chunk, start_chunk=start))
            tpc = g.tokens_per_chunk
            ctx.set_offload_key_positions((key, (i + 1) * tpc) for i, key in enumerate(keys[start:], start))

    def load_range(self, g: GroupGeometry, start_tokens: int, end_tokens: int) -> tuple[int, int]:
        """Engine blocks [first, last) of group ``g`` a load of tokens [start, end) must fill."""
        tpb = g.tokens_per_block
        first = start_tokens // tpb
        last = end_tokens // tpb
        if g.window_chunks is not None:
            first = max(first, last - g.window_chunks * self.blocks_per_chunk)
        return first, last

    def chunk_keys_of_blocks(self, req: RequestState, g: GroupGeometry, first: int, last: int) -> list[OffloadKey]:
        """Keys of the chunks holding engine blocks [first, last) of group ``g`` (partial chunks included)."""
        bpc = self.blocks_per_chunk
        return req.keys[g.index][first // bpc : cdiv(last, bpc)]

    def release_pins(self, req: RequestState) -> None:
        if req.pinned:
            self.manager.complete_load(req.pinned)
            req.pinned = []

    def new_job(
        self,
        req: RequestState,
        direction: Direction,
        *,
        keys: list[OffloadKey],
        num_tokens: int,
        blocks: tuple[int, ...],
    ) -> JobState:
        job = JobState(
            job_id=self._next_job_id,
            req_id=req.req_id,
            direction=direction,
            keys=keys,
            pending=self.world_size,
            num_tokens=num_tokens,
            blocks=blocks,
        )
        self._next_job_id += 1
        self.jobs[job.job_id] = job
        req.jobs.add(job.job_id)
        if direction is Direction.STORE:
            self.stats.store_jobs += 1
        else:
            self.stats.load_jobs += 1
        return job

    def release_load(self, job: JobState) -> None:
        """Unpin a finished (or withdrawn) load's chunks and stop counting them as being loaded."""
        for key in job.keys:
            left = self.loading.get(key, 0) - 1
            if left > 0:
                self.loading[key] = left
            else:
                self.loading.pop(key, None)
        if not job.stale:
            self.manager.complete_load(job.keys)

    def drop(self, req: RequestState) -> None:
        self.requests.pop(req.req_id, None)
