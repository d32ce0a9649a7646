"""Self-describing KV event payloads (``kvoffload._events_payload``): building a chunk's payload, vLLM's spec kinds,
and the tracker that keeps a payload from its store job to its chunk's last removal."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload import (
    BlockRemoved,
    BlockStored,
    ConfigError,
    DType,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVEvent,
    MambaSpec,
    Medium,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvoffload._events_payload import (
    ChunkPayload,
    GroupEventSpec,
    PayloadTracker,
    chunk_payload,
    event_group_specs,
)
from kvoffload._generated import ChunkedLocalAttentionSpec, CircularBufferSpec, HiddenStateCacheSpec
from kvoffload._packed import pack_int32, unpack_int32
from kvoffload.offload.keys import BlockHash, OffloadKey, make_offload_key, offload_key_hash
from tests.helpers import chained_hashes

# ------------------------------------------------------------------------------------------------------------
# chunk payloads
# ------------------------------------------------------------------------------------------------------------


def test_a_chunk_payload_names_each_block_by_its_last_hash_block() -> None:
    hashes = [BlockHash(h) for h in chained_hashes("r", 12)]  # tokens_per_hash 16: 192 tokens
    tokens = list(range(1000, 1192))
    # blocks of 32 tokens (2 hash blocks), chunks of 2 blocks (4 hash blocks, 64 tokens): chunk 1 = hashes 4..7
    payload = chunk_payload(hashes, tokens, 1, tokens_per_hash=16, tokens_per_block=32, blocks_per_chunk=2)
    assert payload.block_hashes == (hashes[5], hashes[7])
    assert payload.parent_block_hash == hashes[3]
    assert unpack_int32(payload.token_ids) == tokens[64:128]
    assert payload.block_size == 32 and payload.lora_id is None and payload.lora_name is None
    first = chunk_payload(hashes, tokens, 0, tokens_per_hash=16, tokens_per_block=16, blocks_per_chunk=1)
    assert (first.block_hashes, first.parent_block_hash, first.block_size) == ((hashes[0],), None, 16)
    assert unpack_int32(first.token_ids) == tokens[:16]


def test_chunk_payload_errors_name_the_value() -> None:
    hashes = [BlockHash(h) for h in chained_hashes("r", 4)]
    tokens = list(range(64))
    with pytest.raises(ConfigError, match=r"tokens_per_block=24 is not a multiple of tokens_per_hash=16"):
        chunk_payload(hashes, tokens, 0, tokens_per_hash=16, tokens_per_block=24, blocks_per_chunk=1)
    with pytest.raises(ConfigError, match=r"chunk=2 needs 6 block hashes, the request has 4"):
        chunk_payload(hashes, tokens, 2, tokens_per_hash=16, tokens_per_block=32, blocks_per_chunk=1)
    with pytest.raises(ConfigError, match=r"chunk=3 needs 64 token ids, the request has 60"):
        chunk_payload(hashes, tokens[:60], 3, tokens_per_hash=16, tokens_per_block=16, blocks_per_chunk=1)
    with pytest.raises(ConfigError, match=r"chunk must be an int >= 0, got -1"):
        chunk_payload(hashes, tokens, -1, tokens_per_hash=16, tokens_per_block=16, blocks_per_chunk=1)


# ------------------------------------------------------------------------------------------------------------
# vLLM's spec kinds and windows
# ------------------------------------------------------------------------------------------------------------


def _attn(cls: type, **kw: object) -> object:
    return cls(block_size=16, num_kv_heads=1, head_size=64, dtype=DType.FLOAT16, **kw)


def test_event_group_specs_follow_vllms_kinds() -> None:
    full = _attn(FullAttentionSpec)
    mla = _attn(MLAAttentionSpec)
    swa = _attn(SlidingWindowSpec, sliding_window=128)
    specs = [
        full,
        mla,
        _attn(HiddenStateCacheSpec),
        swa,
        _attn(SlidingWindowMLASpec, sliding_window=64),
        _attn(ChunkedLocalAttentionSpec, attention_chunk_size=256),
        MambaSpec(block_size=16, shapes=((4,),), dtypes=(DType.FLOAT32,)),
        _attn(CircularBufferSpec),
        UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": mla, "b": mla}),
        UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full, "b": mla}),
        UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full, "b": swa}),
        UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": swa, "b": swa}),
    ]
    kv = KVCacheConfig(
        num_blocks=1,
        kv_cache_tensors=(),
        kv_cache_groups=tuple(KVCacheGroupSpec(layer_names=(f"l{i}",), kv_cache_spec=s) for i, s in enumerate(specs)),  # type: ignore[arg-type]
    )
    assert list(event_group_specs(kv).values()) == [
        GroupEventSpec("full_attention", None),
        GroupEventSpec("mla_attention", None),
        GroupEventSpec("mla_attention", None),  # a marker subclass of MLA
        GroupEventSpec("sliding_window", 128),
        GroupEventSpec("sliding_window_mla", 64),
        GroupEventSpec("chunked_local_attention", None),
        GroupEventSpec("mamba", None),
        GroupEventSpec("unknown", None),  # the circular buffer has no kind of its own
        GroupEventSpec("mla_attention", None),
        GroupEventSpec("full_attention", None),  # one full-attention base
        GroupEventSpec("unknown", None),
        GroupEventSpec("sliding_window", 128),
    ]


# ------------------------------------------------------------------------------------------------------------
# the tracker, by example
# ------------------------------------------------------------------------------------------------------------


def _payload(tag: str, blocks: int = 2) -> ChunkPayload:
    hashes = tuple(BlockHash(h) for h in chained_hashes(tag, blocks + 1))
    return ChunkPayload(
        block_hashes=hashes[1:],
        parent_block_hash=hashes[0],
        token_ids=pack_int32(range(blocks * 16)),
        block_size=16,
        lora_id=3,
        lora_name="ad",
    )


def _key(payload: ChunkPayload, group: int = 0) -> OffloadKey:
    return make_offload_key(payload.block_hashes[-1], group)


def _stored(key: OffloadKey, medium: Medium = Medium.CPU) -> BlockStored:
    group = int.from_bytes(key[-4:], "big")
    return BlockStored(block_hashes=(offload_key_hash(key),), group_idx=group, medium=medium)


def _removed(*keys: OffloadKey, medium: Medium = Medium.CPU) -> BlockRemoved:
    group = int.from_bytes(keys[0][-4:], "big")
    return BlockRemoved(block_hashes=tuple(offload_key_hash(k) for k in keys), group_idx=group, medium=medium)


SPECS = {0: GroupEventSpec("full_attention", None), 1: GroupEventSpec("sliding_window", 128)}


def test_a_recorded_chunk_is_announced_with_its_payload_and_removed_by_its_hashes() -> None:
    tracker = PayloadTracker(SPECS)
    payload = _payload("a")
    key = _key(payload)
    tracker.record(key, payload, job_id=7)
    assert tracker.in_pool == 1 and tracker.media(key) == frozenset()
    (stored,) = tracker.translate([_stored(key)])
    assert stored == BlockStored(
        block_hashes=payload.block_hashes,
        parent_block_hash=payload.parent_block_hash,
        token_ids=payload.token_ids,
        block_size=16,
        group_idx=0,
        medium=Medium.CPU,
        lora_id=3,
        lora_name="ad",
        kv_cache_spec_kind="full_attention",
    )
    assert tracker.media(key) == {Medium.CPU}
    (removed,) = tracker.translate([_removed(key)])
    assert removed == BlockRemoved(block_hashes=payload.block_hashes, group_idx=0, medium=Medium.CPU)
    assert len(tracker) == 0 and tracker.in_pool == 0


def test_unknown_chunks_keep_placeholders_with_the_groups_kind() -> None:
    tracker = PayloadTracker(SPECS)
    key = make_offload_key(BlockHash(b"\x01" * 32), 1)
    (stored,) = tracker.translate([_stored(key)])
    assert stored.block_hashes == (b"\x01" * 32,) and stored.block_size == 0 and stored.token_ids == b""
    assert (stored.kv_cache_spec_kind, stored.kv_cache_spec_sliding_window) == ("sliding_window", 128)
    (removed,) = tracker.translate([_removed(key)])
    assert removed.block_hashes == (b"\x01" * 32,)
    assert len(tracker) == 0  # placeholders leave nothing behind


def test_a_tier_residency_keeps_the_payload_after_the_pool_evicts() -> None:
    tracker = PayloadTracker()
    payload = _payload("t")
    key = _key(payload)
    tracker.record(key, payload, job_id=1)
    # in one batch: stored in the pool, cascaded to a tier, evicted from the pool
    _, cascaded, removed = tracker.translate([_stored(key), _stored(key, Medium.STORAGE), _removed(key)])
    assert isinstance(cascaded, BlockStored) and cascaded.block_hashes == payload.block_hashes
    assert cascaded.medium is Medium.STORAGE
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == payload.block_hashes
    assert tracker.media(key) == {Medium.STORAGE} and tracker.in_pool == 0
    (gone,) = tracker.translate([_removed(key, medium=Medium.STORAGE)])
    assert gone.block_hashes == payload.block_hashes and len(tracker) == 0


def test_a_removal_before_a_tier_store_in_the_same_batch_keeps_the_payload() -> None:
    tracker = PayloadTracker()
    payload = _payload("o")
    key = _key(payload)
    tracker.record(key, payload, job_id=1)
    tracker.translate([_stored(key)])
    _, late = tracker.translate([_removed(key), _stored(key, Medium.STORAGE)])
    assert isinstance(late, BlockStored) and late.token_ids == payload.token_ids


def test_a_failed_store_drops_its_payloads_unpublished() -> None:
    tracker = PayloadTracker()
    payloads = [_payload("f0"), _payload("f1")]
    for p in payloads:
        tracker.record(_key(p), p, job_id=4)
    tracker.store_failed(5)  # another job: nothing
    assert len(tracker) == 2
    tracker.store_failed(4)
    assert len(tracker) == 0 and tracker.in_pool == 0
    tracker.store_failed(4)  # reported by a second worker: nothing left to do


def test_a_reset_is_found_by_the_pool_no_longer_holding_the_keys() -> None:
    tracker = PayloadTracker()
    kept, lost, pending = _payload("k"), _payload("l"), _payload("p")
    for i, p in enumerate((kept, lost)):
        tracker.record(_key(p), p, job_id=i)
        tracker.translate([_stored(_key(p))])
    tracker.translate([_stored(_key(kept), Medium.STORAGE)])
    tracker.record(_key(pending), pending, job_id=9)
    assert tracker.in_pool == 3
    assert tracker.forget_absent(lambda key: False) == 3
    assert tracker.payload(_key(lost)) is None and tracker.payload(_key(pending)) is None
    assert tracker.payload(_key(kept)) == kept and tracker.media(_key(kept)) == {Medium.STORAGE}
    assert tracker.in_pool == 0
    tracker.store_failed(9)  # the stale job's late failure changes nothing
    assert len(tracker) == 1


def test_a_budgeted_sweep_checks_every_key_round_robin() -> None:
    tracker = PayloadTracker()
    payloads = [_payload(f"s{i}") for i in range(5)]
    for p in payloads:
        tracker.record(_key(p), p, job_id=0)
    checked = [tracker.forget_absent(lambda key: False, budget=2) for _ in range(3)]
    assert checked == [2, 2, 1] and len(tracker) == 0


def test_bad_input_is_refused_naming_it() -> None:
    tracker = PayloadTracker()
    with pytest.raises(ConfigError, match="job_id must be an int >= 0, got -1"):
        tracker.record(_key(_payload("x")), _payload("x"), job_id=-1)
    with pytest.raises(ConfigError, match="payload must be a ChunkPayload"):
        tracker.record(_key(_payload("x")), "payload", job_id=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        tracker.record(OffloadKey(b"\x00"), _payload("x"), job_id=1)
    assert len(tracker) == 0


def test_self_describing_events_survive_the_wire_codec() -> None:
    from kvoffload import KVEventBatch, codecs

    tracker = PayloadTracker(SPECS)
    payload = _payload("w")
    tracker.record(_key(payload), payload, job_id=1)
    events = tracker.translate([_stored(_key(payload))])
    batch = KVEventBatch(ts=1.0, events=tuple(events))
    decoded = codecs.decode(codecs.encode(batch), KVEventBatch)
    assert decoded == batch
    (event,) = decoded.events
    assert isinstance(event, BlockStored) and (event.lora_name, event.kv_cache_spec_kind) == ("ad", "full_attention")
    assert msgspec.json.decode(codecs.encode(event, format="json"))["lora_id"] == 3


# ------------------------------------------------------------------------------------------------------------
# the tracker as a state machine: what the pool and the tiers announce, against a model of where chunks are
# ------------------------------------------------------------------------------------------------------------

_TAGS = [f"c{i}" for i in range(6)]
_MEDIA = [Medium.CPU, Medium.STORAGE]


class TrackerMachine(RuleBasedStateMachine):
    """Chunks move as the pool and tiers move them (store jobs that complete or fail, evictions, cascades, tier
    removals, silent resets); every announcement goes through the tracker. A payload is never lost (every
    announcement of a recorded chunk carries it) and never leaks (it is kept exactly while the chunk is pending
    or announced somewhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = PayloadTracker(SPECS)
        self.payloads = {tag: _payload(tag) for tag in _TAGS}
        self.keys = {tag: _key(p) for tag, p in self.payloads.items()}
        self.pending: dict[str, int] = {}  # tag -> job writing it into the pool
        self.media: dict[str, set[Medium]] = {tag: set() for tag in _TAGS}
        self.jobs = 0

    def _announce(self, events: list[KVEvent]) -> list[KVEvent]:
        out = self.tracker.translate(events)
        assert len(out) == len(events)
        return out

    @rule(tag=st.sampled_from(_TAGS))
    def start_store(self, tag: str) -> None:
        if tag in self.pending or Medium.CPU in self.media[tag]:
            return  # the pool never writes a key it holds
        self.jobs += 1
        self.pending[tag] = self.jobs
        self.tracker.record(self.keys[tag], self.payloads[tag], self.jobs)

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), ok=st.booleans())
    def finish_store(self, data: st.DataObject, ok: bool) -> None:
        tag = data.draw(st.sampled_from(sorted(self.pending)))
        job = self.pending.pop(tag)
        if not ok:
            self.tracker.store_failed(job)
            return
        (event,) = self._announce([_stored(self.keys[tag])])
        assert isinstance(event, BlockStored) and event.block_hashes == self.payloads[tag].block_hashes
        assert event.token_ids == self.payloads[tag].token_ids
        self.media[tag].add(Medium.CPU)

    @rule(tag=st.sampled_from(_TAGS))
    def cascade(self, tag: str) -> None:
        if Medium.CPU not in self.media[tag]:
            return
        (event,) = self._announce([_stored(self.keys[tag], Medium.STORAGE)])
        assert event.block_hashes == self.payloads[tag].block_hashes  # the payload reaches the tier's event
        self.media[tag].add(Medium.STORAGE)

    @rule(tag=st.sampled_from(_TAGS), medium=st.sampled_from(_MEDIA))
    def remove(self, tag: str, medium: Medium) -> None:
        if medium not in self.media[tag]:
            return
        (event,) = self._announce([_removed(self.keys[tag], medium=medium)])
        assert event.block_hashes == self.payloads[tag].block_hashes  # fanned out to the same hashes
        self.media[tag].discard(medium)

    @rule()
    def reset(self) -> None:
        """The pool drops everything without a word; the integration notices through the pool's contents."""
        self.pending.clear()
        for media in self.media.values():
            media.discard(Medium.CPU)
        self.tracker.forget_absent(lambda key: False)

    @rule(budget=st.integers(0, 3))
    def sweep(self, budget: int) -> None:
        """A budgeted sweep of a consistent pool changes nothing."""
        in_pool = {self.keys[t] for t in _TAGS if t in self.pending or Medium.CPU in self.media[t]}
        self.tracker.forget_absent(in_pool.__contains__, budget)

    @invariant()
    def kept_exactly_while_somewhere(self) -> None:
        for tag in _TAGS:
            alive = tag in self.pending or bool(self.media[tag])
            assert (self.tracker.payload(self.keys[tag]) is not None) == alive, tag
            assert self.tracker.media(self.keys[tag]) == self.media[tag], tag
        in_pool = sum(1 for t in _TAGS if t in self.pending or Medium.CPU in self.media[t])
        assert self.tracker.in_pool == in_pool
        assert len(self.tracker) == sum(1 for t in _TAGS if t in self.pending or self.media[t])


TrackerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40)
test_tracker_state_machine = TrackerMachine.TestCase
