"""A scheduler process for the lifecycle tests, and the hook they use.

``SleepyHook`` sleeps in its worker where the options say (``sleep_at``: ``start`` — building the hook, before
the worker answers the handshake —, ``step`` or ``finish``; ``ranks``: which ranks, default all), after writing
``rank{R}.{sleep_at}`` (the worker's pid) into the ``markers`` directory, so a test knows every worker got there.

``python -m tests.runtime.lifecycle_scenario WHERE THREAD MARKERS`` starts a two-worker cluster whose workers
sleep at ``WHERE``, from the main thread or from another one (``THREAD`` = ``main`` / ``other``), and runs one
step: the test kills this process while the workers sleep.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kvoffload import StepPlan, WorkerReport
from kvoffload._packed import pack_int64
from kvoffload.runtime.hooks import WorkerContext

SLEEPY = "tests.runtime.lifecycle_scenario:SleepyHook"
MiB = 1 << 20


class SleepyHook:
    def __init__(self, context: WorkerContext) -> None:
        self.rank = context.rank
        self.options = context.options
        self._sleep("start")

    def _sleep(self, point: str) -> None:
        options = self.options
        ranks = options.get("ranks")
        if options.get("sleep_at") != point or (isinstance(ranks, list) and self.rank not in ranks):
            return
        markers = options.get("markers")
        if isinstance(markers, str):
            (Path(markers) / f"rank{self.rank}.{point}").write_text(str(os.getpid()))
        seconds = options.get("seconds", 120)
        assert isinstance(seconds, int | float)
        time.sleep(seconds)

    def before_step(self, plan: StepPlan, attachments: Sequence[memoryview]) -> None:
        pass

    def after_step(self, plan: StepPlan, report: WorkerReport) -> Sequence[bytes]:
        self._sleep("step")
        return []

    def finish(self, report: WorkerReport) -> Sequence[bytes]:
        self._sleep("finish")
        return []

    def close(self) -> None:
        pass


def main(argv: Sequence[str]) -> None:
    from kvoffload.demo import default_snapshot
    from kvoffload.runtime.cluster import WorkerCluster

    where, thread, markers = argv
    snapshot = default_snapshot(workers=2, num_blocks=32, cpu_bytes=8 * MiB)
    cluster = WorkerCluster(snapshot, hook=SLEEPY, hook_options={"sleep_at": where, "markers": markers})

    def run() -> None:
        cluster.start()
        cluster.step(StepPlan(step=0, load_jobs=(), store_jobs=(), flush=pack_int64([])))

    if thread == "main":
        run()
    else:
        runner = threading.Thread(target=run)
        runner.start()
        runner.join()


if __name__ == "__main__":
    main(sys.argv[1:])
