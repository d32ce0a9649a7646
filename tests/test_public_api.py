"""The public API is exactly what kvoffload/__init__.py curates in __all__."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import kvoffload


def test_all_is_unique_and_importable() -> None:
    names = kvoffload.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(kvoffload, name), name


def test_no_private_or_stray_public_names() -> None:
    public = {
        name
        for name, value in vars(kvoffload).items()
        if not name.startswith("_") and not isinstance(value, type(kvoffload))
    }
    assert public <= set(kvoffload.__all__), sorted(public - set(kvoffload.__all__))
    assert not [n for n in kvoffload.__all__ if n.startswith("_") and n != "__version__"]


def test_every_error_subclasses_a_builtin() -> None:
    errors = importlib.import_module("kvoffload.errors")
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.KVOffloadError)
        builtin_bases = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (object, BaseException)]
        assert builtin_bases, name
    assert issubclass(errors.OffloadingConfigError, ValueError)
    assert issubclass(errors.SchemaMismatchError, errors.WireError)


def test_import_does_not_need_jinja2() -> None:
    code = (
        "import sys; sys.modules['jinja2'] = None; import kvoffload; from kvoffload import codecs;"
        " print('jinja2' in sys.modules and sys.modules['jinja2'] is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# The curated public surface, spelled out: adding or removing a public name is a deliberate change here.
EXPECTED_ALL: dict[str, list[str]] = {
    "kvoffload": [
        "ArgumentTypeError",
        "AttentionSpec",
        "BaseKVCacheSpec",
        "BlockHash",
        "BlockRemoved",
        "BlockStored",
        "CircularBufferSpec",
        "CacheConfig",
        "CacheDType",
        "CachePolicy",
        "ChunkMiss",
        "ChunkedLocalAttentionSpec",
        "ConfigError",
        "ConfigImportError",
        "CopyEngine",
        "DType",
        "DeadlineError",
        "Decision",
        "EngineConfig",
        "EngineSnapshot",
        "Explanation",
        "FullAttentionSpec",
        "HiddenStateCacheSpec",
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
        "SCHEMA_FINGERPRINT",
        "SCHEMA_VERSION",
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
        "WorkerReport",
        "build_offloading_config",
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
        "__version__",
        "Direction",
        "SchedulerExtension",
        "WorkerParts",
        "build_scheduler",
        "build_worker",
    ],
    "kvoffload.translate": [
        "DEFAULT_MAX_SNAPSHOT_BYTES",
        "Decision",
        "Explanation",
        "build_offloading_config",
        "describe_error",
        "explain_offloading_config",
        "explain_snapshot",
        "load_snapshot",
        "real_page_size_bytes",
        "translate_snapshot",
        "validate_runnable",
    ],
    "kvoffload.tiers": [
        "BackpressureConfig",
        "BackpressureSettings",
        "CustomTierConfig",
        "DropPolicy",
        "DropStorePolicy",
        "EMABackpressureDetector",
        "EmbeddedValkey",
        "FsTier",
        "FsTierConfig",
        "Locality",
        "Namespace",
        "ObjStoreConfig",
        "ObjTier",
        "ObjTierConfig",
        "RawThroughput",
        "SecondaryTier",
        "SecondaryTierConfig",
        "ThrottledDropPolicy",
        "TierBase",
        "TierFilter",
        "TierIOResult",
        "TierJob",
        "TierJobResult",
        "TierMatcher",
        "TierStats",
        "TierStatsRow",
        "TierVsRaw",
        "TierWorker",
        "Tiering",
        "TieringConfig",
        "ValkeyTier",
        "ValkeyTierConfig",
        "compare_with_raw",
        "namespace_for",
        "namespaces_for_all_ranks",
        "open_tier",
        "parse_load_tiers",
        "raw_throughput",
        "register_drop_policy",
        "register_tier_type",
        "resolve_backpressure",
        "start_embedded_servers",
        "tier_from_cli",
        "tiering_config_from_extra",
    ],
    "kvoffload.metrics": [
        "ALLOCATION_BUCKETS",
        "HistogramSample",
        "MULTIPROC_ENV",
        "MetricSample",
        "MetricsServer",
        "MetricsSnapshot",
        "SIZE_BUCKETS",
        "STAT_METRICS",
        "TIERING_METRICS",
        "TIER_METRICS",
        "SchedulerMetrics",
        "TIME_BUCKETS",
        "WorkerMetrics",
        "add_worker_collector",
        "mark_worker_dead",
        "multiprocess_env",
        "serve_metrics",
    ],
    "kvoffload.offload.manager": ["HostBlockManager", "LookupResult", "ManagerStats", "OffloadEvent", "StorePlan"],
    "kvoffload.offload.manager.policies": [
        "ARCPolicy",
        "CachePolicy",
        "LRUPolicy",
        "PolicyFactory",
        "RequestContext",
        "available_policies",
        "check_evict_count",
        "make_policy",
        "order_request_keys",
        "policy_factory",
        "register_policy",
    ],
    "kvoffload.offload.scheduler": [
        "ChunkMiss",
        "Direction",
        "ExtensionFigures",
        "Locality",
        "LookupAdvice",
        "OffloadScheduler",
        "ReportOutcome",
        "SchedulerExtension",
        "SchedulerStats",
        "TierFilter",
        "TierMatcher",
        "TierStatsRow",
        "maximal_prefix_lookup",
        "parse_load_tiers",
        "sliding_window_lookup",
    ],
    "kvoffload.offload.pool": [
        "PAGE_SIZE",
        "BlockSlots",
        "Digests",
        "HostPool",
        "HostPoolPlan",
        "IntegrityTable",
        "available_host_memory_bytes",
        "check_pools_fit",
        "host_budget",
        "owned_pool_id",
        "plan_host_pool",
        "plan_host_pool_from_config",
        "shared_pool_path",
        "sweep_stale_pools",
        "table_bytes",
        "table_entries",
    ],
    "kvoffload.offload.worker": ["LayerwiseCopies", "OffloadWorker"],
    "kvoffload.offload.worker.copy": [
        "CopyBackend",
        "CopyEngine",
        "CopyJob",
        "CopyRuns",
        "CopySegment",
        "Direction",
        "GroupLayout",
        "IdsLike",
        "KVCacheTensorLike",
        "LayerPlacement",
        "TransferLayout",
        "build_block_slots",
        "build_copy_runs",
        "check_job_ids",
        "build_transfer_layout",
        "transfer_layout_from_config",
    ],
    "kvoffload.errors": [
        "ArgumentTypeError",
        "ConfigClassError",
        "ConfigError",
        "ConfigImportError",
        "ConfigModuleNotFoundError",
        "DeadlineError",
        "HostMemoryError",
        "InvalidStateError",
        "KVOffloadError",
        "OffloadingConfigError",
        "RecordError",
        "SchemaMismatchError",
        "TierError",
        "TierUnusableError",
        "TransferError",
        "ValueOverflowError",
        "VerificationError",
        "WireError",
        "WorkerError",
    ],
}


@pytest.mark.parametrize("module", sorted(EXPECTED_ALL))
def test_all_is_exactly_the_curated_surface(module: str) -> None:
    """``__all__`` of the package and of each documented subpackage is exactly this list (not a superset)."""
    names = importlib.import_module(module).__all__
    assert sorted(names) == sorted(EXPECTED_ALL[module])
    assert len(names) == len(set(names))


PUBLIC_MODULES = {
    "kvoffload.offload": {"keys", "manager", "pool", "scheduler", "worker"},
    "kvoffload.runtime": {"cluster", "hooks"},
}
"""Namespace packages whose public modules are the API (each listed in its docstring); the rest are private."""


def _public_children(package: str) -> set[str]:
    module = importlib.import_module(package)
    return {info.name for info in pkgutil.iter_modules(module.__path__) if not info.name.startswith("_")}


@pytest.mark.parametrize("package", sorted(name for name in EXPECTED_ALL if name != "kvoffload.errors"))
def test_packages_with_a_curated_all_hide_their_modules(package: str) -> None:
    """A package whose surface is its ``__all__`` has only private modules (``kvoffload`` itself: the
    documented subpackages)."""
    allowed = {
        "kvoffload": {
            "assembly",
            "demo",
            "errors",
            "faults",
            "integrations",
            "metrics",
            "offload",
            "runtime",
            "tiers",
            "translate",
            "wire",
        },
        "kvoffload.offload.manager": {"policies"},
        "kvoffload.offload.worker": {"copy"},
    }
    assert _public_children(package) <= allowed.get(package, set())


@pytest.mark.parametrize("package", sorted(PUBLIC_MODULES))
def test_namespace_packages_expose_their_documented_modules_only(package: str) -> None:
    assert _public_children(package) == PUBLIC_MODULES[package]
    doc = importlib.import_module(package).__doc__ or ""
    for name in PUBLIC_MODULES[package]:
        assert f"``{name}``" in doc, f"{package}.{name} is public but not in the package docstring"


def test_every_public_module_is_documented() -> None:
    """Implementation modules start with ``_``: every other module is a documented subpackage, the demo
    application or an engine integration."""
    documented = {"kvoffload", *EXPECTED_ALL, "kvoffload.wire", "kvoffload.assembly", *PUBLIC_MODULES}
    documented |= {f"{package}.{name}" for package, names in PUBLIC_MODULES.items() for name in names}
    public = set()
    for info in pkgutil.walk_packages(kvoffload.__path__, "kvoffload."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts):
            continue
        public.add(info.name)
    roots = {name for name in public if not any(name.startswith(d + ".") for d in documented)}
    roots |= {name for name in public if name.startswith("kvoffload.offload.worker.copy.")}
    assert roots <= documented | {
        "kvoffload.demo",
        "kvoffload.integrations",
        "kvoffload.integrations.vllm",
    }, sorted(roots)
