"""``kv_connector_extra_config`` decoded strictly: the connector's own keys and the secondary tiers."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from kvoffload._generated import TieringConfig, ValkeyTierConfig, VLLMConnectorConfig
from kvoffload.errors import ConfigError
from kvoffload.tiers import tiering_config_from_extra

_UNSUPPORTED_KEYS = {
    "spec_module_path": "out-of-tree offloading specs are vLLM's; kvoffload's connector is its own spec",
    "cache_policy_module_path": "register the policy in-process with kvoffload.register_policy instead",
    "self_describing_kv_events": "only vLLM's placeholder KV events are published",
    "sync_load_budget_bytes": "use load_mode='sync' to load every hit inside the step",
}


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
