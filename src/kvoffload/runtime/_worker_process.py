"""Entry point of a worker process: handshake, then StepPlans in and WorkerReports out until Shutdown.

A worker builds everything from the engine snapshot it is given: its rank's OffloadingConfig (the
translator with ``parallel_config.rank`` set), its KV memory (one flat allocation as the snapshot's
``kv_cache_tensors`` describe), its host pool and copy engine. An application that plays the engine inside
the worker (the demo's simulated forward pass) names a :class:`~kvoffload.runtime.hooks.WorkerHook` factory in
``WorkerSpec.hook`` (a dotted path, with JSON ``hook_options_json``); the worker imports it and calls it
around every step and at the end (see :mod:`kvoffload.runtime.hooks`).

A worker never crashes on bad input: a malformed message from the scheduler, or any other error, ends the
session with exit status 3 after a last ``WorkerFailure`` message naming the exception, so the scheduler
reports the real cause (and fails the worker's jobs); a vanished scheduler ends it with 0. Once the handshake is
done a thread sends a ``Heartbeat`` every ``heartbeat_interval_s``: a stopped or frozen process sends none,
which is how the scheduler tells a stall from a slow step. Workers ignore SIGINT: on Ctrl-C the scheduler
shuts them down (a terminal sends SIGINT to the whole process group). A worker never outlives its scheduler:
first thing, before torch is imported, it asks for ``PR_SET_PDEATHSIG`` (SIGKILL when the parent ends) and
checks its parent is still the scheduler that spawned it, and a thread checks again every 0.2 s. The cluster
starts workers with :func:`start_ignoring_sigint` and tells a stopped one by :func:`process_stopped`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvoffload import wire
from kvoffload._generated import (
    EngineSnapshot,
    Heartbeat,
    Hello,
    Message,
    OffloadingConfig,
    PeerRole,
    Shutdown,
    StepPlan,
    TieringConfig,
    WorkerFailure,
    WorkerReport,
    codecs,
)
from kvoffload.errors import ConfigError, WireError, WorkerError
from kvoffload.runtime._channel import Channel
from kvoffload.translate import translate_snapshot

if TYPE_CHECKING:  # torch and what builds on it load in the worker, after it has tied itself to its parent
    import torch

    from kvoffload.assembly import WorkerParts
    from kvoffload.metrics import WorkerMetrics
    from kvoffload.offload.worker import OffloadWorker
    from kvoffload.offload.worker.copy import TransferLayout
    from kvoffload.runtime.hooks import WorkerHook

__all__ = ["WorkerSpec", "process_stopped", "rank_config", "run_worker", "start_ignoring_sigint"]

EXIT_BAD_MESSAGE = 3


def process_stopped(proc: BaseProcess) -> bool:
    """Whether ``proc`` is stopped (SIGSTOP, job control) or held by a tracer, from its Linux process state."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except (OSError, ValueError):
        return False  # gone (its sentinel says so), or no /proc: nothing to tell
    state = stat.rpartition(")")[2].split()[:1]
    return state in (["T"], ["t"])


def start_ignoring_sigint(proc: BaseProcess) -> None:
    """Start ``proc`` with SIGINT ignored from its first instruction, without losing a Ctrl-C meant for us.

    An ignored disposition survives exec (a handler or the signal mask do not), so a Ctrl-C while the child
    still imports cannot kill it with a traceback; the worker keeps ignoring SIGINT and leaves stopping to the
    scheduler. Meanwhile SIGINT is blocked here: one arriving stays pending and is delivered once restored.
    """
    if threading.current_thread() is not threading.main_thread():
        proc.start()  # signal dispositions can only be changed from the main thread
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGINT, handler)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a worker process is started with (JSON-encoded: nothing crosses the process as pickle)."""

    rank: int
    world_size: int
    snapshot_json: str
    shared_pool_id: str | None = None
    handshake_timeout_s: float = 60.0
    load_timeout_s: float = 120.0
    torch_threads: int = 1
    heartbeat_interval_s: float = 1.0
    checksums: bool = True
    """Content checksums of host chunks (integrity); key tags are verified either way."""
    tiering_json: str | None = None  # a TieringConfig (JSON, urls resolved): this worker runs tier jobs
    metrics_dir: str | None = None
    hook: str | None = None
    """Dotted path of a WorkerHook factory the worker imports and calls around every step (None: no hook)."""
    hook_options_json: str | None = None
    """The hook's options, a JSON object (given to the factory in its WorkerContext)."""
    parent_pid: int | None = None
    """The scheduler's pid: a worker whose parent is no longer this process exits at once (checked at start,
    then every :data:`PARENT_CHECK_INTERVAL_S`)."""
    parent_death_signal: bool = False
    """Ask Linux to SIGKILL the worker when the thread that spawned it ends (``PR_SET_PDEATHSIG``); the
    scheduler sets it when it spawns from its main thread, whose end is the process's."""


