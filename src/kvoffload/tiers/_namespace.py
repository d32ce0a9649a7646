"""Namespaces: which records a tier instance may read, derived from everything that shapes a chunk row.

Two engines share records only when their rows are byte-compatible: same model, cache dtype, hashing and
chunking, groups (tokens per block, layer names), page size, and (unless the offload is replicated,
``replicated_layout``: every rank of any parallel size holds the same bytes) the same parallel configuration and
rank. All of these go into a
canonical JSON document whose sha256 names the namespace (as vLLM's ``FileMapper`` does, extended with the
page size and the record format), so a different model, dtype, page size or parallel configuration never
reads another's records.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from kvoffload._generated import OffloadingConfig
from kvoffload.tiers._record import FORMAT_VERSION

__all__ = ["Namespace", "namespace_for", "namespaces_for_all_ranks"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True, slots=True)
class Namespace:
    """A namespace: a readable ``label`` (model name, rank), the ``digest`` and the fields it hashes."""

    label: str
    digest: str
    fields_json: str
    row_bytes: int

    @property
    def tag(self) -> bytes:
        """The 16 bytes every record of the namespace carries (a sha256 of its fields): a record read under
        another namespace's path is refused."""
        return hashlib.sha256(self.fields_json.encode()).digest()[:16]

    @property
    def dirname(self) -> str:
        """Directory (disk tier) or key prefix (Valkey tier) of the namespace: ``{label}_{digest}``."""
        return f"{self.label}_{self.digest}"


def namespace_for(config: OffloadingConfig, rank: int | None = None, *, row_bytes: int | None = None) -> Namespace:
    """The namespace of ``rank`` (default: ``config.parallel.rank``) for chunk rows of ``row_bytes``.

    ``row_bytes`` defaults to one rank's slot: ``worker_kv_bytes_per_block * blocks_per_chunk``.
    """
    rank = config.parallel.rank if rank is None else rank
    slot = config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk
    row = slot if row_bytes is None else row_bytes
    p = config.parallel
    fields: dict[str, object] = {
        "record_format": FORMAT_VERSION,
        "model": config.model.name,
        "dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [
            {"group_id": g.group_id, "tokens_per_block": g.tokens_per_block, "layer_names": list(g.layer_names)}
            for g in config.groups
        ],
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "row_bytes": row,
        "kv_cache_layout": config.kv_cache_layout,
        "replicated_layout": config.replicated_layout,
        "rank": 0 if config.replicated_layout else rank,
    }
    if not config.replicated_layout:
        # Every rank holds its own slice: only the same parallel configuration reads the same bytes. A replicated
        # layout holds the same bytes on every rank of any size, so (as vLLM's FileMapper) TP 2 writes what TP 4
        # reads.
        fields |= {"tp": p.tp_size, "pp": p.pp_size, "pcp": p.pcp_size, "dcp": p.dcp_size, "world_size": p.world_size}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    label = _UNSAFE.sub("_", config.model.name)[:80] or "model"
    label = f"{label}_r{fields['rank']}"
    return Namespace(label=label, digest=digest, fields_json=text, row_bytes=row)


def namespaces_for_all_ranks(config: OffloadingConfig) -> list[Namespace]:
    """One namespace per rank that holds its own bytes (a single one when the offload is replicated)."""
    ranks = [0] if config.replicated_layout else list(range(config.parallel.world_size))
    return [namespace_for(config, r) for r in ranks]
