"""``kvoffload demo``: a multi-turn chat workload through the scheduler and N worker processes, verified.

A small simulated engine (a block pool, requests, a forward pass that writes KV whose bytes are a function of
the token prefix and the layer) runs a synthetic multi-turn chat with a shared system prompt. The engine's
block pool is small, so a conversation's earlier KV is gone from it by the next turn: the scheduler finds the
prefix in the host pool, the workers load it back, and every reloaded block is compared byte for byte with
what the engine would have computed. Any mismatch, failed job or dead worker makes the run exit non-zero.
"""

from __future__ import annotations

import dataclasses
import random
import struct
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from ._generated import (
    CacheConfig,
    DType,
    EngineConfig,
    EngineSnapshot,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVTransferConfig,
    ModelConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    ParallelConfig,
    StepPlan,
    TieringConfig,
)
from .errors import ConfigError, DeadlineError, HostMemoryError
from .offload.keys import BlockHash, hash_token_blocks
from .offload.manager import HostBlockManager
from .offload.pool_files import available_host_memory_bytes
from .offload.pool_plan import plan_host_pool_from_config
from .offload.scheduler import OffloadScheduler
from .packed import Int32Array, Int64Array
from .runtime.cluster import DEFAULT_WORKER_TIMEOUT_S, WorkerCluster
from .runtime.sim_engine import block_seed
from .tiers.cascade import TieredScheduler, TierStatsRow, start_embedded_servers
from .tiers.valkey import EmbeddedValkey
from .translate import translate_snapshot

if TYPE_CHECKING:
    from .events import KVEventPublisher
    from .metrics import SchedulerMetrics

__all__ = ["DemoOptions", "DemoResult", "default_snapshot", "render_misses", "run_demo"]

MiB = 1 << 20


def default_snapshot(
    *, workers: int = 2, num_blocks: int = 256, cpu_bytes: int = 128 * MiB, policy: str = "lru"
) -> EngineSnapshot:
    """A Llama-style GQA model at reduced size: 4 layers, 8 KV heads of 128 (bf16), block 16, TP=workers.

    Pages are realistic (4 heads per rank x 16 tokens x (128 + 128) x 2 bytes = 32 KiB per layer at TP 2);
    the KV memory is layer-major, one backing allocation per worker, as vLLM lays it out.
    """
    total_heads = 8
    if workers < 1 or total_heads % workers:
        raise ConfigError(f"workers={workers} must divide the demo model's {total_heads} KV heads")
    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=total_heads // workers, head_size=128, dtype=DType.BFLOAT16)
    page = spec.num_kv_heads * spec.block_size * (spec.head_size * 2) * 2
    return EngineSnapshot(
        engine_config=EngineConfig(
            model_config=ModelConfig(
                model="demo/llama-style-gqa",
                dtype=DType.BFLOAT16,
                use_mla=False,
                total_num_kv_heads=total_heads,
            ),
            cache_config=CacheConfig(block_size=16),
            parallel_config=ParallelConfig(tensor_parallel_size=workers, world_size=workers),
            kv_transfer_config=KVTransferConfig(
                engine_id="kvoffload-demo",
                kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes, "eviction_policy": policy},
            ),
        ),
        kv_cache_config=KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=(
                KVCacheTensor(
                    size=len(layers) * num_blocks * page,
                    layers=layers,
                    layer_stride=num_blocks * page,
                    block_stride=page,
                ),
            ),
            kv_cache_groups=(KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec),),
        ),
    )


@dataclass(frozen=True)
class DemoOptions:
    """Knobs of the demo workload."""

    requests: int = 48
    conversations: int = 8
    system_prompt_tokens: int = 512
    turn_tokens: tuple[int, int] = (64, 384)
    decode_tokens: int = 16
    max_running: int = 4
    seed: int = 0
    shared_pool: bool = False
    memcpy_probe_bytes: int = 64 * MiB
    step_timeout_s: float = 120.0
    worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S
    tiering: TieringConfig | None = None


