"""Reading the tiering config from ``kv_connector_extra_config`` and opening the configured tiers.

``secondary_tiers``, ``backpressure`` and ``tier_poll_interval_s`` are vLLM's key names. Decoding is strict:
an unknown key or a bad value is a :class:`ConfigError` that names the tier (``secondary_tiers[1] (fs)``) and
the key. vLLM's out-of-tree form ``{"type": "MyTier", "module_path": "pkg.mod", **kwargs}`` is rewritten to
``{"type": "custom", "class_name": "MyTier", "module_path": "pkg.mod", "options": kwargs}``, and a type registered
with :func:`~kvoffload.tiers.register_tier_type` to the same form with ``tier_type`` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import msgspec

from kvoffload._generated import (
    BackpressureConfig,
    CustomTierConfig,
    FsTierConfig,
    ObjStoreConfig,
    ObjTierConfig,
    SecondaryTierConfig,
    TieringConfig,
    ValkeyTierConfig,
)
from kvoffload.errors import ConfigClassError, ConfigError, ConfigImportError
from kvoffload.tiers._base import SecondaryTier
from kvoffload.tiers._namespace import Namespace
from kvoffload.tiers._registry import (
    BUILTIN_TIER_TYPES,
    BuiltinTierConfig,
    import_tier_class,
    registered_tier_class,
    tier_type_names,
)

__all__ = ["TIERING_KEYS", "open_tier", "tier_from_cli", "tiering_config_from_extra"]

TIERING_KEYS = tuple(field.name for field in msgspec.structs.fields(TieringConfig))
"""The tiering keys of ``kv_connector_extra_config``: the fields of TieringConfig."""
_TOP_KEYS = tuple(key for key in TIERING_KEYS if key != "secondary_tiers")


def _normalize_tier(i: int, raw: object) -> object:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"secondary_tiers[{i}] must be a table/object, got {raw!r}")
    kind = raw.get("type")
    if not kind:
        raise ConfigError(f"secondary_tiers[{i}]: type={kind!r}: Secondary tier configuration must include 'type'")
    registered = registered_tier_class(kind) if isinstance(kind, str) and kind not in BUILTIN_TIER_TYPES else None
    if registered is not None or (isinstance(kind, str) and kind not in BUILTIN_TIER_TYPES and "module_path" in raw):
        rest = {k: v for k, v in raw.items() if k not in ("type", "module_path", "backpressure")}
        out: dict[str, object] = {"type": "custom", "options": rest}
        if registered is not None:  # the registry wins over a module_path, as in vLLM
            out.update(class_name=registered.__qualname__, module_path=registered.__module__, tier_type=kind)
        else:
            out.update(class_name=kind, module_path=raw["module_path"])
        if "backpressure" in raw:
            out["backpressure"] = raw["backpressure"]
        return out
    if kind not in BUILTIN_TIER_TYPES:
        names = tier_type_names()
        raise ConfigError(
            f"secondary_tiers[{i}]: type={kind!r} is not one of {', '.join(names)}: Unknown secondary tier type: "
            f"{kind!r}. Supported types: {names!r}. For an out-of-tree tier, also set 'module_path'."
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
        if isinstance(tier, ObjTierConfig):
            from kvoffload.tiers._obj import endpoint_url

            try:
                endpoint_url(tier.store_config)
            except ConfigError as exc:
                raise ConfigError(f"secondary_tiers[{i}] ({kind}): {exc}") from None
        if isinstance(tier, BuiltinTierConfig) and tier.locality not in (
            None,
            "LOCAL",
            "REMOTE",
        ):
            # vLLM builds Locality(value): case-sensitive (kv_load_tiers' filters are not)
            raise ConfigError(
                f"secondary_tiers[{i}] ({kind}): locality={tier.locality!r}: {tier.locality!r} is not a valid "
                "Locality (LOCAL or REMOTE)"
            )
        tiers.append(tier)
    top: dict[str, object] = {k: extra[k] for k in _TOP_KEYS if k in extra}
    try:
        rest = msgspec.convert(top, TieringConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"tiering config: {exc}") from None
    return msgspec.structs.replace(rest, secondary_tiers=tuple(tiers))


def tier_backpressure(config: SecondaryTierConfig) -> BackpressureConfig | None:
    """The per-tier backpressure overrides of a tier config."""
    return config.backpressure


def open_tier(
    config: SecondaryTierConfig,
    namespace: Namespace,
    *,
    url_override: str | None = None,
    lookups_only: bool = False,
    index: int | None = None,
) -> SecondaryTier:
    """Open the tier ``config`` describes for ``namespace`` (``url_override``: an embedded server's url).

    ``lookups_only``: the scheduler's instances only answer lookups (a tier then neither indexes the records
    already there nor evicts: the workers' instances own the records). ``index``: the tier's place in
    ``secondary_tiers``, named by errors (an out-of-tree class that cannot be imported is a
    :class:`~kvoffload.errors.ConfigImportError`).
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
            start_down=True,  # the engine's start-up check refuses it in one line, or starts degraded
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
            max_bytes=config.max_bytes,
            index_existing=not lookups_only,
        )
    if isinstance(config, ObjTierConfig):
        try:
            from kvoffload.tiers._obj import ObjTier
        except ImportError as exc:
            raise ConfigImportError(
                f"obj tier: its client is not installed ({exc}): pip install 'kvoffload[obj]' (obstore)"
            ) from exc

        return ObjTier(
            config.store_config,
            namespace,
            prefix=config.prefix,
            io_threads=config.io_threads,
            request_timeout_s=config.request_timeout_s,
            max_bytes=config.max_bytes,
            index_existing=not lookups_only,
        )
    if isinstance(config, CustomTierConfig):
        name = config.tier_type or config.class_name
        where = f"secondary_tiers[{index}] ({name})" if index is not None else f"custom tier {name!r}"
        # A registered type opens from this process's registry; a process that did not register it imports it.
        cls = registered_tier_class(config.tier_type) if config.tier_type else None
        if cls is None:
            cls = import_tier_class(config.module_path, config.class_name, where)
        tier = cls(namespace=namespace, **dict(config.options))
        if not isinstance(tier, SecondaryTier):
            raise ConfigClassError(f"custom tier {config.class_name!r} does not implement the SecondaryTier protocol")
        return tier
    raise ConfigError(f"unknown tier config {config!r}")


