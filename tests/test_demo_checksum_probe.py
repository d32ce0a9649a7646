"""The demo's checksum-cost probe (its table's "checksum cost" row): measured at shutdown in each worker by the
same store and load with checksums on and off, leaving the engine memory as it was."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from kvoffload import KVCacheTensor
from kvoffload.demo.report import DemoResult, render_result
from kvoffload.demo.snapshots import default_snapshot
from kvoffload.demo.worker_hook import _PROBES, _checksum_probe, checksum_cost_of, memcpy_gbps_of
from kvoffload.offload.worker.copy import build_transfer_layout
from kvoffload.translate import translate_snapshot


@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_probe_measures_both_directions_and_leaves_the_kv_memory_as_it_was(blocks_per_chunk: int) -> None:
    page, layers, num_blocks = 8 << 10, 2, 16
    names = tuple(f"layer{i}" for i in range(layers))
    size = layers * num_blocks * page
    placement = KVCacheTensor(size=size, layers=names, layer_stride=num_blocks * page, block_stride=page)
    layout = build_transfer_layout(
        [placement], [[(n, page) for n in names]], num_blocks=num_blocks, worker_kv_bytes_per_block=layers * page
    )
    config = translate_snapshot(default_snapshot())
    config = msgspec.structs.replace(
        config, cache=msgspec.structs.replace(config.cache, blocks_per_chunk=blocks_per_chunk)
    )
    kv = torch.randint(0, 256, (size,), dtype=torch.uint8)
    before = kv.clone()
    store, load = _checksum_probe(kv, layout, config, 5 * layers * page, memcpy_gbps=10.0)
    assert math.isfinite(store) and math.isfinite(load)
    assert torch.equal(kv, before)


def test_final_reply_carries_memcpy_and_checksum_cost() -> None:
    reply = memoryview(_PROBES.pack(12.5, 0.04, 0.07))
    assert memcpy_gbps_of([reply]) == 12.5
    assert checksum_cost_of([reply]) == pytest.approx((0.04, 0.07))
    assert checksum_cost_of([memoryview(_PROBES.pack(12.5, math.nan, math.nan))]) is None
    assert checksum_cost_of([]) is None and memcpy_gbps_of([]) is None


def _row(table: str, metric: str) -> str:
    (line,) = [line for line in table.splitlines() if metric in line]
    return line


def test_table_shows_the_checksum_cost_row() -> None:
    metric = "checksum cost, store / load (same run)"
    assert _row(render_result(DemoResult()), metric).split("│")[2].strip() == "n/a"
    row = _row(render_result(DemoResult(memcpy_gbps=10.0, checksum_cost=(0.04, 0.07))), metric)
    assert row.split("│")[2].strip() == "4% / 7% of a memcpy"
