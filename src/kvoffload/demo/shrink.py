"""Shrink a real-size engine snapshot so the demo can run it on this machine, keeping what makes it distinctive.

A snapshot of a real deployment describes tens of GiB of KV memory per worker and a host pool of hundreds of
GiB. :func:`shrink_snapshot` keeps the model, its groups, page sizes, strides, ranks and layout (so the
translation is the same plan: replicated MLA stays replicated, hybrid groups stay hybrid) and reduces only
the two sizes that cost memory: the engine's ``num_blocks`` (every tensor's size, offset and layer stride
scale with it) and the host budget ``cpu_bytes_to_use``. It sizes them for the demo's workload (the engine
pool holds the longest conversation twice, the host pool every conversation's history) and then lowers them
until all workers fit in the memory budget; when even one conversation's worth cannot fit, it refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from kvoffload._generated import EngineSnapshot, KVCacheTensor, OffloadingConfig
from kvoffload._ints import cdiv
from kvoffload.demo.report import format_bytes
from kvoffload.demo.runner import MEMORY_SHARE, demo_memory_bytes
from kvoffload.demo.snapshots import snapshot_with_overrides
from kvoffload.demo.workload import DEFAULT_OPTIONS, DemoOptions, check_options, longest_conversation_tokens
from kvoffload.errors import ConfigError, HostMemoryError
from kvoffload.offload.pool import available_host_memory_bytes, plan_host_pool_from_config
from kvoffload.translate import translate_snapshot, validate_runnable

__all__ = ["DEFAULT_SHRINK_BYTES", "Shrunk", "format_bytes", "shrink_snapshot"]

DEFAULT_SHRINK_BYTES = 4 << 30
"""The most memory a shrunk demo aims at (all workers' KV memory and host pools together)."""


@dataclass(frozen=True)
class Shrunk:
    """A snapshot reduced to fit, and what was changed (empty when it already fitted)."""

    snapshot: EngineSnapshot
    changes: tuple[str, ...]

    def describe(self) -> str:
        """One line for the console: ``"num_blocks 8192 -> 128, cpu pool 256 GiB -> 72 MiB, ..."``."""
        return ", ".join(self.changes) if self.changes else "nothing changed: it fits as it is"


def shrink_snapshot(
    snapshot: EngineSnapshot, options: DemoOptions = DEFAULT_OPTIONS, *, max_bytes: int | None = None
) -> Shrunk:
    """Reduce ``num_blocks`` and ``cpu_bytes_to_use`` so the demo's workers fit in ``max_bytes`` together.

    ``max_bytes`` defaults to the smaller of :data:`DEFAULT_SHRINK_BYTES` and the share of available memory the
    demo may use. Ranks, layers, groups, page sizes and strides are kept; the shrunk snapshot translates to the
    same plan apart from the host budget. Raises ConfigError when an option is out of bounds, when the snapshot
    cannot run at its real size either (:func:`~kvoffload.translate.validate_runnable`: shrinking keeps what is
    wrong with it) or when a tensor's size, offset or layer stride is not a whole number of blocks (it cannot be
    scaled), and HostMemoryError, with the numbers, when even the smallest useful run (an engine pool for one
    conversation, a host pool for its history) does not fit.
    """
    check_options(options)
    if max_bytes is None:
        max_bytes = min(DEFAULT_SHRINK_BYTES, int(available_host_memory_bytes() * MEMORY_SHARE))
    if max_bytes <= 0:
        raise ConfigError(f"max_bytes={max_bytes} must be > 0")
    config = translate_snapshot(snapshot)
    validate_runnable(snapshot, config)
    kv = snapshot.kv_cache_config
    blocks_before = kv.num_blocks
    _check_scalable(kv.kv_cache_tensors, blocks_before)
    plan = plan_host_pool_from_config(config)
    tokens = longest_conversation_tokens(options)
    per_conversation = sum(cdiv(tokens, g.tokens_per_block) for g in config.groups)
    chunks_one = sum(cdiv(tokens, g.tokens_per_block * config.cache.blocks_per_chunk) for g in config.groups)
    world = config.parallel.world_size
    kv_per_block = max((t.size for t in kv.kv_cache_tensors), default=0) // max(blocks_before, 1)
    least_blocks = min(blocks_before, max(per_conversation, 1))
    least_chunks = min(plan.num_chunks, max(chunks_one, 1))
    want_chunks = min(plan.num_chunks, chunks_one * (options.conversations + 1))
    for blocks in (min(blocks_before, 2 * least_blocks), least_blocks):
        room = max_bytes // world - blocks * kv_per_block
        chunks = min(want_chunks, room // plan.slot_bytes) if plan.slot_bytes else want_chunks
        if chunks >= least_chunks:
            break
    else:
        least = world * (least_blocks * kv_per_block + least_chunks * plan.slot_bytes)
        raise HostMemoryError(
            f"cannot shrink the snapshot to fit: even num_blocks={least_blocks} (one conversation of {tokens} "
            f"tokens) and {least_chunks} host chunks need {format_bytes(least)} across world_size={world}, over the "
            f"budget of {format_bytes(max_bytes)} (use a smaller workload: --requests, --conversations)"
        )
    shrunk = _resize(snapshot, blocks, chunks * plan.row_bytes if chunks < plan.num_chunks else None)
    _check_same_plan(config, translate_snapshot(shrunk))
    changes = []
    if blocks != blocks_before:
        changes.append(f"num_blocks {blocks_before} -> {blocks}")
        before, after = format_bytes(blocks_before * kv_per_block), format_bytes(blocks * kv_per_block)
        changes.append(f"KV memory per worker {before} -> {after}")
    if chunks < plan.num_chunks:
        changes.append(
            f"cpu pool {format_bytes(plan.cpu_bytes_to_use)} -> {format_bytes(chunks * plan.row_bytes)} "
            f"({plan.num_chunks} -> {chunks} chunks)"
        )
    if changes:
        needed = demo_memory_bytes(shrunk)[0]
        changes.append(f"world_size {world}, groups and layout kept: {format_bytes(needed)} in all")
    return Shrunk(shrunk, tuple(changes))


def _check_scalable(tensors: Sequence[KVCacheTensor], num_blocks: int) -> None:
    """Every size, offset and layer stride must be a whole number of blocks to scale with ``num_blocks``."""
    if num_blocks < 1:
        raise ConfigError(f"num_blocks={num_blocks} must be >= 1 to shrink the snapshot")
    for i, t in enumerate(tensors):
        for name in ("size", "offset", "layer_stride"):
            value = getattr(t, name)
            if value % num_blocks:
                raise ConfigError(
                    f"cannot shrink the snapshot: kv_cache_tensors[{i}].{name}={value} is not a multiple of "
                    f"num_blocks={num_blocks}, so it does not scale with the number of blocks"
                )


def _resize(snapshot: EngineSnapshot, num_blocks: int, cpu_bytes: int | None) -> EngineSnapshot:
    """The snapshot with ``num_blocks`` blocks (sizes, offsets and layer strides scaled) and a new host budget."""
    kv = snapshot.kv_cache_config
    before = kv.num_blocks
    tensors = tuple(
        msgspec.structs.replace(
            t,
            size=t.size // before * num_blocks,
            offset=t.offset // before * num_blocks,
            layer_stride=t.layer_stride // before * num_blocks,
        )
        for t in kv.kv_cache_tensors
    )
    resized = msgspec.structs.replace(
        snapshot, kv_cache_config=msgspec.structs.replace(kv, num_blocks=num_blocks, kv_cache_tensors=tensors)
    )
    return snapshot_with_overrides(resized, cpu_bytes=cpu_bytes, policy=None)


def _check_same_plan(before: OffloadingConfig, after: OffloadingConfig) -> None:
    """The shrunk snapshot must translate to the same plan but for the host budget (ConfigError if not)."""
    budget = before.extra_config.get("cpu_bytes_to_use")
    same = msgspec.structs.replace(after, extra_config={**after.extra_config, "cpu_bytes_to_use": budget})
    if same != before:
        raise ConfigError("shrinking the snapshot changed its offloading plan; run it at its real size instead")
