"""Self-describing KV events (``self_describing_kv_events``) of the vLLM connector: the payload recorder on a real
OffloadScheduler, and a real vLLM engine whose published events carry the right token ids and chained hashes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvoffload import (
    BlockRemoved,
    BlockStored,
    DType,
    FullAttentionSpec,
    JobResult,
    KVCacheConfig,
    KVCacheGroupSpec,
    Medium,
    MissReason,
    SlidingWindowSpec,
    WorkerReport,
)
from kvoffload._packed import unpack_int32, unpack_int64
from kvoffload.assembly import build_scheduler
from kvoffload.offload.keys import make_offload_key
from tests.helpers import chained_hashes, offloading_config

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvoffload.integrations.vllm._config import parse_connector_config
from kvoffload.integrations.vllm._kv_events import SelfDescribingEvents, to_vllm_events
from tests.integrations.engines import run_script

TPB, BPC = 16, 2  # 16-token blocks (= the hash block), chunks of 32 tokens


def _config() -> Any:
    # group 0: full attention (described); group 1: a sliding window of 2 chunks (placeholders)
    return offloading_config(
        ((0, TPB, ("full",), None), (1, TPB, ("swa",), 2)),
        blocks_per_chunk=BPC,
        events=True,
        extra_config={"cpu_bytes_to_use": 64 * 1024 * 1024},
    )


def _kv() -> KVCacheConfig:
    full = FullAttentionSpec(block_size=TPB, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16)
    swa = SlidingWindowSpec(block_size=TPB, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16, sliding_window=32)
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=(),
        kv_cache_groups=(
            KVCacheGroupSpec(layer_names=("full",), kv_cache_spec=full),
            KVCacheGroupSpec(layer_names=("swa",), kv_cache_spec=swa),
        ),
    )


class _Engine:
    """A real OffloadScheduler and the recorder, driven as the connector's scheduler half drives them."""

    def __init__(self) -> None:
        config = _config()
        self.sched = build_scheduler(config, enable_events=True)
        self.events = SelfDescribingEvents(config, _kv())
        self.requests: dict[str, SimpleNamespace] = {}
        self.next_block = 1

    def add(self, sid: str, hashes: list[bytes], lora: SimpleNamespace | None = None) -> SimpleNamespace:
        """A request whose tokens follow from its hashes' chain (the same prefix, the same tokens)."""
        base = hashes[0][0] * 1000
        tokens = list(range(base, base + TPB * len(hashes)))
        request = SimpleNamespace(block_hashes=hashes, all_token_ids=tokens, lora_request=lora)
        self.requests[sid] = request
        self.sched.add_request(sid, hashes, len(tokens))
        blocks = [list(range(self.next_block + g * 100, self.next_block + g * 100 + len(hashes))) for g in (0, 1)]
        self.next_block += len(hashes)
        self.sched.on_blocks_allocated(sid, blocks)
        self.sched.on_tokens_computed(sid, len(tokens))
        return request

    def step(self, *, ok: bool = True) -> list[Any]:
        plan = self.sched.build_step_plan()
        self.events.on_plan(plan, self.requests, self.sched.manager)
        results = tuple(
            JobResult(job_id=j.job_id, success=ok, is_store=True, num_bytes=0, seconds=0.0) for j in plan.store_jobs
        )
        reports = [WorkerReport(rank=0, step=plan.step, results=results)]
        self.sched.on_worker_reports(reports)
        self.events.on_reports(reports)
        return self.events.take(self.sched.take_events(), self.sched.manager)


