"""The connector's worker half: applies StepPlans to vLLM's KV tensors and reports back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
)

from kvoffload import wire
from kvoffload._generated import (
    KVCacheConfig,
    MambaSpec,
    OffloadingConfig,
    StepPlan,
    TieringConfig,
    UniformTypeKVCacheSpecs,
)
from kvoffload._packed import Int64Array
from kvoffload.assembly import WorkerParts, build_worker
from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm._messages import KVOffloadConnectorMetadata, KVOffloadWorkerMetadata
from kvoffload.offload.pool import HostPool
from kvoffload.offload.worker import OffloadWorker
from kvoffload.offload.worker.copy import transfer_layout_from_config


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
    shared_pool_id: str | None = None
    on_cpu: bool = True
    layerwise: bool = False
    worker: OffloadWorker | None = None
    parts: WorkerParts | None = None
    plan: StepPlan | None = None
    started: KVConnectorMetadata | None = None
    loads: dict[int, tuple[str, list[int], bool]] = field(default_factory=dict)  # job -> request, blocks, in-step
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
        self.parts = build_worker(
            self.config,
            flat,
            layout,
            tiering=self.tiering,
            checksums=self.checksums,
            shared_pool_id=self.shared_pool_id,
            layerwise=self.layerwise,
            layerwise_every_load=self.sync_loads,
            layerwise_hooked_groups=_attention_groups(self.config, self.kv_cache_config),
        )
        self.worker = self.parts.worker

    @property
    def pool(self) -> HostPool | None:
        """The rank's host pool, once ``register_kv_caches`` built it."""
        return None if self.parts is None else self.parts.pool

    def _worker(self) -> OffloadWorker:
        if self.worker is None:
            raise ConfigError("KVOffloadConnector: register_kv_caches was not called before the first step")
        return self.worker

    def start(self, meta: KVConnectorMetadata) -> None:
        """Before the forward pass: submit deferred stores, flush, submit this step's loads (once per step)."""
        if not isinstance(meta, KVOffloadConnectorMetadata):
            raise ConfigError(f"KVOffloadConnector got foreign connector metadata {type(meta).__name__}")
        if self.pool is not None:
            self.pool.hold_prefault()  # the forward pass starts: populating pool pages would compete with it
        if meta is self.started:  # handle_preemptions and start_load_kv both start the same step
            return
        plan = wire.decode([meta.plan]).expect(StepPlan)
        self.started = meta
        if self.plan is not None and self.plan.step == plan.step:
            return  # the same step's metadata as another object
        self.plan = plan
        for job in plan.load_jobs:
            self.loads[job.job_id] = (
                job.req_id,
                Int64Array.from_buffer(job.block_ids).tolist(),
                self.sync_loads or job.sync,
            )
        self._worker().start_step(plan)

    def wait_loads(self) -> None:
        """Before the forward pass: wait for the loads it reads (every load with load_mode='sync', else the jobs
        the scheduler made synchronous under sync_load_budget_bytes)."""
        if self.plan is None or not self.plan.load_jobs:
            return
        if self.layerwise:  # each hooked layer is waited for when the forward pass reaches it (wait_layer)
            self._worker().wait_for_step_loads(self.plan, every_load=self.sync_loads)
            return
        if self.sync_loads:
            self._worker().wait_for_loads(self.plan)
            return
        in_step = [job.job_id for job in self.plan.load_jobs if job.sync]
        if in_step:
            self._worker().engine.wait(in_step)

    def wait_layer(self, layer_name: str) -> None:
        """Layer-wise loads: the forward pass is about to read layer ``layer_name``."""
        if self.layerwise and self.worker is not None:
            self.worker.wait_for_layer(layer_name)

    def save_layer(self, layer_name: str) -> None:
        """Layer-wise stores: layer ``layer_name`` of this step's KV is written."""
        if self.layerwise and self.worker is not None:
            self.worker.store_layer(layer_name)

    def end(self) -> None:
        """After the forward pass: queue the step's stores; the pool's prefault goes on."""
        if self.pool is not None:
            self.pool.release_prefault()
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
            self.worker.wait_in_flight()
            self.worker.wait_for_promotions()
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
            req_id, blocks, in_step = entry
            if not result.success:
                # vLLM maps failed block ids back to requests only for single-group models; hybrid models
                # report the request instead (asynchronous loads only, enforced at start).
                if self.multi_group:
                    results.failed.add(_vllm_request_id(req_id))
                else:
                    self.failed_blocks.update(blocks)
            if not in_step:  # vLLM waits for finished_recving of asynchronous loads only
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
        if self.parts is not None:
            self.parts.close()


def _attention_groups(config: OffloadingConfig, kv_cache_config: KVCacheConfig) -> list[int]:
    """The offloaded groups (config order) whose layers vLLM's attention calls the per-layer connector hooks for
    (``wait_for_layer_load`` / ``save_kv_layer``); Mamba mixers call none."""

    def attention(spec: object) -> bool:
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return all(attention(s) for s in spec.kv_cache_specs.values())
        return not isinstance(spec, MambaSpec)

    groups = kv_cache_config.kv_cache_groups
    return [i for i, g in enumerate(config.groups) if attention(groups[g.group_id].kv_cache_spec)]


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
