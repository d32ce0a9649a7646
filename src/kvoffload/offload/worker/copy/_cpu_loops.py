"""The CPU backend's pure-Python copy loops (no native kernel: not built, or ``native=False``).

Small pages are copied through block views (:mod:`._views`, :func:`copy_views`), longer ones run by run with
the C library's memmove through ctypes (:func:`memmove_runs`), the GIL released for each call; with content
checksums (:func:`copy_and_hash`) every sub-block is hashed right after its bytes were copied, while they are
in cache. :func:`cpu_work` and :func:`hashed_parts` share a job between threads.
"""

from __future__ import annotations

import ctypes
import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvoffload.errors import ConfigError
from kvoffload.offload.pool import BlockSlots
from kvoffload.offload.worker.copy._runs import CopyRuns
from kvoffload.offload.worker.copy._views import ViewJob

__all__ = [
    "HASH_BYTES",
    "PIECE_BYTES",
    "HashedPart",
    "copy_and_hash",
    "copy_views",
    "cpu_work",
    "hashed_parts",
    "memmove_arrays",
    "memmove_runs",
]

PIECE_BYTES = 4 << 20
"""Longer runs are cut into pieces of this size so that the copy threads share the work evenly."""

HASH_BYTES = 512 << 10
"""With checksums on the pure-Python path, slots are hashed in stretches of at most this size, each right after
its bytes were copied. Larger than the cache would like: every stretch costs that path two GIL hand-overs."""

_xxh3_64 = xxhash.xxh3_64_intdigest
_foreach_copy = getattr(torch, "_foreach_copy_", None)


def copy_views(
    job: ViewJob, lo: int, hi: int, step: int, host: memoryview, slots: BlockSlots | None, digests: list[int]
) -> None:
    """Copy the views of slots ``[lo, hi)``, ``step`` slots per torch call; hash each stretch's slots after it
    (when ``slots`` is given) into ``digests``."""
    dst, src, ends = job.dst, job.src, job.ends
    offsets, lengths = slots.ranges() if slots is not None else ([], [])
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        first, last = ends[a - 1] if a else 0, ends[b - 1]
        if _foreach_copy is not None:
            _foreach_copy(dst[first:last], src[first:last])
        else:  # torch without foreach ops: one copy per view
            deque(map(torch.Tensor.copy_, dst[first:last], src[first:last]), maxlen=0)
        if slots is not None:
            for j in range(a, b):
                digests[j] = _xxh3_64(host[offsets[j] : offsets[j] + lengths[j]])


def memmove_runs(dsts: list[int], srcs: list[int], lengths: list[int]) -> None:
    """Copy each run with the C library's memmove.

    ``ctypes`` releases the GIL for the copy and, unlike a loop of torch ``copy_`` calls, wakes no OpenMP
    team per call (which collapses to ~1-4 GB/s for 64 KB-1 MB pages when run off the main thread).
    """
    if not len(dsts) == len(srcs) == len(lengths):
        raise ConfigError(f"{len(dsts)} destinations, {len(srcs)} sources and {len(lengths)} lengths")
    deque(map(ctypes.memmove, dsts, srcs, lengths), maxlen=0)  # no Python bytecode between the calls


def memmove_arrays(dsts: np.ndarray, srcs: np.ndarray, lengths: np.ndarray) -> None:
    """:func:`memmove_runs` over int64 arrays."""
    memmove_runs(dsts.tolist(), srcs.tolist(), lengths.tolist())


def _cut(engine: np.ndarray, host: np.ndarray, length: np.ndarray, piece: int) -> tuple[np.ndarray, ...]:
    """The runs cut into consecutive pieces of at most ``piece`` bytes (numpy: a few µs per call)."""
    pieces = (length + (piece - 1)) // piece
    if length.size == 0 or int(pieces.max()) <= 1:
        return engine, host, length
    owner = np.repeat(np.arange(length.size), pieces)
    skip = (np.arange(owner.size) - (np.cumsum(pieces) - pieces)[owner]) * piece
    return engine[owner] + skip, host[owner] + skip, np.minimum(length[owner] - skip, piece)


