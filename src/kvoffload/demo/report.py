"""What the demo measured (:class:`DemoResult`) and its end-of-run tables."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvoffload.demo.worker_hook import TierFigures
from kvoffload.offload.scheduler import TierStatsRow

__all__ = ["DemoResult", "format_bytes", "render_misses", "render_result"]


@dataclass
class DemoResult:
    """What the demo measured."""

    requests: int = 0
    requests_with_hit: int = 0
    prompt_tokens: int = 0
    tokens_loaded: int = 0
    tokens_recomputed: int = 0
    blocks_verified: int = 0
    mismatched_blocks: list[int] = field(default_factory=list)
    failed_jobs: int = 0
    tier_missed_loads: int = 0
    """Loads that found a promotion they read failed or late: recomputed, a miss (not a failed job)."""
    load_restarts: int = 0
    """Requests admitted again after a failed load or tier miss: blocks freed, looked up and allocated anew."""
    dead_workers: list[int] = field(default_factory=list)
    worker_errors: dict[int, str] = field(default_factory=dict)
    deferred_lookups: int = 0
    steps: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    memcpy_gbps: float = 0.0
    checksum_cost: tuple[float, float] | None = None
    """``(store, load)``: extra time of checksummed jobs over the same jobs without checksums, per second of a
    plain memcpy of the same bytes, measured by every worker at shutdown (mean); None when not measured."""
    wall_seconds: float = 0.0
    host_chunks_filled: int = 0
    host_chunks: int = 0
    tiers: list[TierStatsRow] = field(default_factory=list)
    tier_figures: list[TierFigures] = field(default_factory=list)
    """Per tier, one rank's GB/s in the run and of its raw baseline on the same records (mean over ranks)."""
    lookup_miss_reasons: dict[str, int] = field(default_factory=dict)
    chunk_miss_reasons: dict[str, int] = field(default_factory=dict)
    events_published: int = 0
    events_dropped: int = 0

    @property
    def ok(self) -> bool:
        """True when every reloaded block matched and nothing failed."""
        return not self.mismatched_blocks and not self.failed_jobs and not self.dead_workers

    @property
    def store_gbps(self) -> float:
        return self.bytes_stored / self.store_seconds / 1e9 if self.store_seconds else 0.0

    @property
    def load_gbps(self) -> float:
        return self.bytes_loaded / self.load_seconds / 1e9 if self.load_seconds else 0.0


def render_result(result: DemoResult) -> str:
    """The end-of-run table, as text."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvoffload demo", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    hit_rate = result.requests_with_hit / result.requests if result.requests else 0.0
    rows = [
        ("requests", f"{result.requests}"),
        ("engine steps", f"{result.steps}"),
        ("prefix-hit rate (requests)", f"{hit_rate:.1%}"),
        ("prompt tokens loaded from host", f"{result.tokens_loaded}"),
        ("prompt tokens recomputed", f"{result.tokens_recomputed}"),
        ("host pool chunks filled at end", f"{result.host_chunks_filled} of {result.host_chunks}"),
        ("bytes stored / loaded", f"{result.bytes_stored} / {result.bytes_loaded}"),
        ("store GB/s", f"{result.store_gbps:.2f}"),
        ("load GB/s", f"{result.load_gbps:.2f}"),
        ("plain memcpy GB/s (same run)", f"{result.memcpy_gbps:.2f}"),
        (
            "store / load vs memcpy",
            f"{result.store_gbps / result.memcpy_gbps:.0%} / {result.load_gbps / result.memcpy_gbps:.0%}"
            if result.memcpy_gbps
            else "n/a",
        ),
        (
            "checksum cost, store / load (same run)",
            f"{result.checksum_cost[0]:.0%} / {result.checksum_cost[1]:.0%} of a memcpy"
            if result.checksum_cost is not None
            else "n/a",
        ),
        *_tier_rows(result),
        ("reloaded blocks verified byte for byte", f"{result.blocks_verified}"),
        ("mismatched blocks", f"{len(result.mismatched_blocks)}"),
        ("loads missed on a tier (recomputed)", f"{result.tier_missed_loads}"),
        ("requests admitted again after a failed load", f"{result.load_restarts}"),
        ("failed jobs / dead workers", f"{result.failed_jobs} / {len(result.dead_workers)}"),
        ("wall time", f"{result.wall_seconds:.1f}s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    out = StringIO()
    Console(file=out, width=100, force_terminal=False).print(table)
    return out.getvalue()


def _tier_rows(result: DemoResult) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for i, t in enumerate(result.tiers):
        name = f"tier {i} ({t.name})"
        rows.append((f"{name}: prompt tokens promoted", f"{t.tokens_promoted}"))
        rows.append(
            (
                f"{name}: chunks cascaded / dropped / failed",
                f"{t.cascaded_chunks} / {t.dropped_chunks} / {t.cascade_failures}",
            )
        )
        if i < len(result.tier_figures):
            f = result.tier_figures[i]
            rows.append((f"{name}: write / read GB/s in the run", f"{_gbps(f.write_gbps)} / {_gbps(f.read_gbps)}"))
            rows.append(
                (
                    f"{name}: tier / raw GB/s, same records",
                    f"{_gbps(f.probe_write_gbps)} / {_gbps(f.raw_write_gbps)} w, "
                    f"{_gbps(f.probe_read_gbps)} / {_gbps(f.raw_read_gbps)} r",
                )
            )
            rows.append(
                (
                    f"{name}: write / read vs raw",
                    f"{_share(f.probe_write_gbps, f.raw_write_gbps)} / {_share(f.probe_read_gbps, f.raw_read_gbps)}",
                )
            )
        else:
            rows.append((f"{name}: write / read GB/s", f"{t.write_gbps:.2f} / {t.read_gbps:.2f}"))
        rows.append((f"{name}: bad records (missed, deleted)", f"{t.corrupt_records}"))
        rows.append((f"{name}: holds (records, bytes)", f"{t.resident_records} / {format_bytes(t.resident_bytes)}"))
    return rows


def format_bytes(value: int) -> str:
    """``268435456`` -> ``"256 MiB"``, ``1.5 * 2**30`` -> ``"1.5 GiB"`` (three significant digits)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value} B"


def _gbps(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _share(value: float, raw: float) -> str:
    return "-" if math.isnan(value) or math.isnan(raw) or raw <= 0 else f"{value / raw:.0%}"


def render_misses(result: DemoResult) -> str:
    """The miss breakdown (``kvoffload demo --explain-misses``): lookups and chunks per MissReason."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    from kvoffload._generated import MissReason

    table = Table(title="why lookups missed", show_header=True)
    table.add_column("reason")
    table.add_column("lookups (nothing loaded)", justify="right")
    table.add_column("chunks not loaded", justify="right")
    for reason in MissReason:
        table.add_row(
            reason.value,
            f"{result.lookup_miss_reasons.get(reason.value, 0)}",
            f"{result.chunk_miss_reasons.get(reason.value, 0)}",
        )
    table.add_row("total", f"{sum(result.lookup_miss_reasons.values())}", f"{sum(result.chunk_miss_reasons.values())}")
    out = StringIO()
    Console(file=out, width=100, force_terminal=False).print(table)
    return out.getvalue()
