"""Block views: small-page CPU copies as a few strided tensor views per block, moved by one torch call.

At small pages (32 KB) a loop of one ``memmove`` per page from two Python threads spends its time handing the
GIL back and forth (each call releases and retakes it). Here a group's pages are described once as
:class:`_Piece` s (pages whose engine offsets step by a constant and whose host offsets are contiguous), each
engine block and host sub-block gets one int64 view per piece (cached: a few hundred bytes per block), and a
stretch of a job is one ``torch._foreach_copy_`` call, which copies many pages with the GIL released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload._placement import GroupLayout, TransferLayout
from kvoffload.offload.worker.copy._runs import JobBlocks

__all__ = ["BlockViews", "ViewJob"]

_WORD = 8
_MAX_PIECE_BYTES = 128 << 10
"""Bytes per view: kept below torch's parallel grain (32768 elements) so no copy starts an OpenMP team."""

MAX_PAGE_BYTES = _MAX_PIECE_BYTES
"""Groups with longer pages use the run path: there one memmove per page costs little (measured: from
256 KB pages on, the run path is as fast or faster)."""


@dataclass(frozen=True)
class _Piece:
    """``pages`` pages of ``width`` bytes: page ``i`` at engine byte ``engine_offset + i*page_stride +
    b*block_stride`` of block ``b`` and at host byte ``host_offset + i*host_stride`` of the sub-block."""

    engine_offset: int
    page_stride: int
    block_stride: int
    host_offset: int
    host_stride: int
    pages: int
    width: int


def _group_pieces(group: GroupLayout) -> tuple[_Piece, ...] | None:
    """The group's segments as pieces (at most :data:`_MAX_PIECE_BYTES` each), or None when a segment is not
    word-aligned or its page is longer than :data:`MAX_PAGE_BYTES`."""
    segments = sorted(group.segments, key=lambda s: s.host_offset)
    for s in segments:
        if s.length > MAX_PAGE_BYTES or any(
            v % _WORD for v in (s.engine_offset, s.block_stride, s.length, s.host_offset)
        ):
            return None
    pieces: list[_Piece] = []
    i = 0
    while i < len(segments):
        first = segments[i]
        j, step = i + 1, 0
        while j < len(segments) and (j - i + 1) * first.length <= _MAX_PIECE_BYTES:
            prev, cur = segments[j - 1], segments[j]
            gap = cur.engine_offset - prev.engine_offset
            if (
                cur.length != first.length
                or cur.block_stride != first.block_stride
                or cur.host_offset != prev.host_offset + prev.length
                or gap == 0
                or (step and gap != step)
            ):
                break
            step = gap
            j += 1
        pages = j - i
        pieces.append(
            _Piece(
                first.engine_offset,
                step or first.length,
                first.block_stride,
                first.host_offset,
                first.length,
                pages,
                first.length,
            )
        )
        i = j
    return tuple(pieces)


@dataclass(frozen=True)
class ViewJob:
    """One job as view pairs: ``dst[k]`` gets ``src[k]``; slot ``j``'s pairs are ``[ends[j-1], ends[j])``."""

    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    ends: list[int]


class BlockViews:
    """Cached int64 views of engine blocks and host sub-blocks, per group, for :class:`ViewJob` s."""

    def __init__(self, kv_flat: torch.Tensor, host_flat: torch.Tensor, layout: TransferLayout) -> None:
        aligned = kv_flat.data_ptr() % _WORD == 0 and host_flat.data_ptr() % _WORD == 0
        usable = aligned and kv_flat.numel() % _WORD == 0 and host_flat.numel() % _WORD == 0
        self._kv = kv_flat[: kv_flat.numel() // _WORD * _WORD].view(torch.int64)
        self._host = host_flat[: host_flat.numel() // _WORD * _WORD].view(torch.int64)
        self._pieces: list[tuple[_Piece, ...] | None] = [_group_pieces(g) if usable else None for g in layout.groups]
        self._engine: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._host_views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def supports(self, groups: Sequence[int]) -> bool:
        """Whether every one of these groups can be copied block by block."""
        return all(self._pieces[g] is not None for g in groups)

    def _engine_views(self, g: int, block: int) -> tuple[torch.Tensor, ...]:
        views = self._engine.get((g, block))
        if views is None:
            pieces = self._pieces[g] or ()
            views = tuple(
                self._kv.as_strided(
                    (p.pages, p.width // _WORD),
                    (p.page_stride // _WORD, 1),
                    (p.engine_offset + block * p.block_stride) // _WORD,
                )
                for p in pieces
            )
            self._engine[g, block] = views
        return views

    def _host_block_views(self, g: int, host: int) -> tuple[torch.Tensor, ...]:
        views = self._host_views.get((g, host))
        if views is None:
            pieces = self._pieces[g] or ()
            views = tuple(
                self._host.as_strided(
                    (p.pages, p.width // _WORD), (p.host_stride // _WORD, 1), (host + p.host_offset) // _WORD
                )
                for p in pieces
            )
            self._host_views[g, host] = views
        return views

    def job(self, blocks: JobBlocks, is_store: bool) -> ViewJob:
        """The view pairs of a job whose groups are all :meth:`supports` ed (host offsets must be words)."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        ends: list[int] = []
        engine_views, host_views = self._engine_views, self._host_block_views
        for g, block, host in zip(
            blocks.groups.tolist(), blocks.engine_blocks.tolist(), blocks.host_blocks.tolist(), strict=True
        ):
            e, h = engine_views(g, block), host_views(g, host)
            if is_store:
                dst.extend(h)
                src.extend(e)
            else:
                dst.extend(e)
                src.extend(h)
            ends.append(len(dst))
        return ViewJob(dst, src, ends)

    @staticmethod
    def host_words(blocks: JobBlocks) -> bool:
        """True when every host sub-block starts on a word (views need it)."""
        return bool(np.all(blocks.host_blocks % _WORD == 0))
