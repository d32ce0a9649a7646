"""Offload keys and chunk arithmetic, byte-compatible with vLLM 0.33's offload keys and block hashes.

An *offload key* names one chunk of KV cache in the host pool: the engine's block hash of the chunk's
last hash-block followed by the KV-cache group id as 4 big-endian unsigned bytes (the same packing as
vLLM's ``make_offload_key`` and the prefix cache's ``BlockHashWithGroupId``). Because block hashes are
prefix-chained, the last hash of a chunk fingerprints the whole token prefix up to the chunk's end.

:func:`hash_token_blocks` is a reference block hasher for engines that do not hash their own blocks; it
is deterministic across processes and machines, but it is *not* vLLM's hasher, so keys it produces only
match keys produced by the same function.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

import xxhash

from kvoffload._ints import check_int
from kvoffload.errors import ConfigError

__all__ = [
    "DEFAULT_HASH_SEED",
    "GROUP_ID_BYTES",
    "MAX_GROUP_ID",
    "BlockHash",
    "OffloadKey",
    "chunk_keys",
    "hash_token_blocks",
    "hashes_per_chunk",
    "key_tag",
    "key_tags",
    "make_offload_key",
    "offload_key_group",
    "offload_key_hash",
]

BlockHash = NewType("BlockHash", bytes)
"""An engine's hash of one hash-block of tokens, chained over the prefix (what :func:`hash_token_blocks` returns).

Distinct from :data:`OffloadKey` for the type checker: a block hash names tokens, an offload key names a chunk
of one KV-cache group in the host pool. Wrap an engine's own hash bytes with ``BlockHash(h)``.
"""

OffloadKey = NewType("OffloadKey", bytes)
"""The name of one chunk in the host pool: a :data:`BlockHash` followed by the 4-byte big-endian group id.

Built by :func:`make_offload_key` and :func:`chunk_keys`; taken by the host block manager, its cache policies
and the scheduler.
"""

GROUP_ID_BYTES = 4
"""Width of the group-id suffix of an offload key (big-endian, unsigned)."""

MAX_GROUP_ID = 2**32 - 1
"""Largest group id that fits the 4-byte suffix."""

DEFAULT_HASH_SEED = b"kvoffload/block-hash/v1"
"""Seed of :func:`hash_token_blocks`: the parent of the first block is ``sha256(seed)``.