def rank_config(snapshot: EngineSnapshot, rank: int) -> tuple[EngineSnapshot, OffloadingConfig]:
    """The snapshot as seen by ``rank`` and its OffloadingConfig."""
    engine = snapshot.engine_config
    ranked = msgspec.structs.replace(
        snapshot,
        engine_config=msgspec.structs.replace(
            engine, parallel_config=msgspec.structs.replace(engine.parallel_config, rank=rank)
        ),
    )
    return ranked, translate_snapshot(ranked)


@dataclass
class _Session:
    spec: WorkerSpec
    kv: torch.Tensor
    layout: TransferLayout
    parts: WorkerParts
    last_step: int = 0
    metrics: WorkerMetrics | None = None
    hook: WorkerHook | None = None

    @property
    def worker(self) -> OffloadWorker:
        return self.parts.worker

    def step(self, plan: StepPlan, attachments: tuple[memoryview, ...]) -> tuple[WorkerReport, list[bytes]]:
        if self.hook is not None:
            self.hook.before_step(plan, attachments)
        self.last_step = plan.step
        self.worker.start_step(plan)
        self.worker.wait_for_loads(plan, self.spec.load_timeout_s)
        self.worker.wait_for_promotions()
        report = self.worker.report(plan.step)
        if self.metrics is not None:
            self.metrics.record(report)
        extras = [] if self.hook is None else list(self.hook.after_step(plan, report))
        self.worker.end_step(plan)
        return report, extras

    def finish(self) -> tuple[WorkerReport, list[bytes]]:
        report = self.worker.drain(self.last_step, self.spec.load_timeout_s)
        if self.metrics is not None:
            self.metrics.record(report)
        return report, [] if self.hook is None else list(self.hook.finish(report))

    def close(self) -> None:
        try:
            if self.hook is not None:
                self.hook.close()
        finally:
            self.parts.close()


def _open_session(spec: WorkerSpec) -> _Session:
    import torch

    from kvoffload.assembly import build_worker
    from kvoffload.offload.worker.copy import transfer_layout_from_config
    from kvoffload.runtime.hooks import WorkerContext, decode_hook_options, make_hook

    torch.set_num_threads(max(1, spec.torch_threads))
    snapshot = codecs.decode(spec.snapshot_json, EngineSnapshot, format="json")
    ranked, config = rank_config(snapshot, spec.rank)
    layout = transfer_layout_from_config(ranked.kv_cache_config, config)
    kv = torch.zeros(layout.engine_bytes, dtype=torch.uint8)
    tiering = None if spec.tiering_json is None else msgspec.json.decode(spec.tiering_json, type=TieringConfig)
    parts = build_worker(
        config,
        kv,
        layout,
        tiering=tiering,
        checksums=spec.checksums,
        cpu_threads=spec.torch_threads,
        shared_pool_id=spec.shared_pool_id,
    )
    try:
        hook = None
        if spec.hook is not None:
            context = WorkerContext(
                rank=spec.rank,
                world_size=spec.world_size,
                kv=kv,
                layout=layout,
                config=config,
                options=decode_hook_options(spec.hook_options_json),
                tiers=parts.worker.tiers,
            )
            hook = make_hook(spec.hook, context)
    except BaseException:
        parts.close()
        raise
    return _Session(spec=spec, kv=kv, layout=layout, parts=parts, metrics=_worker_metrics(spec), hook=hook)


def _worker_metrics(spec: WorkerSpec) -> WorkerMetrics | None:
    """Transfer metrics in prometheus_client's multiprocess mode, when the scheduler asked for them."""
    if spec.metrics_dir is None:
        return None
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") != spec.metrics_dir:
        raise ConfigError(
            f"worker {spec.rank}: metrics_dir={spec.metrics_dir!r} but PROMETHEUS_MULTIPROC_DIR is "
            f"{os.environ.get('PROMETHEUS_MULTIPROC_DIR')!r} (spawn workers inside metrics.multiprocess_env)"
        )
    from prometheus_client import CollectorRegistry

    from kvoffload.metrics import WorkerMetrics

    return WorkerMetrics(CollectorRegistry(), max_samples=0)


