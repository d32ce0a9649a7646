"""Can a translated snapshot actually run? Checks the translator (like vLLM's) lets through.

vLLM 0.33's ``build_offloading_config`` accepts some snapshots that then fail later, when the connector builds
its host pool, its cache policy or its workers. :func:`validate_runnable` runs those later checks up front,
after a successful translation, so ``kvoffload translate``, :class:`~kvoffload.runtime.cluster.WorkerCluster`
and the demo refuse such a snapshot with one :class:`~kvoffload.errors.ConfigError` naming the field and value.
It is deliberately separate from the translator, which must keep answering exactly as vLLM does.

What it covers (each one a value the runtime cannot work with):

* ``parallel_config.rank`` must lie in ``[0, world_size)``;
* ``kv_connector_extra_config["cpu_bytes_to_use"]``, when given, must be a whole number of bytes > 0 that holds at
  least one chunk row (a missing budget is left to whoever sizes the pool: vLLM requires it then, the demo
  supplies a default);
* ``kv_connector_extra_config["eviction_policy"]``, when given, must name a registered cache policy;
* ``kv_cache_config.kv_cache_tensors`` must hold at least one engine-resident tensor (no KV memory, nothing to
  copy).

It does not judge whether the tensors' placement matches the specs' page sizes: vLLM's recorded cases include
synthetic snapshots where they disagree, and a worker checks its own transfer layout when it starts (a failure
there reaches the scheduler as a WorkerFailure naming the cause). Of the 20 recorded cases vLLM 0.33.0 accepts
(tests/data/translate_cases.jsonl), the 3 without any KV tensor are refused, the 17 others pass.
"""

from __future__ import annotations

from kvoffload._generated import EngineSnapshot, OffloadingConfig
from kvoffload.errors import ConfigError, HostMemoryError
from kvoffload.offload.manager.policies import available_policies
from kvoffload.offload.pool import plan_host_pool_from_config

__all__ = ["validate_runnable"]


def validate_runnable(snapshot: EngineSnapshot, config: OffloadingConfig) -> None:
    """Raise :class:`ConfigError` naming the field and value when ``config`` (translated from ``snapshot``)
    cannot run: a rank outside the world, a non-positive or too small host budget, an unknown eviction
    policy, or no engine KV tensors. See the module docstring for the exact list."""
    parallel = snapshot.engine_config.parallel_config
    if not 0 <= parallel.rank < parallel.world_size:
        raise ConfigError(
            f"parallel_config.rank={parallel.rank} is outside world_size={parallel.world_size}: "
            f"ranks run from 0 to {parallel.world_size - 1}"
        )
    extra = config.extra_config
    if "cpu_bytes_to_use" in extra:
        _check_budget(extra["cpu_bytes_to_use"], config)
    if "eviction_policy" in extra:
        policy = extra["eviction_policy"]
        if not isinstance(policy, str) or policy not in available_policies():
            raise ConfigError(
                f"kv_connector_extra_config['eviction_policy']={policy!r} is not a known cache policy "
                f"(known: {', '.join(available_policies())})"
            )
    kv = snapshot.kv_cache_config
    if not any(not tensor.host_resident for tensor in kv.kv_cache_tensors):
        raise ConfigError(
            f"kv_cache_config.kv_cache_tensors holds {len(kv.kv_cache_tensors)} engine-resident tensors: there is "
            "no KV memory to offload from"
        )


def _check_budget(raw: object, config: OffloadingConfig) -> None:
    field = "kv_connector_extra_config['cpu_bytes_to_use']"
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ConfigError(f"{field}={raw!r} is not a number of bytes")
    try:
        budget = int(raw)
    except (ValueError, OverflowError):
        raise ConfigError(f"{field}={raw!r} is not a number of bytes") from None
    if budget <= 0:
        raise ConfigError(f"{field}={raw!r} must be > 0: it is the total host budget in bytes across all workers")
    try:
        plan_host_pool_from_config(config)
    except HostMemoryError as exc:
        raise ConfigError(f"{field}={raw!r} holds no chunk: {exc}") from None