Changing the seed changes every hash, so two processes only share keys when they use the same seed;
bump the ``v1`` suffix if the token encoding ever changes.
"""

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def _group_suffix(group_id: int) -> bytes:
    """Encode a group id as the 4-byte key suffix, rejecting values that do not fit."""
    return check_int("group_id", group_id, 0, MAX_GROUP_ID).to_bytes(GROUP_ID_BYTES, "big")


def make_offload_key(block_hash: BlockHash, group_id: int) -> OffloadKey:
    """Return the offload key of ``block_hash`` in KV-cache group ``group_id`` (hash + 4-byte BE group id).

    ``group_id`` is the engine's KV-cache group id (not an index among offloaded groups), as in vLLM.
    """
    if not isinstance(block_hash, bytes):
        raise ConfigError(f"block_hash must be bytes, got {type(block_hash).__name__}")
    return OffloadKey(block_hash + _group_suffix(group_id))


def _check_key(key: bytes) -> None:
    """Reject values that cannot be offload keys (not bytes, or shorter than the group suffix)."""
    if not isinstance(key, bytes) or len(key) < GROUP_ID_BYTES:
        raise ConfigError(f"offload key must be bytes of length >= {GROUP_ID_BYTES}, got {key!r}")


def offload_key_hash(key: OffloadKey) -> BlockHash:
    """Return the block-hash part of an offload key (everything but the 4-byte group suffix)."""
    _check_key(key)
    return BlockHash(key[:-GROUP_ID_BYTES])


def offload_key_group(key: OffloadKey) -> int:
    """Return the KV-cache group id encoded in the last 4 bytes of an offload key."""
    _check_key(key)
    return int.from_bytes(key[-GROUP_ID_BYTES:], "big")


def hashes_per_chunk(tokens_per_block: int, blocks_per_chunk: int, tokens_per_hash: int) -> int:
    """Return the number of hash-blocks per chunk: ``tokens_per_block * blocks_per_chunk / tokens_per_hash``.

    The chunk must span a whole, non-zero number of hash-blocks, otherwise its key (the hash of its last
    hash-block) would not end on a chunk boundary; anything else raises :class:`ConfigError`.
    """
    tpb = check_int("tokens_per_block", tokens_per_block, 1)
    bpc = check_int("blocks_per_chunk", blocks_per_chunk, 1)
    tph = check_int("tokens_per_hash", tokens_per_hash, 1)
    tokens_per_chunk = tpb * bpc
    if tokens_per_chunk % tph:
        raise ConfigError(
            f"tokens per chunk ({tpb} tokens_per_block x {bpc} blocks_per_chunk = {tokens_per_chunk}) "
            f"is not a multiple of tokens_per_hash={tph}"
        )
    return tokens_per_chunk // tph


def chunk_keys(
    block_hashes: Sequence[BlockHash], group_id: int, hashes_per_chunk: int, start_chunk: int = 0
) -> list[OffloadKey]:
    """Return the offload keys of the complete chunks from ``start_chunk`` on.

    Chunk ``i`` is keyed by ``block_hashes[(i + 1) * hashes_per_chunk - 1]`` (its last hash-block), as in
    vLLM's ``update_offload_keys``; a trailing partial chunk gets no key until its last hash exists.
    """
    hpc = check_int("hashes_per_chunk", hashes_per_chunk, 1)
    check_int("start_chunk", start_chunk)
    suffix = _group_suffix(group_id)
    last = len(block_hashes)
    return [OffloadKey(block_hashes[i] + suffix) for i in range((start_chunk + 1) * hpc - 1, last, hpc)]


def hash_token_blocks(
    token_ids: Sequence[int],
    tokens_per_hash: int,
    *,
    parent: BlockHash | None = None,
    seed: bytes = DEFAULT_HASH_SEED,
) -> list[BlockHash]:
    """Hash each complete block of ``tokens_per_hash`` tokens into a prefix-chained sha256 digest.

    Block ``j`` hashes to ``sha256(h[j-1] || int64_le(t_0) || ... || int64_le(t_{n-1}))`` with
    ``h[-1] = parent`` (default ``sha256(seed)``), so each digest fingerprints the whole prefix. Pass the
    last hash of earlier blocks as ``parent`` to continue a sequence incrementally. A trailing partial
    block is not hashed. Token ids must fit a signed 64-bit integer.
    """
    tph = check_int("tokens_per_hash", tokens_per_hash, 1)
    if parent is None:
        if not isinstance(seed, bytes):
            raise ConfigError(f"seed must be bytes, got {type(seed).__name__}")
        prev = hashlib.sha256(seed).digest()
    elif isinstance(parent, bytes):
        prev = parent
    else:
        raise ConfigError(f"parent must be bytes or None, got {type(parent).__name__}")
    num_blocks = len(token_ids) // tph
    if num_blocks == 0:
        return []
    packer = struct.Struct(f"<{tph}q")
    sha256 = hashlib.sha256
    out: list[BlockHash] = []
    for j in range(num_blocks):
        block = token_ids[j * tph : (j + 1) * tph]
        try:
            payload = packer.pack(*block)
        except struct.error as exc:
            bad = next((t for t in block if not isinstance(t, int) or not _in_int64(t)), None)
            raise ConfigError(
                f"token_ids[{j * tph}:{(j + 1) * tph}] holds {bad!r}, which is not a signed 64-bit int"
            ) from exc
        prev = sha256(prev + payload).digest()
        out.append(BlockHash(prev))
    return out


def _in_int64(value: int) -> bool:
    """Tell whether ``value`` fits a signed 64-bit integer."""
    return _INT64_MIN <= value <= _INT64_MAX


def key_tag(key: bytes) -> int:
    """The 64-bit tag of an offload key (signed, to travel in an ``array<int64>``); never 0 (= untagged)."""
    value = xxhash.xxh3_64_intdigest(key)
    if value >= 1 << 63:
        value -= 1 << 64
    return value or 1


def key_tags(keys: Sequence[bytes]) -> list[int]:
    """:func:`key_tag` of each key."""
    return [key_tag(key) for key in keys]
