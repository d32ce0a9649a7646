"""One assembly per side: the scheduler and the worker of an offloading setup, built the same way everywhere.

The runtime's worker processes, the demo and both halves of the vLLM connector build their parts here, so a
host pool, its manager, the tiers and the copy engine are wired together in one place:

* :func:`decode_extra_config`: ``kv_connector_extra_config`` decoded once, strictly, into the one options struct
  (:class:`~kvoffload.VLLMConnectorConfig`: host pool, policy, tiers, load mode, checksums) that every part reads.

* :func:`build_scheduler` (scheduler side, torch-free): the host block manager sized by the pool plan, the
  :class:`~kvoffload.offload.scheduler.OffloadScheduler`, and with secondary tiers the
  :class:`~kvoffload.tiers.Tiering` extension composed into it.
* :func:`build_worker` (worker side, torch): one rank's host pool, copy engine, tier worker and
  :class:`~kvoffload.offload.worker.OffloadWorker`, returned as :class:`WorkerParts` (close it once).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvoffload._generated import (
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    OffloadingConfig,
    TieringConfig,
    UniformTypeKVCacheSpecs,
    VLLMConnectorConfig,
)
from kvoffload.errors import ConfigError
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.pool import host_budget, plan_host_pool_from_config
from kvoffload.offload.scheduler import OffloadScheduler, SchedulerExtension

if TYPE_CHECKING:
    import torch

    from kvoffload.offload.pool import HostPool
    from kvoffload.offload.worker import OffloadWorker
    from kvoffload.offload.worker.copy import TransferLayout

__all__ = ["WorkerParts", "build_scheduler", "build_worker", "decode_extra_config", "tiering_of"]

_TIERING_FIELDS = tuple(field.name for field in msgspec.structs.fields(TieringConfig))
"""The tier keys of ``kv_connector_extra_config``: every field of TieringConfig, which VLLMConnectorConfig repeats."""
_TIER_KEYS = frozenset(_TIERING_FIELDS)


def decode_extra_config(extra: Mapping[str, object]) -> VLLMConnectorConfig:
    """``kv_connector_extra_config`` decoded strictly: an unknown, misspelled or mistyped key is a ConfigError.

    The tier keys go through :func:`~kvoffload.tiers.tiering_config_from_extra` (its shorthands and per-tier
    error messages); everything else is decoded by msgspec against the schema.
    """
    from kvoffload.tiers import tiering_config_from_extra  # the tier configs only: no tier client loads

    own = {k: v for k, v in extra.items() if k not in _TIER_KEYS}
    if own.get("cpu_bytes_to_use"):  # vLLM's int() rule: "268435456" is a budget too
        own["cpu_bytes_to_use"] = host_budget(own["cpu_bytes_to_use"], "kv_connector_extra_config['cpu_bytes_to_use']")
    try:
        options = msgspec.convert(own, VLLMConnectorConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None
    tiering = tiering_config_from_extra(extra)
    return msgspec.structs.replace(options, **{name: getattr(tiering, name) for name in _TIERING_FIELDS})


def tiering_of(options: VLLMConnectorConfig) -> TieringConfig:
    """The tiers of decoded connector options, as the tiering code takes them."""
    return msgspec.structs.replace(TieringConfig(), **{name: getattr(options, name) for name in _TIERING_FIELDS})


def build_scheduler(
    config: OffloadingConfig,
    options: VLLMConnectorConfig | None = None,
    *,
    tiering: TieringConfig | None = None,
    enable_events: bool = False,
    null_block_id: int | None = None,
    log: logging.Logger | None = None,
    chain_promotions: bool = False,
    kv_cache_config: KVCacheConfig | None = None,
    eagle_group_ids: Collection[int] | None = None,
) -> OffloadScheduler:
    """The scheduler of ``config``: its manager holds as many chunks as the host pool plan fits.

    ``options`` default to ``config.extra_config`` decoded (:func:`decode_extra_config`): the eviction policy
    (an out-of-tree one with ``cache_policy_module_path``), the store threshold, prompt-only stores, the
    pending-store and sync-load bounds and the tiers come from there. ``tiering`` replaces the options' tiers
    (e.g. with the urls of embedded servers filled in). With tiers (valkey tiers with their url), the tiers are
    composed in (``log``: where they report going down and coming back); ``close()`` the scheduler to release
    them.

    ``chain_promotions``: the engine's workers wait for a step's promotions within the step (CPU engines) and
    each rank promotes its own rows (no pool shared across ranks): a tier hit then loads in the same step as
    its promotion instead of answering "ask again later" for one step (needs ``promotion_wait_s`` > 0).

    ``kv_cache_config`` (the snapshot's, the one ``config`` was translated from) gives the scheduler the engine
    facts the plan does not carry: which offloaded groups are EAGLE draft groups (``is_eagle_group``), which are
    ``mamba_cache_mode="align"`` Mamba groups, and ``prefix_cache_retention_interval``. ``eagle_group_ids``
    replaces the EAGLE groups it names (a caller that knows the speculative config: vLLM treats a group as EAGLE
    only with ``speculative_config.use_eagle_block_drop()``, which a snapshot does not record; an engine that
    dumps its own snapshot sets ``is_eagle_group`` only then). Without either, no group is EAGLE or Mamba-align.
    """
    if options is None:
        options = decode_extra_config(config.extra_config)
    if tiering is None:
        tiering = tiering_of(options)
    num_chunks = plan_host_pool_from_config(config).num_chunks
    manager = HostBlockManager(
        num_chunks,
        options.eviction_policy,
        enable_events=enable_events,
        store_threshold=options.store_threshold,
        max_tracker_size=options.max_tracker_size,
        cache_policy_module_path=options.cache_policy_module_path,
    )
    extension: SchedulerExtension | None = None
    if tiering.secondary_tiers:
        from kvoffload.tiers import Tiering  # the tier clients load only when tiers are configured

        chain = chain_promotions and tiering.promotion_wait_s > 0
        extension = Tiering(config, manager, tiering, log=log, chain_promotions=chain)
    return OffloadScheduler(
        config,
        manager,
        offload_prompt_only=options.offload_prompt_only,
        null_block_id=null_block_id,
        extension=extension,
        max_recompute_pending_tokens=options.max_recompute_pending_tokens,
        sync_load_budget_bytes=options.sync_load_budget_bytes,
        eagle_group_ids=_eagle_groups(config, kv_cache_config) if eagle_group_ids is None else eagle_group_ids,
        mamba_align_group_ids=_mamba_align_groups(config, kv_cache_config),
        prefix_cache_retention_interval=None
        if kv_cache_config is None
        else kv_cache_config.prefix_cache_retention_interval,
    )


def _engine_group_specs(config: OffloadingConfig, kv: KVCacheConfig) -> list[tuple[int, KVCacheSpec, bool]]:
    """``(group id, spec, is_eagle_group)`` of each group ``config`` offloads, from the KV cache config."""
    groups = kv.kv_cache_groups
    out: list[tuple[int, KVCacheSpec, bool]] = []
    for g in config.groups:
        if g.group_id >= len(groups):
            raise ConfigError(
                f"kv_cache_config has {len(groups)} KV cache groups, but the offloading config offloads group "
                f"{g.group_id}: pass the KVCacheConfig the config was translated from"
            )
        group = groups[g.group_id]
        out.append((g.group_id, group.kv_cache_spec, group.is_eagle_group))
    return out


def _eagle_groups(config: OffloadingConfig, kv: KVCacheConfig | None) -> tuple[int, ...]:
    if kv is None:
        return ()
    return tuple(gid for gid, _, eagle in _engine_group_specs(config, kv) if eagle)


def _mamba_align_groups(config: OffloadingConfig, kv: KVCacheConfig | None) -> tuple[int, ...]:
    """Offloaded groups whose (first) layer spec is an align-mode Mamba spec, as vLLM's scheduler sees them (it
    gets the groups flattened: a wrapper stands for its first layer spec)."""
    if kv is None:
        return ()
    out: list[int] = []
    for gid, spec, _ in _engine_group_specs(config, kv):
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()), spec)
        if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
            out.append(gid)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class WorkerParts:
    """What :func:`build_worker` assembled: the worker (its copy engine and tiers inside) and its host pool."""

    worker: OffloadWorker
    pool: HostPool

    def close(self) -> None:
        """Stop the worker (in-flight copies finish, tiers close), then release the host pool."""
        try:
            self.worker.close()
        finally:
            self.pool.close()


def build_worker(
    config: OffloadingConfig,
    kv: torch.Tensor,
    layout: TransferLayout,
    *,
    tiering: TieringConfig | None = None,
    checksums: bool = True,
    cpu_threads: int | None = None,
    shared_pool_id: str | None = None,
    layerwise: bool = False,
    layerwise_every_load: bool = False,
    layerwise_hooked_groups: Collection[int] | None = None,
) -> WorkerParts:
    """One rank's worker over its engine KV memory ``kv`` (placed as ``layout`` says).

    The host pool follows ``config``'s plan (a shared ``/dev/shm`` pool when ``shared_pool_id`` names one);
    with a ``tiering`` that lists tiers, the rank's tier IO runs beside its copies. ``layerwise``: the loads a
    step reads (every load with ``layerwise_every_load``, else those marked ``sync``) and the step's stores are
    copied layer by layer (:meth:`OffloadWorker.wait_for_layer`, :meth:`OffloadWorker.store_layer`);
    ``layerwise_hooked_groups``: the offloaded groups (config order) whose layers the engine calls those hooks for
    (default all; the others are waited for before the forward pass). If any part fails to build, the parts
    already built are released.
    """
    from kvoffload.offload.pool import HostPool
    from kvoffload.offload.worker import OffloadWorker
    from kvoffload.offload.worker.copy import CopyEngine

    with contextlib.ExitStack() as undo:  # a part that fails to build releases the parts built before it
        pool = HostPool(plan_host_pool_from_config(config), engine_id=shared_pool_id)
        undo.callback(pool.close)
        engine = CopyEngine(kv, layout, pool, cpu_threads=cpu_threads, checksums=checksums)
        undo.callback(engine.close)
        layered = None
        if layerwise:
            from kvoffload.offload.worker import LayerwiseCopies

            layered = LayerwiseCopies(
                layout,
                kv,
                pool,
                checksums=checksums,
                every_load=layerwise_every_load,
                hooked_groups=layerwise_hooked_groups,
                cpu_threads=cpu_threads,
            )
            undo.callback(layered.close)
        tiers = None
        if tiering is not None and tiering.secondary_tiers:
            from kvoffload.tiers import TierWorker

            tiers = TierWorker(tiering, config, pool, checksums=checksums)
        worker = OffloadWorker(engine, rank=config.parallel.rank, tiers=tiers, layerwise=layered)
        undo.pop_all()
    return WorkerParts(worker=worker, pool=pool)
