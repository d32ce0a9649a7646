"""Private Valkey servers for the ``valkey`` tiers configured without a url."""

from __future__ import annotations

import msgspec

from kvoffload._generated import TieringConfig, ValkeyTierConfig
from kvoffload.tiers._valkey import EmbeddedValkey

__all__ = ["start_embedded_servers"]


def start_embedded_servers(
    tiering: TieringConfig, *, socket_dir: str | None = None
) -> tuple[TieringConfig, list[EmbeddedValkey]]:
    """Start a private Valkey server for each ``valkey`` tier without a url.

    Returns the config with the servers' urls filled in (give it to the workers) and the servers
    (``stop()`` them at the end).
    """
    servers: list[EmbeddedValkey] = []
    tiers = []
    for tier in tiering.secondary_tiers:
        if isinstance(tier, ValkeyTierConfig) and not tier.url:
            server = EmbeddedValkey(maxmemory=tier.embedded_maxmemory, socket_dir=socket_dir)
            servers.append(server)
            tier = msgspec.structs.replace(tier, url=server.url)
        tiers.append(tier)
    return msgspec.structs.replace(tiering, secondary_tiers=tuple(tiers)), servers
