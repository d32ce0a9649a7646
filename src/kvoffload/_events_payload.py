"""Self-describing KV events (vLLM 0.33's ``self_describing_kv_events``): what each stored chunk holds.

The scheduler's events name a chunk by its offload key alone (vLLM's placeholder payload: the hash of the chunk's
last hash-block, no parent, no tokens, block size 0). With self-describing events an engine integration records,
when it plans a chunk's store, what the chunk holds (:func:`chunk_payload`: the hash of every engine block of the
chunk, at ``tokens_per_block`` granularity, the hash before the first, the chunk's token ids, the request's LoRA
adapter), and :class:`PayloadTracker` rewrites the events: the chunk's ``BlockStored`` carries that payload with
``block_size = tokens_per_block``, and its ``BlockRemoved`` names the same hashes. Only full-attention groups are
recorded (vLLM's rule: other groups keep placeholder events); every stored event carries the group's spec kind and
window (:func:`event_group_specs`, vLLM's ``get_kv_cache_spec_kind`` / ``get_kv_cache_spec_sliding_window``).

A payload lives from the store job that records it until the chunk has left every medium that announced it (the
host pool, ``CPU``; the tiers, ``STORAGE``). A store that fails (:meth:`PayloadTracker.store_failed`) drops it
unpublished; so does a reset of the pool, found by :meth:`PayloadTracker.forget_absent` (the pool announces no
removals then, and vLLM publishes none either).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvoffload._generated import (
    BlockRemoved,
    BlockStored,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVEvent,
    MambaSpec,
    Medium,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvoffload._ints import check_int
from kvoffload._packed import Int32Bytes, pack_int32
from kvoffload.errors import ConfigError
from kvoffload.offload.keys import BlockHash, OffloadKey, make_offload_key, offload_key_hash

__all__ = ["SWEEP_KEYS", "ChunkPayload", "GroupEventSpec", "PayloadTracker", "chunk_payload", "event_group_specs"]

SWEEP_KEYS = 32
"""Keys :meth:`PayloadTracker.forget_absent` checks per call when it is given a budget (a full pass takes
``len(tracker) / SWEEP_KEYS`` calls)."""


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    """What one offloaded chunk holds, as a self-describing ``BlockStored`` announces it."""

    block_hashes: tuple[BlockHash, ...]
    """The hash of each engine block of the chunk, in order (the last one is the chunk's key hash)."""
    parent_block_hash: BlockHash | None
    """The hash of the hash-block before the chunk; None for a request's first chunk."""
    token_ids: Int32Bytes
    """The chunk's token ids (packed int32)."""
    block_size: int
    """Tokens per entry of ``block_hashes``: the group's tokens per block."""
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class GroupEventSpec:
    """vLLM's description of a KV cache group in its events: the spec kind and the sliding window."""

    kind: str | None = None
    sliding_window: int | None = None


def chunk_payload(
    block_hashes: Sequence[BlockHash],
    token_ids: Sequence[int],
    chunk: int,
    *,
    tokens_per_hash: int,
    tokens_per_block: int,
    blocks_per_chunk: int,
    lora_id: int | None = None,
    lora_name: str | None = None,
) -> ChunkPayload:
    """The payload of chunk ``chunk`` of a request with these ``block_hashes`` (at ``tokens_per_hash``
    granularity, prefix-chained) and ``token_ids``.

    Block ``b``'s hash is that of its last hash-block (a chained hash fingerprints its whole prefix), the parent
    that of the hash-block before the chunk. Raises ConfigError naming the value when the geometry does not
    divide or the request has too few hashes or tokens for the chunk.
    """
    check_int("tokens_per_hash", tokens_per_hash, 1)
    check_int("tokens_per_block", tokens_per_block, 1)
    check_int("blocks_per_chunk", blocks_per_chunk, 1)
    check_int("chunk", chunk, 0)
    if tokens_per_block % tokens_per_hash:
        raise ConfigError(f"tokens_per_block={tokens_per_block} is not a multiple of tokens_per_hash={tokens_per_hash}")
    per_block = tokens_per_block // tokens_per_hash
    per_chunk = per_block * blocks_per_chunk
    first, end = chunk * per_chunk, (chunk + 1) * per_chunk
    if end > len(block_hashes):
        raise ConfigError(f"chunk={chunk} needs {end} block hashes, the request has {len(block_hashes)}")
    tokens = tokens_per_block * blocks_per_chunk
    if (chunk + 1) * tokens > len(token_ids):
        raise ConfigError(f"chunk={chunk} needs {(chunk + 1) * tokens} token ids, the request has {len(token_ids)}")
    return ChunkPayload(
        block_hashes=tuple(block_hashes[first + per_block - 1 : end : per_block]),
        parent_block_hash=block_hashes[first - 1] if first else None,
        token_ids=pack_int32(token_ids[chunk * tokens : (chunk + 1) * tokens]),
        block_size=tokens_per_block,
        lora_id=lora_id,
        lora_name=lora_name,
    )


def _kind(spec: KVCacheSpec) -> str:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = list(spec.kv_cache_specs.values())
        kinds = {_kind(s) for s in inner}
        if len(kinds) == 1:
            return kinds.pop()
        # vLLM groups MLA and the hidden-state cache under the full-attention base: such a mix is full attention.
        return "full_attention" if inner and all(isinstance(s, FullAttentionSpec) for s in inner) else "unknown"
    for cls, kind in _KINDS:
        if isinstance(spec, cls):
            return kind
    return "unknown"  # the circular buffer has no kind of its own in vLLM


_KINDS: tuple[tuple[type, str], ...] = (  # subclasses first, as vLLM's get_kv_cache_spec_kind
    (SlidingWindowMLASpec, "sliding_window_mla"),
    (MLAAttentionSpec, "mla_attention"),
    (FullAttentionSpec, "full_attention"),
    (ChunkedLocalAttentionSpec, "chunked_local_attention"),
    (SlidingWindowSpec, "sliding_window"),
    (MambaSpec, "mamba"),
)


def _window(spec: KVCacheSpec) -> int | None:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        windows = {_window(s) for s in spec.kv_cache_specs.values()}
        return windows.pop() if len(windows) == 1 else None
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def event_group_specs(kv_cache_config: KVCacheConfig) -> dict[int, GroupEventSpec]:
    """Each group's spec kind and sliding window as vLLM's events name them, by group id."""
    return {
        i: GroupEventSpec(_kind(g.kv_cache_spec), _window(g.kv_cache_spec))
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    }


@dataclass(slots=True)
class _Entry:
    payload: ChunkPayload
    job: int | None  # the store job that recorded the payload, until its chunk is announced stored in the pool
    media: set[Medium] = field(default_factory=set)  # where the chunk is announced stored

    @property
    def in_pool(self) -> bool:
        return self.job is not None or Medium.CPU in self.media


class PayloadTracker:
    """Chunk payloads from their store job to their last removal; rewrites placeholder events with them."""

    def __init__(self, group_specs: Mapping[int, GroupEventSpec] | None = None) -> None:
        self._specs = dict(group_specs or {})
        self._entries: dict[OffloadKey, _Entry] = {}
        self._jobs: dict[int, set[OffloadKey]] = {}
        self._in_pool = 0  # entries with a store in flight or announced in the host pool
        self._cursor: list[OffloadKey] = []

    def __len__(self) -> int:
        """Chunks whose payload is kept."""
        return len(self._entries)

    @property
    def in_pool(self) -> int:
        """Chunks with a recorded store in flight or announced stored in the host pool: a pool that holds fewer
        keys was reset (see :meth:`forget_absent`)."""
        return self._in_pool

    def payload(self, key: OffloadKey) -> ChunkPayload | None:
        """The payload kept for ``key``, or None."""
        entry = self._entries.get(key)
        return None if entry is None else entry.payload

    def media(self, key: OffloadKey) -> frozenset[Medium]:
        """Where ``key``'s chunk is announced stored (empty while its store is in flight, or when not kept)."""
        entry = self._entries.get(key)
        return frozenset() if entry is None else frozenset(entry.media)

    def record(self, key: OffloadKey, payload: ChunkPayload, job_id: int) -> None:
        """Store job ``job_id`` writes ``key``'s chunk: its events will carry ``payload``."""
        offload_key_hash(key)  # a ConfigError naming a malformed key
        check_int("job_id", job_id, 0)
        if not isinstance(payload, ChunkPayload):
            raise ConfigError(f"payload must be a ChunkPayload, got {payload!r}")
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = entry = _Entry(payload, None)
        else:
            entry.payload = payload
        self._set_job(key, entry, job_id)
        self._jobs.setdefault(job_id, set()).add(key)

    def store_failed(self, job_id: int) -> None:
        """Store job ``job_id`` failed: the payloads it recorded go, unpublished, unless announced elsewhere."""
        for key in self._jobs.pop(job_id, ()):
            entry = self._entries.get(key)
            if entry is not None and entry.job == job_id:
                self._set_job(key, entry, None, forget_job=False)
                self._drop_if_gone(key)

    def translate(self, events: Iterable[KVEvent]) -> list[KVEvent]:
        """The events with the payloads kept: a stored chunk's full payload, a removal fanned out to its hashes;
        placeholders for the rest (with the group's spec kind and window on stored events)."""
        out: list[KVEvent] = []
        emptied: list[OffloadKey] = []
        for event in events:
            if isinstance(event, BlockRemoved):
                out.append(self._removed(event, emptied))
            else:
                out.extend(self._stored(event))
        for key in emptied:  # only now: a removal may precede a tier's store of the same chunk in one batch
            self._drop_if_gone(key)
        return out

    def forget_absent(self, in_pool: Callable[[OffloadKey], bool], budget: int | None = None) -> int:
        """Forget the host-pool side of chunks the pool no longer holds (a reset drops every chunk silently):
        their pool residency and any store in flight; a chunk announced nowhere else goes. Checks every key, or
        ``budget`` keys (round robin across calls); returns how many keys it checked."""
        if budget is None:
            keys = list(self._entries)
        else:
            if not self._cursor:
                self._cursor = list(self._entries)
            keys = [self._cursor.pop() for _ in range(min(check_int("budget", budget, 0), len(self._cursor)))]
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.in_pool or in_pool(key):
                continue
            self._set_job(key, entry, None)
            self._set_media(entry, entry.media - {Medium.CPU})
            self._drop_if_gone(key)
        return len(keys)

    # -- transitions (each keeps the in-pool count) ---------------------------------------------------------

    def _set_job(self, key: OffloadKey, entry: _Entry, job: int | None, *, forget_job: bool = True) -> None:
        if forget_job and entry.job is not None and entry.job != job:
            keys = self._jobs.get(entry.job)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._jobs[entry.job]
        before = entry.in_pool
        entry.job = job
        self._in_pool += entry.in_pool - before

    def _set_media(self, entry: _Entry, media: set[Medium]) -> None:
        before = entry.in_pool
        entry.media = media
        self._in_pool += entry.in_pool - before

    def _drop_if_gone(self, key: OffloadKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.job is None and not entry.media:
            del self._entries[key]

    def _stored(self, event: BlockStored) -> list[KVEvent]:
        spec = self._specs.get(event.group_idx, GroupEventSpec())
        if event.block_size:  # it describes itself already: only the group's kind and window are added
            return [_stored_event(event, event.block_hashes, None, spec)]
        out: list[KVEvent] = []
        for block_hash in event.block_hashes:  # a placeholder names one chunk per hash
            key = make_offload_key(BlockHash(block_hash), event.group_idx)
            entry = self._entries.get(key)
            payload = None
            if entry is not None:
                payload = entry.payload
                if event.medium is Medium.CPU:
                    self._set_job(key, entry, None)
                self._set_media(entry, entry.media | {event.medium})
            out.append(_stored_event(event, (block_hash,), payload, spec))
        return out

    def _removed(self, event: BlockRemoved, emptied: list[OffloadKey]) -> BlockRemoved:
        hashes: list[bytes] = []
        for block_hash in event.block_hashes:
            key = make_offload_key(BlockHash(block_hash), event.group_idx)
            entry = self._entries.get(key)
            if entry is None:
                hashes.append(block_hash)
                continue
            hashes.extend(entry.payload.block_hashes)
            self._set_media(entry, entry.media - {event.medium})
            emptied.append(key)
        return BlockRemoved(block_hashes=tuple(hashes), group_idx=event.group_idx, medium=event.medium)


def _stored_event(
    event: BlockStored, block_hashes: tuple[bytes, ...], payload: ChunkPayload | None, spec: GroupEventSpec
) -> BlockStored:
    if payload is None:
        return BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            group_idx=event.group_idx,
            medium=event.medium,
            lora_id=event.lora_id,
            lora_name=event.lora_name,
            kv_cache_spec_kind=event.kv_cache_spec_kind or spec.kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window or spec.sliding_window,
        )
    return BlockStored(
        block_hashes=payload.block_hashes,
        parent_block_hash=payload.parent_block_hash,
        token_ids=payload.token_ids,
        block_size=payload.block_size,
        group_idx=event.group_idx,
        medium=event.medium,
        lora_id=payload.lora_id,
        lora_name=payload.lora_name,
        kv_cache_spec_kind=spec.kind,
        kv_cache_spec_sliding_window=spec.sliding_window,
    )