def test_stored_chunks_of_full_attention_carry_their_payload() -> None:
    engine = _Engine()
    hashes = chained_hashes("a", 8)  # 128 tokens: 4 chunks per group
    request = engine.add("a", hashes, SimpleNamespace(lora_int_id=5, lora_name="adapter"))
    events = engine.step()
    described = [e for e in events if isinstance(e, BlockStored) and e.group_idx == 0]
    placeholders = [e for e in events if isinstance(e, BlockStored) and e.group_idx == 1]
    assert len(described) == len(placeholders) == 4
    for chunk, event in enumerate(described):
        assert event.block_hashes == tuple(hashes[2 * chunk : 2 * chunk + 2])
        assert event.parent_block_hash == (hashes[2 * chunk - 1] if chunk else None)
        assert unpack_int32(event.token_ids) == request.all_token_ids[32 * chunk : 32 * chunk + 32]
        assert (event.block_size, event.lora_id, event.lora_name) == (TPB, 5, "adapter")
        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == ("full_attention", None)
    for chunk, event in enumerate(placeholders):  # the window group keeps vLLM's placeholders, with its kind
        assert event.block_hashes == (hashes[2 * chunk + 1],) and event.block_size == 0 and not event.token_ids
        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == ("sliding_window", 32)
    assert len(engine.events.tracker) == 4

    first, second = to_vllm_events(events[:2])  # as the scheduler half publishes them
    assert isinstance(first, VllmBlockStored) and first.medium == "CPU"
    assert first.token_ids == request.all_token_ids[:32]
    assert first.block_hashes == [maybe_convert_block_hash(h) for h in hashes[:2]]  # vLLM's own hash form
    assert isinstance(second, VllmBlockStored) and second.parent_block_hash == maybe_convert_block_hash(hashes[1])
    assert (first.lora_id, first.lora_name, first.kv_cache_spec_kind) == (5, "adapter", "full_attention")


def test_a_job_with_chunks_already_stored_is_matched_chunk_by_chunk() -> None:
    """Chunk 0 leaves the pool while 1 and 2 stay: a longer request's store job writes chunks 0 and 3 only."""
    engine = _Engine()
    hashes = chained_hashes("s", 8)
    engine.add("a", hashes[:6])  # chunks 0..2
    engine.step()
    assert engine.sched.forget_chunk(make_offload_key(hashes[1], 0), MissReason.CORRUPT)
    engine.sched.finish_request("a")
    removed = engine.events.take(engine.sched.take_events(), engine.sched.manager)
    assert [e.block_hashes for e in removed if isinstance(e, BlockRemoved)] == [tuple(hashes[:2])]  # fanned out
    request = engine.add("b", hashes)  # chunks 0..3; 1 and 2 are stored already
    plan = engine.sched.build_step_plan()
    (job,) = plan.store_jobs
    assert unpack_int32(job.group_sizes)[0] == 2 * BPC  # two chunks of group 0, not contiguous
    engine.events.on_plan(plan, engine.requests, engine.sched.manager)
    tracker = engine.events.tracker
    for chunk in range(4):
        payload = tracker.payload(make_offload_key(hashes[2 * chunk + 1], 0))
        assert payload is not None, chunk
        assert unpack_int32(payload.token_ids) == request.all_token_ids[32 * chunk : 32 * chunk + 32]
    assert len(unpack_int64(job.chunk_ids)) == 3  # group 0: chunks 0 and 3; the window group: chunk 3
    assert tracker.in_pool == 4  # chunks 1 and 2 (stored by a), 0 and 3 (pending in b's job)
    assert tracker.media(make_offload_key(hashes[3], 0)) == {Medium.CPU}
    result = JobResult(job_id=job.job_id, success=True, is_store=True, num_bytes=0, seconds=0.0)
    engine.sched.on_worker_reports([WorkerReport(rank=0, step=plan.step, results=(result,))])
    stored = engine.events.take(engine.sched.take_events(), engine.sched.manager)
    described = [e for e in stored if isinstance(e, BlockStored) and e.group_idx == 0]
    assert [e.block_hashes for e in described] == [tuple(hashes[0:2]), tuple(hashes[6:8])]
    assert described[1].parent_block_hash == hashes[5]


def test_a_failed_store_publishes_nothing_and_keeps_nothing() -> None:
    engine = _Engine()
    engine.add("a", chained_hashes("f", 4))
    assert engine.step(ok=False) == []
    assert len(engine.events.tracker) == 0 and engine.events.tracker.in_pool == 0


def test_a_reset_pool_drops_the_payloads() -> None:
    engine = _Engine()
    engine.add("a", chained_hashes("r", 8))
    engine.step()
    assert engine.events.tracker.in_pool == 4
    engine.sched.reset()
    assert engine.events.take(engine.sched.take_events(), engine.sched.manager) == []
    assert len(engine.events.tracker) == 0 and engine.events.tracker.in_pool == 0


