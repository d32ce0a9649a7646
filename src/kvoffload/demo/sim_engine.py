"""A simulated engine forward pass: KV pages whose bytes are a deterministic function of tokens and layer.

The demo's worker hook and the tests need KV contents that can be recomputed anywhere: the page of layer
``l`` for a block whose prefix hashes to ``seed`` on rank ``r`` holds 64-bit words ``mix(seed, l, r) + i *
STEP``. A page reloaded from the host pool is compared word for word with the recomputed one, so a byte
copied to the wrong place, from the wrong chunk or not at all is caught.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvoffload.offload.worker.copy import TransferLayout

__all__ = ["block_seed", "fill_blocks", "verify_blocks"]

_STEP = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio increment, as a signed int64
_LAYER_MIX = 0x2545F4914F6CDD1D
_RANK_MIX = 0x5851F42D4C957F2D
_MASK63 = (1 << 63) - 1


def block_seed(block_hash: bytes) -> int:
    """A 63-bit seed from a block hash (which fingerprints the block's whole token prefix)."""
    return int.from_bytes(block_hash[:8], "little") & _MASK63


def _pattern(seed: int, layer: int, rank: int, words: int) -> torch.Tensor:
    base = (seed ^ (layer * _LAYER_MIX) ^ (rank * _RANK_MIX)) & _MASK63
    out = torch.arange(words, dtype=torch.int64)
    out.mul_(_STEP).add_(base)
    return out


def _pages(kv: torch.Tensor, layout: TransferLayout, group: int, block: int) -> list[tuple[int, torch.Tensor]]:
    """(layer index, int64 view of that layer's page of ``block``) for every layer of ``group``."""
    pages = []
    for index, layer in enumerate(layout.groups[group].layers):
        start = layer.engine_offset + block * layer.block_stride
        page = kv[start : start + layer.page_bytes]
        words = layer.page_bytes // 8
        pages.append((index, page[: words * 8].view(torch.int64)))
    return pages


def fill_blocks(kv: torch.Tensor, layout: TransferLayout, rank: int, entries: Sequence[tuple[int, int, int]]) -> None:
    """Write the deterministic KV of ``(group, block_id, seed)`` entries into the flat uint8 ``kv``."""
    for group, block, seed in entries:
        for layer, words in _pages(kv, layout, group, block):
            words.copy_(_pattern(seed, layer, rank, words.numel()))


def verify_blocks(
    kv: torch.Tensor, layout: TransferLayout, rank: int, entries: Sequence[tuple[int, int, int]]
) -> list[int]:
    """Block ids among ``(group, block_id, seed)`` whose pages differ from the expected KV."""
    bad: list[int] = []
    for group, block, seed in entries:
        for layer, words in _pages(kv, layout, group, block):
            if not torch.equal(words, _pattern(seed, layer, rank, words.numel())):
                bad.append(block)
                break
    return bad
