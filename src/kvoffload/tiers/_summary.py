"""One phrase per tier for an engine's start line: its kind, where it lives, its capacity, what a restart found."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from kvoffload._generated import CustomTierConfig, FsTierConfig, ObjTierConfig, SecondaryTierConfig, ValkeyTierConfig
from kvoffload.tiers._base import SecondaryTier
from kvoffload.tiers._fs import FsTier

__all__ = ["describe_tier", "redact_url"]


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (a url without one is returned as is)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    if password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def count_records(directory: str | os.PathLike[str]) -> int:
    """Record files (``*.bin``) in a disk tier's namespace directory (0 when it cannot be read)."""
    found = 0
    with contextlib.suppress(OSError), os.scandir(directory) as subdirs:
        for sub in subdirs:
            if sub.name.startswith(".") or not sub.is_dir():
                continue
            with contextlib.suppress(OSError), os.scandir(sub.path) as entries:
                found += sum(1 for e in entries if e.name.endswith(".bin") and not e.name.startswith("."))
    return found


def _valkey_capacity(instance: SecondaryTier | None) -> str:
    """The server's ``maxmemory`` and policy, asked once (``unknown`` when the server does not say)."""
    from kvoffload.tiers._valkey import ValkeyTier

    if not isinstance(instance, ValkeyTier):
        return "unknown"
    try:
        client = instance.raw_client()
        memory = client.config_get("maxmemory").get("maxmemory")
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    except Exception:  # a server that refuses CONFIG (ACLs, a managed service) or is not there
        return "unknown"
    memory = memory.decode() if isinstance(memory, bytes) else memory
    policy = policy.decode() if isinstance(policy, bytes) else policy
    return f"maxmemory={memory or 0} ({policy or 'unknown'})"


def describe_tier(
    index: int, config: SecondaryTierConfig, instances: Sequence[SecondaryTier], unusable: str | None
) -> str:
    """``[0] fs root_dir=/var/tmp/kvo max_bytes=unlimited, 12 records found``: one tier, for a start line.

    ``instances`` are the scheduler's lookup instances (one per rank namespace); a disk tier's records are counted
    in their namespace directories. ``unusable`` says why the tier could not be used at start.
    """
    if isinstance(config, FsTierConfig):
        dirs = [Path(t.dir) for t in instances if isinstance(t, FsTier)]
        records = sum(count_records(d) for d in dirs)
        limit = "unlimited" if config.max_bytes is None else str(config.max_bytes)
        text = f"fs root_dir={config.root_dir} max_bytes={limit}, {records} records found"
        if len(dirs) > 1:
            text += f" in {len(dirs)} rank namespaces"
    elif isinstance(config, ValkeyTierConfig):
        where = redact_url(config.url) if config.url else "embedded"
        capacity = "unknown" if unusable else _valkey_capacity(instances[0] if instances else None)
        text = f"valkey url={where}{' cluster' if config.cluster else ''} capacity {capacity}"
        if config.max_bytes is not None:
            text += f", max_bytes={config.max_bytes} per rank"
    elif isinstance(config, ObjTierConfig):
        store = config.store_config
        prefix = f" prefix={config.prefix}" if config.prefix else ""
        limit = "unlimited" if config.max_bytes is None else f"{config.max_bytes} per rank"
        text = f"obj {store.endpoint_override}/{store.bucket}{prefix} max_bytes={limit}"
    elif isinstance(config, CustomTierConfig):
        text = f"{config.tier_type or 'custom'} {config.module_path}.{config.class_name}"
    else:
        text = type(config).__name__
    if unusable:
        text += f", unusable at start: {unusable}"
    return f"[{index}] {text}"
