"""``kvoffload demo``: a multi-turn chat workload through the scheduler and N worker processes, verified.

A small simulated engine (a block pool, requests, a forward pass that writes KV whose bytes are a function of
the token prefix and the layer) runs a synthetic multi-turn chat with a shared system prompt. The engine keeps
no prefix cache of its own, so a conversation's earlier KV is gone from it by the next turn: the scheduler
finds the prefix in the host pool, the workers load it back, and every reloaded block is compared byte for
byte with what the engine would have computed. Any mismatch, failed job or dead worker makes the run exit
non-zero. The demo is an application of the runtime: the forward pass runs in the workers through a
:class:`~kvoffload.runtime.hooks.WorkerHook`.

* ``snapshots`` - the embedded Llama-style snapshot and the command line's connector overrides.
* ``shrink`` - reduce a real-size snapshot to fit this machine, keeping its ranks, groups and layout.
* ``workload`` - the options and the multi-turn chat requests.
* ``engine`` - the simulated engine on the scheduler side (admission, step plans, decoding).
* ``sim_engine`` - deterministic KV pages (fill and byte-for-byte verify).
* ``worker_hook`` - the hook that fills and verifies KV inside each worker, and the memcpy probe.
* ``runner`` - ``run_demo``: memory and workload checks, the cluster, the step loop.
* ``report`` - what it measured and the end-of-run tables.
"""

from __future__ import annotations

from kvoffload.demo.report import DemoResult, render_misses, render_result
from kvoffload.demo.runner import run_demo
from kvoffload.demo.shrink import Shrunk, shrink_snapshot
from kvoffload.demo.snapshots import default_snapshot, snapshot_with_overrides
from kvoffload.demo.workload import DemoOptions

__all__ = [
    "DemoOptions",
    "DemoResult",
    "Shrunk",
    "default_snapshot",
    "render_misses",
    "render_result",
    "run_demo",
    "shrink_snapshot",
    "snapshot_with_overrides",
]
