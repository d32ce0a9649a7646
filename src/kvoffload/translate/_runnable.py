"""Can a translated snapshot actually run? Checks the translator (like vLLM's) lets through.

vLLM 0.33's ``build_offloading_config`` accepts some snapshots that then fail later, when the connector builds
its host pool, its cache policy, its tiers or its workers. :func:`validate_runnable` runs those later checks up
front, after a successful translation, so ``kvoffload translate``,
:class:`~kvoffload.runtime.cluster.WorkerCluster` and the demo refuse such a snapshot with one
:class:`~kvoffload.errors.ConfigError` naming the field and value. It is deliberately separate from the
translator, which must keep answering exactly as vLLM does.

What it covers (each one a value the runtime cannot work with), in this order:

* ``parallel_config.rank`` must lie in ``[0, world_size)``, and ``world_size`` must be what vLLM derives it from:
  ``tensor_parallel_size x pipeline_parallel_size x prefill_context_parallel_size`` (times
  ``data_parallel_size`` with the ``external_launcher`` backend);
* ``kv_cache_config.kv_cache_tensors`` must hold at least one engine-resident tensor (no KV memory, nothing to
  copy), and their placement must hold every offloaded layer's page for every block: the very layout checks a
  worker makes when it starts (:func:`~kvoffload.offload.worker.copy.transfer_layout_from_config`: a layer in
  no tensor, a block stride smaller than the page, a page past the tensor's end, pages over the host slot);
* ``kv_connector_extra_config["cpu_bytes_to_use"]``, when given, must be a whole number of bytes > 0 that holds at
  least one chunk row (a missing budget is left to whoever sizes the pool: vLLM requires it then, the demo
  supplies a default);
* ``kv_connector_extra_config["eviction_policy"]``, when given, must name a registered cache policy, or with
  ``cache_policy_module_path`` a :class:`~kvoffload.CachePolicy` subclass of that module (imported here);
* the other connector options in ``kv_connector_extra_config`` must have the types the connector decodes them
  with (:class:`~kvoffload.VLLMConnectorConfig`): vLLM's translator reads ``block_size`` with ``int()``, so
  ``"32"`` or ``32.5`` translate, but the connector takes only an int; keys it does not know are left to it;
* ``secondary_tiers`` / ``backpressure`` / ``tier_poll_interval_s`` must decode as tier configs
  (:func:`~kvoffload.tiers.tiering_config_from_extra`).

Of the 20 recorded cases vLLM 0.33.0 accepts (tests/data/translate_cases.jsonl), 10 synthetic snapshots cannot
run and are refused: the 3 without any KV tensor, 2 whose world_size is not their TP x PP x PCP and 5 whose
tensors do not hold their specs' pages (the translator's output for all 20 is unchanged: it is vLLM's).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from kvoffload._generated import EngineSnapshot, OffloadingConfig, ParallelConfig, VLLMConnectorConfig
from kvoffload._placement import transfer_layout_from_config
from kvoffload.errors import ConfigError, HostMemoryError
from kvoffload.offload.manager.policies import available_policies, policy_factory
from kvoffload.offload.pool import host_budget, plan_host_pool_from_config
from kvoffload.tiers import tiering_config_from_extra
from kvoffload.translate._snapshot import with_value

__all__ = ["validate_runnable"]

_TIER_KEYS = frozenset({"secondary_tiers", "backpressure", "tier_poll_interval_s"})
_OWN_CHECKS = frozenset({"cpu_bytes_to_use"})  # checked by _check_budget, which also accepts vLLM's int()-able forms
_AT_KEY = re.compile(r" - at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_TIER_INDEX = re.compile(r"secondary_tiers\[(\d+)\]")


def validate_runnable(snapshot: EngineSnapshot, config: OffloadingConfig) -> None:
    """Raise :class:`ConfigError` naming the field and value when ``config`` (translated from ``snapshot``)
    cannot run: a rank outside the world or a world that is not TP x PP x PCP, no engine KV tensors or a
    placement that does not hold the pages, a non-positive or too small host budget, an unknown eviction
    policy, a mistyped connector option or an invalid tier config. See the module docstring for the list."""
    _check_parallel(snapshot.engine_config.parallel_config)
    kv = snapshot.kv_cache_config
    if not any(not tensor.host_resident for tensor in kv.kv_cache_tensors):
        raise ConfigError(
            f"kv_cache_config.kv_cache_tensors holds {len(kv.kv_cache_tensors)} engine-resident tensors: there is "
            "no KV memory to offload from"
        )
    try:
        transfer_layout_from_config(kv, config)
    except ConfigError as exc:
        raise ConfigError(f"kv_cache_config cannot run: {exc}") from None
    extra = config.extra_config
    if "cpu_bytes_to_use" in extra:
        _check_budget(extra["cpu_bytes_to_use"], config)
    if "eviction_policy" in extra:
        _check_policy(extra["eviction_policy"], extra.get("cache_policy_module_path"))
    _check_options(extra)
    _check_tiers(extra)


def _check_parallel(parallel: ParallelConfig) -> None:
    if not 0 <= parallel.rank < parallel.world_size:
        raise ConfigError(
            f"parallel_config.rank={parallel.rank} is outside world_size={parallel.world_size}: "
            f"ranks run from 0 to {parallel.world_size - 1}"
        )
    sizes = {
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "prefill_context_parallel_size": parallel.prefill_context_parallel_size,
    }
    if parallel.distributed_executor_backend == "external_launcher":
        sizes["data_parallel_size"] = parallel.data_parallel_size
    expected = 1
    for size in sizes.values():
        expected *= size
    if parallel.world_size != expected:
        product = " x ".join(f"{name}={size}" for name, size in sizes.items())
        raise ConfigError(
            f"parallel_config.world_size={parallel.world_size} is not {product} = {expected}: vLLM runs that many "
            "workers, one per rank"
        )


def _check_budget(raw: object, config: OffloadingConfig) -> None:
    field = "kv_connector_extra_config['cpu_bytes_to_use']"
    host_budget(raw, field)
    try:
        plan_host_pool_from_config(config)
    except HostMemoryError as exc:
        raise ConfigError(f"{field}={raw!r} holds no chunk: {exc}") from None


def _check_policy(policy: object, module_path: object) -> None:
    """A registered policy name, or (with ``cache_policy_module_path``) a CachePolicy class of that module."""
    if isinstance(policy, str) and module_path is not None and policy not in available_policies():
        if not isinstance(module_path, str):
            raise ConfigError(
                f"kv_connector_extra_config['cache_policy_module_path']={module_path!r} is not a module path"
            )
        policy_factory(policy, module_path)
        return
    if not isinstance(policy, str) or policy not in available_policies():
        raise ConfigError(
            f"kv_connector_extra_config['eviction_policy']={policy!r} is not a known cache policy "
            f"(known: {', '.join(available_policies())}; an out-of-tree one needs cache_policy_module_path)"
        )


def _check_options(extra: Mapping[str, object]) -> None:
    """The connector options the translator does not type-check, decoded as the connector decodes them."""
    fields = set(VLLMConnectorConfig.__struct_fields__) - _TIER_KEYS - _OWN_CHECKS
    known = {key: value for key, value in extra.items() if key in fields}
    try:
        msgspec.convert({**known, "cpu_bytes_to_use": 1}, VLLMConnectorConfig)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _AT_KEY.search(text)
        if match is None or match.group(1) not in known:
            raise ConfigError(f"kv_connector_extra_config: {text}") from None
        key = match.group(1)
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}]={known[key]!r} is not a valid connector option: "
            f"{text[: match.start()]}"
        ) from None


def _check_tiers(extra: Mapping[str, object]) -> None:
    if not _TIER_KEYS & extra.keys():
        return
    try:
        tiering_config_from_extra(extra)
    except ConfigError as exc:
        text = str(exc)
        match = _TIER_INDEX.match(text)
        tiers = extra.get("secondary_tiers")
        if match is not None and isinstance(tiers, list | tuple) and int(match.group(1)) < len(tiers):
            text = with_value(text, tiers[int(match.group(1))])
        raise ConfigError(f"kv_connector_extra_config: {text}") from None
