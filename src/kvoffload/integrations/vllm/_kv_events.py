"""The connector's KV events in vLLM's types, and their self-describing payloads (``self_describing_kv_events``).

vLLM publishes what the connector's ``take_events`` returns. By default those are vLLM's placeholder events (a
stored chunk named by its key hash alone). With KV cache events on and ``self_describing_kv_events`` the scheduler
half records, as each step plan's store jobs are known, what every stored chunk of a full-attention group holds
(its blocks' hashes, the parent hash, its token ids, the request's LoRA adapter: from the vLLM ``Request``), and
the events carry it (:mod:`kvoffload._events_payload`). A job's chunks are found exactly: the host pool already
holds each of its keys, pending, at the chunk id the job writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvoffload._events_payload import SWEEP_KEYS, PayloadTracker, chunk_payload, event_group_specs
from kvoffload._generated import BlockRemoved, KVCacheConfig, KVEvent, OffloadingConfig, StepPlan, WorkerReport
from kvoffload._packed import unpack_int32, unpack_int64
from kvoffload.offload.keys import BlockHash, hashes_per_chunk, make_offload_key
from kvoffload.offload.manager import HostBlockManager

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["SelfDescribingEvents", "to_vllm_events"]


def to_vllm_events(events: Sequence[KVEvent]) -> list[KVCacheEvent]:
    """kvoffload's KV events as vLLM's ``BlockStored`` / ``BlockRemoved`` (medium ``CPU`` or ``STORAGE``).

    Every hash is given as vLLM's own events give it (an int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
    vLLM's default; placeholders too, as vLLM 0.33's offloading events), so a subscriber matches them hash for
    hash with the engine's own GPU-side events.
    """
    convert = maybe_convert_block_hash
    converted: list[KVCacheEvent] = []
    for event in events:
        medium = event.medium.value
        hashes = [convert(h) for h in event.block_hashes]
        if isinstance(event, BlockRemoved):
            converted.append(VllmBlockRemoved(block_hashes=hashes, medium=medium, group_idx=event.group_idx))
            continue
        parent = event.parent_block_hash
        converted.append(
            VllmBlockStored(
                block_hashes=hashes,
                parent_block_hash=None if parent is None else convert(parent),
                token_ids=unpack_int32(event.token_ids),
                block_size=event.block_size,
                lora_id=event.lora_id,
                medium=medium,
                lora_name=event.lora_name,
                group_idx=event.group_idx,
                kv_cache_spec_kind=event.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            )
        )
    return converted


class SelfDescribingEvents:
    """The scheduler half's payload recorder: store jobs -> payloads, worker reports -> failed stores, events out.

    ``kv_cache_config`` (the snapshot's) names each group's spec kind and window in the events; without it they
    stay None.
    """

    def __init__(self, config: OffloadingConfig, kv_cache_config: KVCacheConfig | None = None) -> None:
        self.tracker = PayloadTracker(event_group_specs(kv_cache_config) if kv_cache_config is not None else None)
        self._tokens_per_hash = config.cache.tokens_per_hash
        self._blocks_per_chunk = bpc = config.cache.blocks_per_chunk
        # (group id, tokens per block, hashes per chunk, described): full-attention groups only are described
        self._groups = [
            (
                g.group_id,
                g.tokens_per_block,
                hashes_per_chunk(g.tokens_per_block, bpc, self._tokens_per_hash),
                g.sliding_window_size_in_chunks is None,
            )
            for g in config.groups
        ]

    def on_plan(self, plan: StepPlan, requests: Mapping[str, Request], manager: HostBlockManager) -> None:
        """Record the payload of every full-attention chunk the plan's store jobs write (``requests``: the
        scheduler's request ids -> vLLM requests)."""
        bpc = self._blocks_per_chunk
        for job in plan.store_jobs:
            request = requests.get(job.req_id)
            if request is None:
                continue
            chunk_ids = unpack_int64(job.chunk_ids)
            sizes, firsts = unpack_int32(job.group_sizes), unpack_int32(job.block_indices)
            offset = 0
            for (group_id, tpb, hpc, described), size, first in zip(self._groups, sizes, firsts, strict=False):
                count = size // bpc
                if described and count:
                    self._record_group(
                        request, job.job_id, group_id, tpb, hpc, first // bpc, chunk_ids[offset:][:count], manager
                    )
                offset += count

    def _record_group(
        self,
        request: Request,
        job_id: int,
        group_id: int,
        tokens_per_block: int,
        hpc: int,
        chunk: int,
        chunk_ids: Sequence[int],
        manager: HostBlockManager,
    ) -> None:
        """The job's chunks of one group are the request's chunks from ``chunk`` on whose key the pool holds at
        the job's next chunk id (chunks already stored were skipped: they are not in the job)."""
        hashes: Sequence[BlockHash] = request.block_hashes
        tokens: Sequence[int] = request.all_token_ids
        lora = request.lora_request
        wanted = iter(chunk_ids)
        target = next(wanted, None)
        while target is not None and (chunk + 1) * hpc <= len(hashes):
            key = make_offload_key(hashes[(chunk + 1) * hpc - 1], group_id)
            if manager.chunk_id(key) == target:
                payload = chunk_payload(
                    hashes,
                    tokens,
                    chunk,
                    tokens_per_hash=self._tokens_per_hash,
                    tokens_per_block=tokens_per_block,
                    blocks_per_chunk=self._blocks_per_chunk,
                    lora_id=None if lora is None else lora.lora_int_id,
                    lora_name=None if lora is None else lora.lora_name,
                )
                self.tracker.record(key, payload, job_id)
                target = next(wanted, None)
            chunk += 1

    def on_reports(self, reports: Sequence[WorkerReport]) -> None:
        """A store job any worker failed writes nothing: its payloads go unpublished."""
        for report in reports:
            for result in report.results:
                if result.is_store and not result.success:
                    self.tracker.store_failed(result.job_id)

    def take(self, events: Sequence[KVEvent], manager: HostBlockManager) -> list[KVEvent]:
        """``events`` with the payloads; then the payloads of chunks the pool lost silently (a reset) are dropped:
        all of them when the pool holds fewer keys than recorded, else a few per call."""
        out = self.tracker.translate(events)
        budget = None if len(manager) < self.tracker.in_pool else SWEEP_KEYS
        self.tracker.forget_absent(manager.__contains__, budget)
        return out