class _Heartbeat:
    """Sends a Heartbeat every ``interval`` seconds from a daemon thread until stopped or the peer is gone."""

    def __init__(self, channel: Channel, rank: int, interval: float) -> None:
        self._channel = channel
        self._rank = rank
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvoffload-heartbeat-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        seq = 0
        while not self._stop.wait(self._interval):
            try:
                self._channel.send(Heartbeat(rank=self._rank, seq=seq))
            except (WorkerError, OSError, ValueError):
                return  # the scheduler is gone (or the channel closed under us): the main thread handles it
            seq += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class _SchedulerGone(Exception):
    """The scheduler hung up: a normal end for a worker (kept apart from WorkerErrors of the worker's own)."""


def _recv(channel: Channel, timeout: float | None) -> wire.Decoded:
    try:
        return channel.recv(timeout)
    except WorkerError as exc:
        raise _SchedulerGone(str(exc)) from exc


def _send(channel: Channel, message: Message, extras: Sequence[bytes] = ()) -> None:
    try:
        channel.send(message, extras)
    except WorkerError as exc:
        raise _SchedulerGone(str(exc)) from exc


def _report_failure(channel: Channel, rank: int, step: int, exc: BaseException) -> None:
    """Tell the scheduler why this worker stops (best effort: it may be gone already)."""
    message = " ".join(str(exc).split())[:4000]
    with contextlib.suppress(WorkerError, OSError, ValueError):
        channel.send(WorkerFailure(rank=rank, error_type=type(exc).__name__, message=message, step=step))


PARENT_CHECK_INTERVAL_S = 0.2
"""How often a worker checks that its scheduler is still its parent (a busy worker reads no EOF)."""

_PR_SET_PDEATHSIG = 1


def _follow_parent(spec: WorkerSpec) -> None:
    """Tie this worker's life to its scheduler's, before anything slow (importing torch, building the pool).

    With ``parent_death_signal`` the kernel SIGKILLs the worker the moment its parent ends (a stopped worker
    included). Then, closing the race with a parent that died while this process started, and for a parent
    that spawned from another thread: a worker whose parent is no longer ``parent_pid`` exits now, and a
    daemon thread checks again every :data:`PARENT_CHECK_INTERVAL_S` (a worker waiting for a message sees
    EOF anyway; this catches one in the middle of a step).
    """
    if spec.parent_death_signal and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    parent = spec.parent_pid
    if parent is None:
        return
    if os.getppid() != parent:
        os._exit(0)  # the scheduler is already gone: nothing to serve, nothing to release yet

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_INTERVAL_S)
        os._exit(0)

    threading.Thread(target=watch, name=f"kvoffload-parent-{spec.rank}", daemon=True).start()


def run_worker(conn: Connection, spec_json: bytes) -> None:
    """Process entry: serve one scheduler until Shutdown or until it goes away."""
    # Ctrl-C reaches the whole process group; the scheduler decides how workers stop (Shutdown, then exit).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = msgspec.json.decode(spec_json, type=WorkerSpec)
    _follow_parent(spec)
    channel = Channel(conn)
    heartbeat = _Heartbeat(channel, spec.rank, spec.heartbeat_interval_s)
    session: _Session | None = None
    status = 0
    step = 0
    try:
        first = _recv(channel, spec.handshake_timeout_s).message
        if isinstance(first, Shutdown):
            raise _SchedulerGone("shut down before the handshake")  # the scheduler gave up while starting
        if not isinstance(first, Hello):
            raise WireError(f"expected Hello first, got {type(first).__name__}")
        snapshot = codecs.decode(spec.snapshot_json, EngineSnapshot, format="json")
        local = wire.make_hello(PeerRole.WORKER, spec.rank, spec.world_size, wire.engine_id_of(snapshot))
        try:
            wire.check_hello(local, first)
        except WireError:
            _send(channel, local)  # let the scheduler name both versions too
            raise
        # Reply only once ready: after the handshake every worker has mapped the shared pool.
        session = _open_session(spec)
        _send(channel, local)
        heartbeat.start()
        while True:
            decoded = _recv(channel, None)
            message = decoded.message
            if isinstance(message, Shutdown):
                report, extras = session.finish()
                _send(channel, report, extras)
                break
            if not isinstance(message, StepPlan):
                raise WireError(f"unexpected {type(message).__name__} from the scheduler")
            step = message.step
            report, extras = session.step(message, decoded.attachments)
            _send(channel, report, extras)
    except _SchedulerGone:
        status = 0  # the scheduler went away: nothing left to serve
    except Exception as exc:  # any failure: one line on stderr, the cause to the scheduler, exit 3
        print(f"kvoffload worker {spec.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        heartbeat.stop()
        _report_failure(channel, spec.rank, step, exc)
        status = EXIT_BAD_MESSAGE
    finally:
        heartbeat.stop()
        if session is not None:
            session.close()
        channel.close()
    if status:
        sys.stderr.flush()
        os._exit(status)
