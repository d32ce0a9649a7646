"""Builders shared by the tests: a plain OffloadingConfig and a TransferJob, with only what a test varies, and
the scheduler's view of a KV cache config; an argv that starts a child with SIGINT and SIGTERM at default."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from kvoffload import (
    KVCacheConfig,
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
    TransferJob,
    UniformTypeKVCacheSpecs,
)
from kvoffload._packed import pack_int32, pack_int64
from kvoffload.translate._spec_math import first_layer_spec


@dataclass(frozen=True)
class Placement:
    """A positional stand-in for a ``KVCacheTensor`` (layer ``l`` has block ``b``'s page at ``offset +
    l*layer_stride + b*block_stride`` of one allocation of ``size`` bytes), so a copy test places layers in one
    line; ``build_transfer_layout`` reads the same five fields of either and validates them itself."""

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0


def offloading_config(
    groups: Sequence[tuple[int, int, Sequence[str], int | None]] = ((0, 16, ("l0",), None),),
    *,
    worker_kv_bytes_per_block: int = 1024,
    extra_config: Mapping[str, object] | None = None,
    tokens_per_hash: int = 16,
    blocks_per_chunk: int = 1,
    rank: int = 0,
    world_size: int = 1,
    events: bool = False,
    dtype: str = "float16",
) -> OffloadingConfig:
    """An OffloadingConfig with ``(group_id, tokens_per_block, layer_names, window_chunks)`` groups."""
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(
                group_id=gid, tokens_per_block=tpb, layer_names=tuple(names), sliding_window_size_in_chunks=window
            )
            for gid, tpb, names, window in groups
        ),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=dict(extra_config or {}),
        engine_id="e",
        model=OffloadingModelConfig(name="m", dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_hash, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def transfer_job(job_id: int, blocks: Sequence[int], chunks: Sequence[int], *, first_block: int = 0) -> TransferJob:
    """A one-group job moving ``blocks`` (logical indices from ``first_block``) to/from ``chunks``."""
    return TransferJob(
        job_id=job_id,
        req_id="r",
        group_sizes=pack_int32([len(blocks)]),
        block_indices=pack_int32([first_block]),
        block_ids=pack_int64(blocks),
        chunk_ids=pack_int64(chunks),
    )


def flatten_for_scheduler(kv_cache_config: KVCacheConfig) -> KVCacheConfig:
    """The scheduler's view of a worker's KV cache config: each ``uniform_type`` group spec is replaced by its
    first layer spec (vLLM's ``generate_scheduler_kv_cache_config``); everything else is kept."""
    if not any(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in kv_cache_config.kv_cache_groups):
        return kv_cache_config
    groups = tuple(
        msgspec.structs.replace(g, kv_cache_spec=first_layer_spec(g.kv_cache_spec))
        if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
        else g
        for g in kv_cache_config.kv_cache_groups
    )
    return msgspec.structs.replace(kv_cache_config, kv_cache_groups=groups)


def chained_hashes(tag: str, n: int) -> list[bytes]:
    """``n`` prefix-chained fake block hashes (sha256 of the previous hash and ``tag:i``), like an engine's."""
    out: list[bytes] = []
    prev = b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}:{i}".encode()).digest()
        out.append(prev)
    return out


_DEFAULT_SIGNALS = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "signal.signal(signal.SIGTERM, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def with_default_sigint(argv: Sequence[str]) -> list[str]:
    """``argv`` run with SIGINT and SIGTERM at their default dispositions, for a test that sends the child one.

    A test run as a background job (``pytest ... &`` from a script) inherits SIGINT ignored, and an ignored
    disposition survives ``fork`` and ``exec`` (``Popen(restore_signals=True)`` restores only SIGPIPE, SIGXFZ
    and SIGXFSZ), so the child would never see the Ctrl-C the test sends (a runner may ignore SIGTERM too).
    This argv first runs a small Python that resets both to ``SIG_DFL`` and then ``exec``s ``argv`` in the
    same process (same pid, so process groups and ``/proc`` children are unchanged); no ``preexec_fn``, which
    is unsafe with threads.
    """
    return [sys.executable, "-c", _DEFAULT_SIGNALS, *argv]


with_default_signals = with_default_sigint


def child_pids(pid: int, marker: bytes) -> set[int]:
    """The live direct children of ``pid`` whose command line contains ``marker`` (``b"spawn_main"``: the
    runtime's worker processes, not multiprocessing's resource tracker; ``b"valkey-server"``: an embedded
    server)."""
    from pathlib import Path

    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                if marker in Path(f"/proc/{child}/cmdline").read_bytes() and not process_gone(int(child)):
                    found.add(int(child))
            except OSError:
                continue
    return found


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has ended (no such process, or a zombie its new parent has not reaped yet)."""
    from pathlib import Path

    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` passes (False)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True
