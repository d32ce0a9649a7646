"""``kv_connector_extra_config`` decoded strictly: the connector's own keys and the secondary tiers."""

from __future__ import annotations

from collections.abc import Mapping

from kvoffload._generated import TieringConfig, ValkeyTierConfig, VLLMConnectorConfig
from kvoffload.assembly import decode_extra_config, tiering_of
from kvoffload.errors import ConfigError
from kvoffload.tiers import tiering_config_from_extra

_UNSUPPORTED_KEYS = {
    "spec_module_path": "out-of-tree offloading specs are vLLM's; kvoffload's connector is its own spec",
}


def parse_connector_config(extra: Mapping[str, object]) -> VLLMConnectorConfig:
    """Decode ``kv_connector_extra_config`` strictly: an unknown, misspelled or mistyped key is a ConfigError.

    vLLM's OffloadingConnector keys that kvoffload does not implement are refused with the reason.
    """
    for key, why in _UNSUPPORTED_KEYS.items():
        if key in extra:
            raise ConfigError(f"kv_connector_extra_config[{key!r}] is not supported by KVOffloadConnector: {why}")
    options = decode_extra_config(extra)
    if options.spec_name not in (None, "CPUOffloadingSpec", "TieringOffloadingSpec"):
        raise ConfigError(
            f"kv_connector_extra_config['spec_name']={options.spec_name!r}: KVOffloadConnector implements "
            "'CPUOffloadingSpec' (the host pool) and 'TieringOffloadingSpec' (host pool + secondary_tiers)"
        )
    return options


def connector_tiering(options: VLLMConnectorConfig) -> TieringConfig:
    """The tiers of decoded connector options, every valkey tier with its url (see :func:`parse_tiering_config`)."""
    return check_tier_urls(tiering_of(options))


def parse_tiering_config(extra: Mapping[str, object]) -> TieringConfig:
    """The secondary tiers of ``kv_connector_extra_config`` (vLLM's keys), decoded strictly; empty without any.

    A ``valkey`` tier needs its ``url`` here: the scheduler and every worker are separate vLLM processes that
    must reach the same server (the embedded server is for single-process use and the demo).
    """
    return check_tier_urls(tiering_config_from_extra(extra))


def check_tier_urls(tiering: TieringConfig) -> TieringConfig:
    """``tiering`` itself, once every valkey tier is known to name its server's url."""
    for i, tier in enumerate(tiering.secondary_tiers):
        if isinstance(tier, ValkeyTierConfig) and not tier.url:
            raise ConfigError(
                f"secondary_tiers[{i}] (valkey): 'url' is required with the vLLM connector (valkey://host:port/db, "
                "unix://path, rediss://...): vLLM's scheduler and workers must reach the same server"
            )
    return tiering