@dataclass
class DemoResult:
    """What the demo measured."""

    requests: int = 0
    requests_with_hit: int = 0
    prompt_tokens: int = 0
    tokens_loaded: int = 0
    tokens_recomputed: int = 0
    blocks_verified: int = 0
    mismatched_blocks: list[int] = field(default_factory=list)
    failed_jobs: int = 0
    dead_workers: list[int] = field(default_factory=list)
    worker_errors: dict[int, str] = field(default_factory=dict)
    deferred_lookups: int = 0
    steps: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    memcpy_gbps: float = 0.0
    wall_seconds: float = 0.0
    host_chunks_filled: int = 0
    host_chunks: int = 0
    tiers: list[TierStatsRow] = field(default_factory=list)
    lookup_miss_reasons: dict[str, int] = field(default_factory=dict)
    chunk_miss_reasons: dict[str, int] = field(default_factory=dict)
    events_published: int = 0
    events_dropped: int = 0

    @property
    def ok(self) -> bool:
        """True when every reloaded block matched and nothing failed."""
        return not self.mismatched_blocks and not self.failed_jobs and not self.dead_workers

    @property
    def store_gbps(self) -> float:
        return self.bytes_stored / self.store_seconds / 1e9 if self.store_seconds else 0.0

    @property
    def load_gbps(self) -> float:
        return self.bytes_loaded / self.load_seconds / 1e9 if self.load_seconds else 0.0


@dataclass
class _Request:
    req_id: str
    conversation: int
    tokens: list[int]
    prompt_len: int
    decode_left: int
    hashes: list[BlockHash]
    blocks: list[list[int]] = field(default_factory=list)
    num_computed: int = 0
    loaded: int = 0


class _BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.free = deque(range(num_blocks))

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.popleft() for _ in range(n)]

    def release(self, blocks: Sequence[int]) -> None:
        self.free.extend(blocks)


class _Workload:
    """Conversations that alternate user turns and generated replies; the next turn needs the last reply."""

    def __init__(self, options: DemoOptions, tokens_per_hash: int) -> None:
        self.options = options
        self.tph = tokens_per_hash
        self.rng = random.Random(options.seed)
        system = [self.rng.randrange(1, 32000) for _ in range(options.system_prompt_tokens)]
        self.history = [list(system) for _ in range(options.conversations)]
        self.ready = deque(range(options.conversations))
        self.issued = 0

    def next_request(self) -> _Request | None:
        if self.issued >= self.options.requests or not self.ready:
            return None
        conv = self.ready.popleft()
        lo, hi = self.options.turn_tokens
        turn = [self.rng.randrange(1, 32000) for _ in range(self.rng.randint(lo, hi))]
        tokens = self.history[conv] + turn
        self.issued += 1
        return _Request(
            req_id=f"conv{conv}-turn{self.issued}",
            conversation=conv,
            tokens=tokens,
            prompt_len=len(tokens),
            decode_left=self.options.decode_tokens,
            hashes=hash_token_blocks(tokens, self.tph),
        )

    def finished(self, req: _Request) -> None:
        self.history[req.conversation] = list(req.tokens)
        self.ready.append(req.conversation)