def tier_from_cli(text: str) -> SecondaryTierConfig:
    """``disk:PATH`` -> an fs tier in PATH; ``valkey`` -> an embedded server; ``valkey://...`` (any
    valkey/redis url) -> that server; ``obj:http(s)://HOST:PORT/BUCKET[/PREFIX]`` -> an object-store tier (keys
    from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``). ConfigError names the text otherwise."""
    if text.startswith("disk:") and len(text) > 5:
        return FsTierConfig(root_dir=text[5:])
    if text.startswith("obj:"):
        return _obj_from_url(text)
    if text == "valkey":
        return ValkeyTierConfig()
    if text.startswith(VALKEY_SCHEMES):
        return ValkeyTierConfig(url=text)
    raise ConfigError(
        f"--tier={text!r}: use disk:PATH, valkey (embedded server), a valkey://host:port url or "
        "obj:http://host:port/bucket"
    )


def _obj_from_url(text: str) -> ObjTierConfig:
    import os
    import urllib.parse

    parts = urllib.parse.urlsplit(text[4:])
    bucket, _, prefix = parts.path.strip("/").partition("/")
    if parts.scheme not in ("http", "https") or not parts.netloc or not bucket:
        raise ConfigError(f"--tier={text!r}: use obj:http(s)://host:port/bucket[/prefix]")
    store = ObjStoreConfig(
        bucket=bucket,
        endpoint_override=f"{parts.scheme}://{parts.netloc}",
        access_key=os.environ.get("AWS_ACCESS_KEY_ID", ""),
        secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY", ""),
        session_token=os.environ.get("AWS_SESSION_TOKEN", ""),
        region=os.environ.get("AWS_REGION", ""),
        scheme=parts.scheme,
    )
    return ObjTierConfig(store_config=store, prefix=prefix)
