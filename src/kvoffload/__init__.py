"""kvoffload: offload LLM KV caches from accelerator memory to host memory and back.

The public API is what this module exports (see ``__all__``): the schema types generated from
``schema/kvoffload.toml``, their codecs, the translator, the wire protocol, the scheduler-side manager
and the torch worker backend. Importing kvoffload does not import torch: the torch-backed names
(``HostPool``, ``CopyEngine``, ``OffloadWorker``, ``WorkerCluster``, ...) load on first use, so a
scheduler process stays light; so do the metrics and KV event names (prometheus_client, pyzmq).
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from kvoffload import wire
from kvoffload._generated import (
    SCHEMA_FINGERPRINT,
    SCHEMA_VERSION,
    AttentionSpec,
    BaseKVCacheSpec,
    BlockRemoved,
    BlockStored,
    CacheConfig,
    CacheDType,
    ChunkedLocalAttentionSpec,
    DType,
    EngineConfig,
    EngineSnapshot,
    FullAttentionSpec,
    Heartbeat,
    Hello,
    JobResult,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVEvent,
    KVEventBatch,
    KVEventsConfig,
    KVQuantMode,
    KVTransferConfig,
    LoadMode,
    MambaSpec,
    Medium,
    Message,
    MissReason,
    MLAAttentionSpec,
    ModelConfig,
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
    ParallelConfig,
    PeerRole,
    Shutdown,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
    StepPlan,
    TransferJob,
    UniformTypeKVCacheSpecs,
    VLLMConnectorConfig,
    WorkerFailure,
    WorkerReport,
    codecs,
)
from kvoffload._packed import (
    Int32Array,
    Int32Bytes,
    Int64Array,
    Int64Bytes,
    pack_int32,
    pack_int64,
    unpack_int32,
    unpack_int64,
)
from kvoffload.assembly import WorkerParts, build_scheduler, build_worker, decode_extra_config
from kvoffload.errors import (
    ArgumentTypeError,
    ConfigError,
    DeadlineError,
    HostMemoryError,
    InvalidStateError,
    KVOffloadError,
    OffloadingConfigError,
    RecordError,
    SchemaMismatchError,
    TierError,
    TransferError,
    ValueOverflowError,
    VerificationError,
    WireError,
    WorkerError,
)
from kvoffload.offload.keys import BlockHash, OffloadKey, hash_token_blocks, make_offload_key
from kvoffload.offload.manager import HostBlockManager, LookupResult, ManagerStats, OffloadEvent, StorePlan
from kvoffload.offload.manager.policies import CachePolicy, register_policy
from kvoffload.offload.scheduler import (
    ChunkMiss,
    Direction,
    OffloadScheduler,
    ReportOutcome,
    SchedulerExtension,
    SchedulerStats,
)
from kvoffload.translate import (
    Decision,
    Explanation,
    build_offloading_config,
    explain_offloading_config,
    load_snapshot,
    translate_snapshot,
)

if _TYPE_CHECKING:
    from kvoffload._events import KVEventPublisher, KVEventSubscriber
    from kvoffload.metrics import MetricsSnapshot, SchedulerMetrics, WorkerMetrics
    from kvoffload.offload.pool import HostPool, HostPoolPlan, plan_host_pool, plan_host_pool_from_config
    from kvoffload.offload.worker import OffloadWorker
    from kvoffload.offload.worker.copy import CopyEngine, TransferLayout, transfer_layout_from_config
    from kvoffload.runtime.cluster import WorkerCluster
    from kvoffload.runtime.hooks import WorkerContext, WorkerHook
    from kvoffload.translate import validate_runnable

_LAZY = {
    "CopyEngine": "kvoffload.offload.worker.copy",
    "TransferLayout": "kvoffload.offload.worker.copy",
    "transfer_layout_from_config": "kvoffload.offload.worker.copy",
    "HostPool": "kvoffload.offload.pool._host_pool",
    "HostPoolPlan": "kvoffload.offload.pool._plan",
    "plan_host_pool": "kvoffload.offload.pool._plan",
    "plan_host_pool_from_config": "kvoffload.offload.pool._plan",
    "OffloadWorker": "kvoffload.offload.worker._worker",
    "WorkerCluster": "kvoffload.runtime.cluster",
    "WorkerContext": "kvoffload.runtime.hooks",
    "WorkerHook": "kvoffload.runtime.hooks",
    "validate_runnable": "kvoffload.translate",
    # observability: prometheus_client and pyzmq load on first use (a worker picks its metrics mode at import)
    "KVEventPublisher": "kvoffload._events",
    "KVEventSubscriber": "kvoffload._events",
    "MetricsSnapshot": "kvoffload.metrics",
    "SchedulerMetrics": "kvoffload.metrics",
    "WorkerMetrics": "kvoffload.metrics",
}


def __getattr__(name: str) -> object:
    """Load the torch-backed public names on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "SCHEMA_FINGERPRINT",
    "SCHEMA_VERSION",
    "ArgumentTypeError",
    "AttentionSpec",
    "BaseKVCacheSpec",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CacheDType",
    "CachePolicy",
    "ChunkMiss",
    "ChunkedLocalAttentionSpec",
    "ConfigError",
    "CopyEngine",
    "DType",
    "DeadlineError",
    "Decision",
    "Direction",
    "EngineConfig",
    "EngineSnapshot",
    "Explanation",
    "FullAttentionSpec",
    "Heartbeat",
    "Hello",
    "HostBlockManager",
    "HostMemoryError",
    "HostPool",
    "HostPoolPlan",
    "Int32Array",
    "Int32Bytes",
    "Int64Array",
    "Int64Bytes",
    "InvalidStateError",
    "JobResult",
    "KVCacheConfig",
    "KVCacheGroupRole",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "KVEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventSubscriber",
    "KVEventsConfig",
    "KVOffloadError",
    "KVQuantMode",
    "KVTransferConfig",
    "LoadMode",
    "LookupResult",
    "MLAAttentionSpec",
    "MambaSpec",
    "ManagerStats",
    "Medium",
    "Message",
    "MetricsSnapshot",
    "MissReason",
    "ModelConfig",
    "OffloadEvent",
    "OffloadKey",
    "OffloadScheduler",
    "OffloadWorker",
    "OffloadingCacheConfig",
    "OffloadingConfig",
    "OffloadingConfigError",
    "OffloadingGroupConfig",
    "OffloadingModelConfig",
    "OffloadingParallelConfig",
    "ParallelConfig",
    "PeerRole",
    "RecordError",
    "ReportOutcome",
    "SchedulerExtension",
    "SchedulerMetrics",
    "SchedulerStats",
    "SchemaMismatchError",
    "Shutdown",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "SparseCacheRole",
    "StepPlan",
    "StorePlan",
    "TierError",
    "TransferError",
    "TransferJob",
    "TransferLayout",
    "UniformTypeKVCacheSpecs",
    "VLLMConnectorConfig",
    "ValueOverflowError",
    "VerificationError",
    "WireError",
    "WorkerCluster",
    "WorkerContext",
    "WorkerError",
    "WorkerFailure",
    "WorkerHook",
    "WorkerMetrics",
    "WorkerParts",
    "WorkerReport",
    "__version__",
    "build_offloading_config",
    "build_scheduler",
    "build_worker",
    "codecs",
    "decode_extra_config",
    "explain_offloading_config",
    "hash_token_blocks",
    "load_snapshot",
    "make_offload_key",
    "pack_int32",
    "pack_int64",
    "plan_host_pool",
    "plan_host_pool_from_config",
    "register_policy",
    "transfer_layout_from_config",
    "translate_snapshot",
    "unpack_int32",
    "unpack_int64",
    "validate_runnable",
    "wire",
]