class _Demo:
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
        policy = self.config.extra_config.get("eviction_policy", "lru")
        self.num_chunks = plan_host_pool_from_config(self.config).num_chunks
        self.manager = HostBlockManager(self.num_chunks, str(policy), enable_events=events is not None)
        self.sched: OffloadScheduler
        if options.tiering is not None:
            self.sched = TieredScheduler(self.config, self.manager, options.tiering)
        else:
            self.sched = OffloadScheduler(self.config, self.manager)
        self.groups = self.config.groups
        self.tph = self.config.cache.tokens_per_hash
        self.num_blocks = snapshot.kv_cache_config.num_blocks
        self.pool = _BlockPool(self.num_blocks)
        self.workload = _Workload(options, self.tph)
        self.waiting: deque[_Request] = deque()
        self.running: dict[str, _Request] = {}
        self.result = DemoResult(host_chunks=self.num_chunks)
        self.any_dead = False
        self.registered: set[str] = set()
        self.refill: list[tuple[_Request, int, int]] = []

    def seed_of(self, req: _Request, group: int, block: int) -> int:
        per_block = self.groups[group].tokens_per_block // self.tph
        return block_seed(req.hashes[(block + 1) * per_block - 1])

    def admit(self) -> list[tuple[_Request, int, int]]:
        """Admit waiting requests while blocks last; returns the (request, first, last) tokens to compute."""
        while (req := self.workload.next_request()) is not None:
            self.waiting.append(req)
        computes: list[tuple[_Request, int, int]] = []
        while self.waiting and len(self.running) < self.options.max_running:
            req = self.waiting[0]
            if req.req_id not in self.registered:
                self.sched.add_request(req.req_id, req.hashes, req.prompt_len)
                self.registered.add(req.req_id)
            hit = self.sched.lookup(req.req_id, 0)
            if hit is None:
                self.result.deferred_lookups += 1
                break
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
                self.sched.on_blocks_allocated(req.req_id, [[] for _ in self.groups])  # release the pins
                break
            self.waiting.popleft()
            split, at = [], 0
            for n in need:
                split.append(blocks[at : at + n])
                at += n
            req.blocks = split
            req.loaded = hit
            self.sched.on_blocks_allocated(req.req_id, split, num_external_tokens=hit)
            self.running[req.req_id] = req
            self.result.requests += 1
            self.result.requests_with_hit += hit > 0
            self.result.prompt_tokens += req.prompt_len
            self.result.tokens_loaded += hit
            computes.append((req, hit, req.prompt_len))
        return computes

    def fill_entries(self, computes: list[tuple[_Request, int, int]]) -> list[int]:
        flat: list[int] = []
        for req, first, last in computes:
            for g, group in enumerate(self.groups):
                tpb = group.tokens_per_block
                for block in range(first // tpb, last // tpb):
                    flat += (g, req.blocks[g][block], self.seed_of(req, g, block))
        return flat

    def verify_entries(self, plan: StepPlan) -> list[int]:
        flat: list[int] = []
        for job in plan.load_jobs:
            req = self.running[job.req_id]
            ids = Int64Array.from_buffer(job.block_ids).tolist()
            sizes = Int32Array.from_buffer(job.group_sizes).tolist()
            starts = Int32Array.from_buffer(job.block_indices).tolist()
            at = 0
            for g, (size, start) in enumerate(zip(sizes, starts, strict=True)):
                for i in range(size):
                    flat += (job.job_id, g, ids[at + i], self.seed_of(req, g, start + i))
                at += size
        return flat

    def step(self, cluster: WorkerCluster) -> None:
        computes = self.admit()
        plan = self.sched.build_step_plan()
        refill, self.refill = self.refill, []
        fill = self.fill_entries(refill + computes)
        verify = self.verify_entries(plan)
        outcome = cluster.step(plan, [Int64Array(fill).tobytes(), Int64Array(verify).tobytes()])
        self.result.steps += 1
        report = self.sched.on_worker_reports(outcome.reports)
        for extras in outcome.attachments.values():
            stats = Int64Array.from_buffer(extras[0]).tolist()
            self.result.blocks_verified += stats[0]
            self.result.mismatched_blocks.extend(stats[2:])
        if outcome.newly_dead:
            self.result.dead_workers.extend(outcome.newly_dead)
            self.result.worker_errors.update(outcome.errors)
            self.any_dead = True
        if self.any_dead:
            if isinstance(self.sched, TieredScheduler):
                self.sched.fail_tier_jobs()  # a dead rank never reports them: promotions are never ready
            report_failed = self.sched.fail_jobs(self.sched.in_flight_job_ids())
            self.result.failed_jobs += len(report_failed.failed_loads) + len(report_failed.failed_stores)
        self.result.failed_jobs += len(report.failed_loads) + len(report.failed_stores)
        # A failed load means the engine recomputes those tokens.
        for req_id in report.failed_loads:
            req = self.running.get(req_id)
            if req is not None:
                self.result.tokens_loaded -= req.loaded
                self.result.tokens_recomputed += req.loaded
                self.refill.append((req, 0, req.loaded))
        for req, first, last in computes:
            self.result.tokens_recomputed += last - first
            req.num_computed = last
            self.sched.on_tokens_computed(req.req_id, last)
        for req in list(self.running.values()):
            if req.num_computed < req.prompt_len or any(req is c[0] for c in computes):
                continue
            self._decode(req)
        self.observe()

    def observe(self, *, final: bool = False) -> None:
        """Publish this step's KV events and bring the metrics up to date (rate-limited unless ``final``)."""
        if self.events is not None:
            self.events.publish(self.sched.take_events())
        if self.metrics is not None:
            if self.events is not None:
                self.metrics.record_event_batches(self.events.sent, self.events.dropped)
            self.metrics.observe(self.sched, force=final)

    def _decode(self, req: _Request) -> None:
        req.tokens.append(random.Random(f"{req.req_id}:{len(req.tokens)}").randrange(1, 32000))
        req.decode_left -= 1
        new_hashes = hash_token_blocks(
            req.tokens[len(req.hashes) * self.tph :],
            self.tph,
            parent=req.hashes[-1] if req.hashes else None,
        )
        req.hashes.extend(new_hashes)
        self.sched.extend_request(req.req_id, new_hashes, len(req.tokens))
        self.sched.on_tokens_computed(req.req_id, len(req.tokens))
        if req.decode_left == 0:
            self.sched.finish_request(req.req_id)
            del self.running[req.req_id]
            self.pool.release([b for blocks in req.blocks for b in blocks])
            self.workload.finished(req)

    @property
    def done(self) -> bool:
        return (
            self.workload.issued >= self.options.requests
            and not self.waiting
            and not self.running
            and not self.refill
            and not self.sched.has_pending_work()
        )


def run_demo(
    snapshot: EngineSnapshot,
    options: DemoOptions = DemoOptions(),
    *,
    progress: bool = True,
    max_steps: int = 100_000,
    metrics: SchedulerMetrics | None = None,
    metrics_dir: str | None = None,
    events: KVEventPublisher | None = None,
) -> DemoResult:
    """Run the demo workload on ``snapshot`` with one worker process per rank; returns what it measured.

    Raises HostMemoryError before starting any process when the workers' KV memory and host pools would
    not fit in this machine's available memory (real-size snapshots need a real-size machine).
    ``metrics`` is updated after every step; workers record their transfer metrics under ``metrics_dir``
    (prometheus_client multiprocess mode); ``events`` publishes the pool's KV events after every step.
    """
    _check_memory(snapshot, translate_snapshot(snapshot))
    servers: list[EmbeddedValkey] = []
    if options.tiering is not None:
        tiering, embedded = start_embedded_servers(options.tiering)
        servers.extend(embedded)
        options = dataclasses.replace(options, tiering=tiering)
    try:
        return _run(snapshot, options, progress, max_steps, metrics, metrics_dir, events)
    finally:
        for server in servers:
            server.stop()


def _run(
    snapshot: EngineSnapshot,
    options: DemoOptions,
    progress: bool,
    max_steps: int,
    metrics: SchedulerMetrics | None,
    metrics_dir: str | None,
    events: KVEventPublisher | None,
) -> DemoResult:
    demo = _Demo(snapshot, options, metrics, events)
    _check_workload_fits(options, demo.tph, demo.groups, demo.num_blocks)
    try:
        return _drive(demo, snapshot, options, progress, max_steps, metrics_dir, events)
    finally:
        if isinstance(demo.sched, TieredScheduler):
            demo.sched.close()


def _drive(
    demo: _Demo,
    snapshot: EngineSnapshot,
    options: DemoOptions,
    progress: bool,
    max_steps: int,
    metrics_dir: str | None,
    events: KVEventPublisher | None,
) -> DemoResult:
    started = time.perf_counter()
    cluster = WorkerCluster(
        snapshot,
        shared_pool=options.shared_pool,
        simulate=True,
        step_timeout_s=options.step_timeout_s,
        worker_timeout_s=options.worker_timeout_s,
        memcpy_probe_bytes=options.memcpy_probe_bytes,
        tiering=options.tiering,
        metrics_dir=metrics_dir,
    )
    cluster.start()
    bar = _progress(options.requests) if progress else None
    try:
        while not demo.done and demo.result.steps < max_steps:
            demo.step(cluster)
            if bar is not None:
                bar.update(demo.workload.issued - len(demo.waiting) - len(demo.running))
    finally:
        final = cluster.close()
        if bar is not None:
            bar.close()
    demo.sched.on_worker_reports(final.reports)
    if isinstance(demo.sched, TieredScheduler):
        demo.result.tiers = list(demo.sched.tier_stats)
    demo.observe(final=True)
    probes = [struct.unpack("<d", bytes(extras[0]))[0] for extras in final.attachments.values() if extras]
    stats = demo.sched.stats()
    result = demo.result
    result.bytes_stored, result.bytes_loaded = stats.bytes_stored, stats.bytes_loaded
    result.store_seconds, result.load_seconds = stats.store_seconds, stats.load_seconds
    result.memcpy_gbps = sum(probes) / len(probes) if probes else 0.0
    result.host_chunks_filled = len(demo.manager)
    result.lookup_miss_reasons = {str(k): v for k, v in stats.lookup_miss_reasons.items()}
    result.chunk_miss_reasons = {str(k): v for k, v in stats.chunk_miss_reasons.items()}
    if events is not None:
        result.events_published, result.events_dropped = events.sent, events.dropped
    result.wall_seconds = time.perf_counter() - started
    if demo.result.steps >= max_steps:
        raise DeadlineError(f"the demo did not finish within max_steps={max_steps} steps")
    return result


def _check_workload_fits(
    options: DemoOptions, tokens_per_hash: int, groups: Sequence[OffloadingGroupConfig], num_blocks: int
) -> None:
    """Refuse up front a workload whose longest conversation can never fit the engine block pool.

    The turn lengths are replayed from the seed (they do not depend on scheduling); which conversation gets
    which turn does, so the bound is the least the longest conversation must reach: the system prompt, an
    even share of all turns, and one reply. A workload passing this check may still grow one conversation past
    the pool; the engine then refuses that request as soon as it comes up (never a livelock).
    """
    workload = _Workload(options, tokens_per_hash)
    system = len(workload.history[0])
    turns = 0
    while (req := workload.next_request()) is not None:
        turns += req.prompt_len - system
        workload.ready.append(req.conversation)  # history stays the system prompt: each turn counted once
    share = -(-turns // options.conversations)
    tokens = system + share + options.decode_tokens
    need = sum(-(-tokens // g.tokens_per_block) for g in groups)
    if need > num_blocks:
        raise ConfigError(
            f"the workload cannot run: its longest conversation reaches at least {tokens} tokens ({system} system "
            f"prompt + {share} of {turns} turn tokens over {options.conversations} conversations + "
            f"{options.decode_tokens} decoded), {need} engine blocks, but the engine block pool has "
            f"num_blocks={num_blocks} (use fewer --requests, more --conversations, or more num_blocks)"
        )


def _check_memory(snapshot: EngineSnapshot, config: OffloadingConfig) -> None:
    plan = plan_host_pool_from_config(config)
    workers = config.parallel.world_size
    kv_bytes = max((t.size for t in snapshot.kv_cache_config.kv_cache_tensors), default=0)
    needed = workers * (kv_bytes + plan.num_chunks * plan.slot_bytes)
    available = available_host_memory_bytes()
    if needed > available * 0.8:
        raise HostMemoryError(
            f"the demo needs {needed / 2**30:.1f} GiB ({workers} workers x ({kv_bytes / 2**30:.2f} GiB of KV "
            f"memory + {plan.num_chunks * plan.slot_bytes / 2**30:.2f} GiB of host pool)) but "
            f"{available / 2**30:.1f} GiB are available: use a snapshot with fewer num_blocks or a smaller "
            "--cpu-bytes"
        )


class _progress:
    """A rich progress bar over finished requests (rich is a dependency; the bar goes to stderr)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("requests"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._progress.add_task("demo", total=total)
        self._progress.start()

    def update(self, completed: int) -> None:
        self._progress.update(self._task, completed=completed)

    def close(self) -> None:
        self._progress.stop()


def render_result(result: DemoResult) -> str:
    """The end-of-run table, as text."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvoffload demo", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    hit_rate = result.requests_with_hit / result.requests if result.requests else 0.0
    rows = [
        ("requests", f"{result.requests}"),
        ("engine steps", f"{result.steps}"),
        ("prefix-hit rate (requests)", f"{hit_rate:.1%}"),
        ("prompt tokens loaded from host", f"{result.tokens_loaded}"),
        ("prompt tokens recomputed", f"{result.tokens_recomputed}"),
        ("host pool chunks filled at end", f"{result.host_chunks_filled} of {result.host_chunks}"),
        ("bytes stored / loaded", f"{result.bytes_stored} / {result.bytes_loaded}"),
        ("store GB/s", f"{result.store_gbps:.2f}"),
        ("load GB/s", f"{result.load_gbps:.2f}"),
        ("plain memcpy GB/s (same run)", f"{result.memcpy_gbps:.2f}"),
        (
            "store / load vs memcpy",
            f"{result.store_gbps / result.memcpy_gbps:.0%} / {result.load_gbps / result.memcpy_gbps:.0%}"
            if result.memcpy_gbps
            else "n/a",
        ),
        *_tier_rows(result),
        ("reloaded blocks verified byte for byte", f"{result.blocks_verified}"),
        ("mismatched blocks", f"{len(result.mismatched_blocks)}"),
        ("failed jobs / dead workers", f"{result.failed_jobs} / {len(result.dead_workers)}"),
        ("wall time", f"{result.wall_seconds:.1f}s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    out = StringIO()
    Console(file=out, width=100, force_terminal=False).print(table)
    return out.getvalue()


def _tier_rows(result: DemoResult) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for i, t in enumerate(result.tiers):
        name = f"tier {i} ({t.name})"
        rows.append((f"{name}: prompt tokens promoted", f"{t.tokens_promoted}"))
        rows.append(
            (
                f"{name}: chunks cascaded / dropped / failed",
                f"{t.cascaded_chunks} / {t.dropped_chunks} / {t.cascade_failures}",
            )
        )
        rows.append((f"{name}: write / read GB/s", f"{t.write_gbps:.2f} / {t.read_gbps:.2f}"))
    return rows


def render_misses(result: DemoResult) -> str:
    """The miss breakdown (``kvoffload demo --explain-misses``): lookups and chunks per MissReason."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    from ._generated import MissReason

    table = Table(title="why lookups missed", show_header=True)
    table.add_column("reason")
    table.add_column("lookups (nothing loaded)", justify="right")
    table.add_column("chunks not loaded", justify="right")
    for reason in MissReason:
        table.add_row(
            reason.value,
            f"{result.lookup_miss_reasons.get(reason.value, 0)}",
            f"{result.chunk_miss_reasons.get(reason.value, 0)}",
        )
    table.add_row("total", f"{sum(result.lookup_miss_reasons.values())}", f"{sum(result.chunk_miss_reasons.values())}")
    out = StringIO()
    Console(file=out, width=100, force_terminal=False).print(table)
    return out.getvalue()


def snapshot_with_overrides(snapshot: EngineSnapshot, *, cpu_bytes: int | None, policy: str | None) -> EngineSnapshot:
    """Set ``cpu_bytes_to_use`` / ``eviction_policy`` in the snapshot's connector extra config."""
    engine = snapshot.engine_config
    transfer = engine.kv_transfer_config or KVTransferConfig(engine_id="kvoffload-demo")
    extra = dict(transfer.kv_connector_extra_config)
    if cpu_bytes is not None:
        extra["cpu_bytes_to_use"] = cpu_bytes
    if policy is not None:
        extra["eviction_policy"] = policy
    transfer = msgspec.structs.replace(transfer, kv_connector_extra_config=extra)
    return msgspec.structs.replace(snapshot, engine_config=msgspec.structs.replace(engine, kv_transfer_config=transfer))
