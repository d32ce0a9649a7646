"""Reading the tiering config from ``kv_connector_extra_config`` and opening the configured tiers.

``secondary_tiers``, ``backpressure`` and ``tier_poll_interval_s`` are vLLM's key names. Decoding is strict:
an unknown key or a bad value is a :class:`ConfigError` that names the tier (``secondary_tiers[1] (fs)``) and
the key. vLLM's out-of-tree form ``{"type": "MyTier", "module_path": "pkg.mod", **kwargs}`` is rewritten to
``{"type": "custom", "class_name": "MyTier", "module_path": "pkg.mod", "options": kwargs}``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import cast

import msgspec

from kvoffload._generated import (
    BackpressureConfig,
    CustomTierConfig,
    FsTierConfig,
    SecondaryTierConfig,
    TieringConfig,
    ValkeyTierConfig,
)
from kvoffload.errors import ConfigError
from kvoffload.tiers._base import SecondaryTier, TierBase
from kvoffload.tiers._namespace import Namespace

__all__ = ["TIERING_KEYS", "open_tier", "tier_from_cli", "tiering_config_from_extra"]

TIERING_KEYS = ("secondary_tiers", "backpressure", "tier_poll_interval_s")
_BUILTIN = {"fs", "valkey", "custom"}


def _normalize_tier(i: int, raw: object) -> object:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"secondary_tiers[{i}] must be a table/object, got {raw!r}")
    kind = raw.get("type")
    if isinstance(kind, str) and kind not in _BUILTIN and "module_path" in raw:
        rest = {k: v for k, v in raw.items() if k not in ("type", "module_path", "backpressure")}
        out: dict[str, object] = {
            "type": "custom",
            "class_name": kind,
            "module_path": raw["module_path"],
            "options": rest,
        }
        if "backpressure" in raw:
            out["backpressure"] = raw["backpressure"]
        return out
    if kind not in _BUILTIN:
        raise ConfigError(
            f"secondary_tiers[{i}]: type={kind!r} is not one of fs, valkey, custom "
            "(an out-of-tree tier also needs module_path)"
        )
    return dict(raw)


VALKEY_SCHEMES = ("valkey://", "valkeys://", "redis://", "rediss://", "unix://")
"""The url schemes the Valkey client takes (TLS: ``valkeys``/``rediss``; a local socket: ``unix``)."""


def tiering_config_from_extra(extra: Mapping[str, object]) -> TieringConfig:
    """The :class:`TieringConfig` held in a connector extra config (empty when it has no tiering keys)."""
    raw_tiers = extra.get("secondary_tiers", [])
    if not isinstance(raw_tiers, list | tuple):
        raise ConfigError(f"secondary_tiers must be a list of tier tables, got {raw_tiers!r}")
    tiers: list[SecondaryTierConfig] = []
    for i, raw in enumerate(raw_tiers):
        doc = _normalize_tier(i, raw)
        kind = cast(Mapping[str, object], doc).get("type")
        try:
            tier = msgspec.convert(doc, SecondaryTierConfig, strict=True)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"secondary_tiers[{i}] ({kind}): {exc}") from None
        if isinstance(tier, ValkeyTierConfig) and tier.url and not tier.url.startswith(VALKEY_SCHEMES):
            raise ConfigError(
                f"secondary_tiers[{i}] (valkey): url={tier.url!r} is not a valkey url "
                f"({', '.join(s + '...' for s in VALKEY_SCHEMES)})"
            )
        tiers.append(tier)
    top: dict[str, object] = {
        k: extra[k] for k in ("backpressure", "tier_poll_interval_s", "start_degraded") if k in extra
    }
    try:
        rest = msgspec.convert(top, TieringConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"tiering config: {exc}") from None
    return msgspec.structs.replace(rest, secondary_tiers=tuple(tiers))


def tier_backpressure(config: SecondaryTierConfig) -> BackpressureConfig | None:
    """The per-tier backpressure overrides of a tier config."""
    return config.backpressure


def open_tier(
    config: SecondaryTierConfig, namespace: Namespace, *, url_override: str | None = None, lookups_only: bool = False
) -> SecondaryTier:
    """Open the tier ``config`` describes for ``namespace`` (``url_override``: an embedded server's url).

    ``lookups_only``: the scheduler's instances only answer lookups (a disk tier then neither indexes nor
    evicts: the workers' instances own the records).
    """
    if isinstance(config, FsTierConfig):
        from kvoffload.tiers._fs import FsTier

        return FsTier(
            config.root_dir,
            namespace,
            n_read_threads=config.n_read_threads,
            n_write_threads=config.n_write_threads,
            max_bytes=config.max_bytes,
            use_odirect=config.use_odirect,
            fsync=config.fsync,
            file_mode=config.file_mode,
            scan=not lookups_only,
        )
    if isinstance(config, ValkeyTierConfig):
        from kvoffload.tiers._valkey import ValkeyTier

        url = url_override or config.url
        if not url:
            raise ConfigError("valkey tier: url is None and no embedded server was started for it")
        ssl = {k: v for k, v in config.ssl_options.items() if isinstance(v, str | bool)}
        return ValkeyTier(
            url,
            namespace,
            cluster=config.cluster,
            key_prefix=config.key_prefix,
            n_read_threads=config.n_read_threads,
            n_write_threads=config.n_write_threads,
            batch_size=config.batch_size,
            socket_timeout_s=config.socket_timeout_s,
            password=config.password,
            username=config.username,
            ssl_options=ssl,
        )
    if isinstance(config, CustomTierConfig):
        try:
            module = importlib.import_module(config.module_path)
            cls = getattr(module, config.class_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"custom tier: cannot import {config.class_name!r} from module_path={config.module_path!r}: {exc}"
            ) from exc
        # As vLLM checks a tier class against its base class: having the right attribute names is not enough
        # (a mock has them all); the class must be a TierBase or declare the SecondaryTier protocol.
        if not isinstance(cls, type) or not (issubclass(cls, TierBase) or SecondaryTier in cls.__mro__):
            raise ConfigError(
                f"custom tier {config.module_path}.{config.class_name} must be a class deriving from "
                f"kvoffload.tiers.TierBase (or declaring kvoffload.tiers.SecondaryTier), got {cls!r}"
            )
        tier = cls(namespace=namespace, **dict(config.options))
        if not isinstance(tier, SecondaryTier):
            raise ConfigError(f"custom tier {config.class_name!r} does not implement the SecondaryTier protocol")
        return tier
    raise ConfigError(f"unknown tier config {config!r}")


def tier_from_cli(text: str) -> SecondaryTierConfig:
    """``disk:PATH`` -> an fs tier in PATH; ``valkey`` -> an embedded server; ``valkey://...`` (any
    valkey/redis url) -> that server. ConfigError names the text otherwise."""
    if text.startswith("disk:") and len(text) > 5:
        return FsTierConfig(root_dir=text[5:])
    if text == "valkey":
        return ValkeyTierConfig()
    if text.startswith(VALKEY_SCHEMES):
        return ValkeyTierConfig(url=text)
    raise ConfigError(f"--tier={text!r}: use disk:PATH, valkey (embedded server) or a valkey://host:port url")