def test_the_key_is_accepted_by_the_connector() -> None:
    options = parse_connector_config({"cpu_bytes_to_use": 1 << 20, "self_describing_kv_events": True})
    assert options.self_describing_kv_events is True
    assert parse_connector_config({"cpu_bytes_to_use": 1 << 20}).self_describing_kv_events is False


def test_vllm_removals_convert_with_their_hashes() -> None:
    (event,) = to_vllm_events([BlockRemoved(block_hashes=(b"a", b"b"), group_idx=2, medium=Medium.STORAGE)])
    assert isinstance(event, VllmBlockRemoved)
    hashes = [maybe_convert_block_hash(b"a"), maybe_convert_block_hash(b"b")]  # vLLM's form, placeholders too
    assert (event.block_hashes, event.group_idx, event.medium) == (hashes, 2, "STORAGE")


# ------------------------------------------------------------------------------------------------------------
# a real engine
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_engine_publishes_self_describing_events(tiny_model: Path, tmp_path: Path) -> None:
    result = run_script(Path(__file__).with_name("vllm_events_scenario.py"), tiny_model, tmp_path)
    events = [e for batch in result["batches"] for e in batch["events"]]
    tpb = result["tokens_per_block"]
    chunk_tokens = 64  # kv_connector_extra_config block_size
    ours = [e for e in events if e["medium"] == "CPU"]
    stored = [e for e in ours if e["type"] == "BlockStored"]
    removed = [e for e in ours if e["type"] == "BlockRemoved"]
    assert stored and removed, [e["type"] for e in events]
    # vLLM's own GPU-side events name every engine block by the same hashes: the reference for ours
    gpu_tokens: dict[int, list[int]] = {}
    for e in events:
        if e["type"] == "BlockStored" and e["medium"] in (None, "GPU"):
            for i, h in enumerate(e["block_hashes"]):
                gpu_tokens[h] = e["token_ids"][i * e["block_size"] : (i + 1) * e["block_size"]]
    assert gpu_tokens and all(isinstance(h, int) for h in gpu_tokens)  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    first_prompt = result["prompt_ids"][0]
    for e in stored:
        assert e["block_size"] == tpb and len(e["block_hashes"]) == chunk_tokens // tpb, e
        assert len(e["token_ids"]) == chunk_tokens and e["lora_id"] is None and e["lora_name"] is None
        assert e["kv_cache_spec_kind"] == "full_attention", e  # the connector knows its groups' kinds
        for i, h in enumerate(e["block_hashes"]):  # each block: vLLM's hash of exactly these tokens
            assert gpu_tokens[h] == e["token_ids"][i * tpb : (i + 1) * tpb]
    # the first prompt's chunks chain: chunk c's parent is chunk c-1's last block hash, its tokens the prompt's
    chain = [e for e in stored if e["token_ids"] == first_prompt[: len(e["token_ids"])]]
    assert chain and chain[0]["parent_block_hash"] is None
    full_chunks = len(first_prompt) // chunk_tokens
    assert full_chunks >= 2, len(first_prompt)
    walk = [chain[0]]
    while len(walk) < full_chunks:
        nxt = [e for e in stored if e["parent_block_hash"] == walk[-1]["block_hashes"][-1]]
        assert nxt, f"chunk {len(walk)} of the first prompt was not announced"
        walk.append(nxt[0])
    assert [t for e in walk for t in e["token_ids"]] == first_prompt[: full_chunks * chunk_tokens]
    # removals name every block hash of the chunks they evict (fan-out), and only hashes announced stored
    announced = {h for e in stored for h in e["block_hashes"]}
    removed_hashes = [h for e in removed for h in e["block_hashes"]]
    assert set(removed_hashes) <= announced
    evicted_first = [e for e in walk if e["block_hashes"][-1] in removed_hashes]
    assert evicted_first, "the fillers evicted none of the first prompt's chunks"
    for e in evicted_first:
        assert set(e["block_hashes"]) <= set(removed_hashes)
    # payloads are kept for exactly the chunks still in the host pool
    assert result["kept_payloads"] == result["in_pool"] <= result["pool_keys"]