def cpu_work(
    runs: CopyRuns, is_store: bool, kv_ptr: int, host_ptr: int, parts: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Absolute (dst, src, length) int64 arrays for ``parts`` threads, split so each moves about the same
    bytes (runs longer than :data:`PIECE_BYTES` are cut so that the shares can even out)."""
    engine, host, length = runs.engine_offsets.numpy(), runs.host_offsets.numpy(), runs.lengths.numpy()
    if length.size == 0:
        return []
    if parts > 1:
        engine, host, length = _cut(engine, host, length, PIECE_BYTES)
    engine, host = engine + kv_ptr, host + host_ptr
    dst, src = (host, engine) if is_store else (engine, host)
    if parts <= 1:
        return [(dst, src, np.ascontiguousarray(length))]
    ends = np.cumsum(length)
    owner = (2 * ends - length) * parts // (2 * int(ends[-1]))  # the part holding each run's middle byte
    bounds = np.searchsorted(owner, np.arange(parts + 1)).tolist()
    return [(dst[a:b], src[a:b], length[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


@dataclass(frozen=True)
class HashedPart:
    """A share of a checksummed job: its runs as absolute addresses sorted by host offset, and the slots it
    hashes sorted by host offset (``slot_ids``: each slot's index in the job's :class:`BlockSlots`)."""

    dsts: np.ndarray
    srcs: np.ndarray
    lengths: np.ndarray
    hosts: np.ndarray  # host offset of each run, relative to the rows
    slot_firsts: np.ndarray
    slot_sizes: np.ndarray
    slot_ids: np.ndarray


def hashed_parts(
    runs: CopyRuns, is_store: bool, kv_ptr: int, host_ptr: int, slots: BlockSlots, parts: int
) -> list[HashedPart]:
    """Split a checksummed job into up to ``parts`` shares of about equal bytes, cut only between slots that
    no run spans (so a share never hashes bytes another share is still writing)."""
    host = runs.host_offsets.numpy()
    order = np.argsort(host, kind="stable")
    host, engine, lengths = host[order], runs.engine_offsets.numpy()[order], runs.lengths.numpy()[order]
    dst, src = (host + host_ptr, engine + kv_ptr) if is_store else (engine + kv_ptr, host + host_ptr)
    offsets = np.asarray(slots.host_offsets, dtype=np.int64)
    visit = np.argsort(offsets, kind="stable")
    slot_first = offsets[visit]
    slot_size = np.asarray(slots.lengths, dtype=np.int64)[visit]
    cuts, run_cuts = [0], [0]  # slot and run positions where a share starts
    if parts > 1 and visit.size > 1 and lengths.size:
        next_first = slot_first[1:]
        before_next = np.searchsorted(host, next_first)  # runs starting before each next slot
        reach = (host + lengths)[np.maximum(before_next - 1, 0)]
        slot_reach = np.maximum.accumulate(slot_first + slot_size)[:-1]  # end of the slots before each cut
        allowed = np.flatnonzero(((before_next == 0) | (reach <= next_first)) & (slot_reach <= next_first))
        done = np.cumsum(slot_size)
        targets = int(done[-1]) * np.arange(1, parts, dtype=np.int64) // parts
        picks = np.searchsorted(done[allowed], targets)  # first allowed cut with at least the target
        for pick in sorted(set(picks.tolist())):
            if pick < allowed.size:
                position = int(allowed[pick])
                cuts.append(position + 1)
                run_cuts.append(int(before_next[position]))
    cuts.append(int(visit.size))
    run_cuts.append(int(lengths.size))
    return [
        HashedPart(dst[ra:rb], src[ra:rb], lengths[ra:rb], host[ra:rb], slot_first[a:b], slot_size[a:b], visit[a:b])
        for (a, b), (ra, rb) in zip(itertools.pairwise(cuts), itertools.pairwise(run_cuts), strict=True)
        if b > a or rb > ra
    ]


def copy_and_hash(part: HashedPart, host: memoryview, digests: list[int], stretch: int) -> None:
    """Copy a share's runs and hash each of its slots while the bytes are in cache (digests by slot index).

    Both directions hash the host bytes right after copying them: a store what it wrote, a load what it read
    (in cache then, ~20% cheaper than hashing from memory before the copy). Slots are hashed in stretches of
    at most ``stretch`` bytes, each right after every run byte below its end was copied (the native kernel
    runs the same walk).
    """
    dsts, srcs, lengths, hosts = part.dsts.tolist(), part.srcs.tolist(), part.lengths.tolist(), part.hosts.tolist()
    r = done = 0
    for first, size, index in zip(
        part.slot_firsts.tolist(), part.slot_sizes.tolist(), part.slot_ids.tolist(), strict=True
    ):
        end = first + size
        state = xxhash.xxh3_64() if size > stretch else None
        a = first
        while True:
            b = min(a + stretch, end)
            pieces: tuple[list[int], list[int], list[int]] = ([], [], [])
            while r < len(lengths) and hosts[r] + done < b:
                n = min(lengths[r] - done, b - hosts[r] - done)
                pieces[0].append(dsts[r] + done)
                pieces[1].append(srcs[r] + done)
                pieces[2].append(n)
                done += n
                if done >= lengths[r]:
                    r, done = r + 1, 0
            memmove_runs(*pieces)
            if state is None:
                digests[index] = _xxh3_64(host[a:b])
            else:
                state.update(host[a:b])
            a = b
            if a >= end:
                break
        if state is not None:
            digests[index] = state.intdigest()
    if r < len(lengths):  # runs past the last slot
        rest = slice(r + 1, None)
        memmove_runs([dsts[r] + done, *dsts[rest]], [srcs[r] + done, *srcs[rest]], [lengths[r] - done, *lengths[rest]])
