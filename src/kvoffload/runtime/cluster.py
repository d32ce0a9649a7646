"""The scheduler side of the runtime: spawn N worker processes, handshake, fan StepPlans out, gather reports.

``WorkerCluster`` owns the worker processes (``multiprocessing`` spawn) and one pipe to each. Every receive has
a timeout, and a worker that dies, fails (its ``WorkerFailure`` names the cause), stops sending heartbeats for
``worker_timeout_s`` (stopped or frozen), hangs past ``step_timeout_s``, or sends a malformed message is marked
dead: its process is ended (one that reported its own failure first gets up to 10 s to close its hook, pool and
tiers and exit) and :meth:`WorkerCluster.step` reports it in ``newly_dead`` (with the reason in ``errors``) so
the scheduler can fail the jobs it will never report (requests then fall back to recompute) and carry on with
the others. :meth:`WorkerCluster.start` first checks every rank's config can run and that all host pools
together fit in available memory, and removes shared-pool files whose owner died; a worker is then given up
when it exits, fails, stays stopped (SIGSTOP, a debugger) for ``worker_timeout_s``, or has not completed the
handshake within ``start_timeout_s``. ``close`` shuts workers down (Shutdown, final drain report, join) within
``close_timeout_s``, kills stragglers, and leaves no orphan processes or shared-memory files. Workers never
outlive the scheduler (a parent-death signal and a parent watch: :mod:`kvoffload.runtime._worker_process`).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import NoReturn

import msgspec

from kvoffload import wire
from kvoffload._generated import (
    EngineSnapshot,
    Hello,
    PeerRole,
    Shutdown,
    StepPlan,
    TieringConfig,
    WorkerReport,
    codecs,
)
from kvoffload.errors import ConfigError, DeadlineError, WireError, WorkerError
from kvoffload.offload.pool import (
    check_pools_fit,
    owned_pool_id,
    plan_host_pool_from_config,
    shared_pool_path,
    sweep_stale_pools,
)
from kvoffload.runtime._channel import Channel
from kvoffload.runtime._liveness import WorkerLink, exit_failure, recv_live
from kvoffload.runtime._worker_process import (
    WorkerSpec,
    process_stopped,
    rank_config,
    run_worker,
    start_ignoring_sigint,
)
from kvoffload.runtime.hooks import HookOptions, encode_hook_options, load_hook
from kvoffload.translate import validate_runnable

__all__ = ["ClusterStep", "WorkerCluster"]


@dataclass(frozen=True, slots=True)
class ClusterStep:
    """Reports of the live workers for one step, their attachments, and the ranks that just died."""

    reports: tuple[WorkerReport, ...]
    attachments: dict[int, tuple[memoryview, ...]]
    newly_dead: tuple[int, ...]
    errors: dict[int, str] = field(default_factory=dict)
    """Why each newly dead rank was given up (its own failure, a stall, an exit status, ...)."""


DEFAULT_WORKER_TIMEOUT_S = 10.0
"""A worker that sends no heartbeat (nor anything else) for this long is given up as stopped or frozen."""

DEFAULT_START_TIMEOUT_S = 120.0
"""All workers must complete the handshake within this long (a large pool takes time to map and fill)."""

DEFAULT_CLOSE_TIMEOUT_S = 10.0
"""``close`` gives all workers together this long to send their final report and exit, then kills them."""

_FAILED_EXIT_GRACE_S = 10.0
"""How long a worker that sent ``WorkerFailure`` may take to release what it holds and exit before it is ended."""


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


class WorkerCluster:
    """N worker processes serving one scheduler over the wire (see module docstring).

    ``worker_timeout_s`` is the liveness deadline (workers send a heartbeat every fifth of it; a stopped process
    sends none, nor takes a plan larger than its socket buffers, so a send that moves no byte for that long gives
    it up too; before the handshake, a process stopped for that long is given up); ``step_timeout_s`` bounds
    one step of a live worker; ``start_timeout_s`` the start-up of all of them (spawn to handshake);
    ``close_timeout_s`` the clean shutdown of all of them in :meth:`close`.
    ``hook`` is the dotted path of a :class:`~kvoffload.runtime.hooks.WorkerHook` factory every worker imports
    and calls around each step, with the JSON-safe ``hook_options`` (ConfigError here when it cannot be
    imported or the options are not JSON).
    """

    def __init__(
        self,
        snapshot: EngineSnapshot,
        *,
        workers: int | None = None,
        shared_pool: bool = False,
        step_timeout_s: float = 120.0,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S,
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
        torch_threads: int | None = None,
        checksums: bool = True,
        tiering: TieringConfig | None = None,
        metrics_dir: str | None = None,
        hook: str | None = None,
        hook_options: HookOptions | None = None,
    ) -> None:
        for name, value in (
            ("step_timeout_s", step_timeout_s),
            ("start_timeout_s", start_timeout_s),
            ("worker_timeout_s", worker_timeout_s),
            ("close_timeout_s", close_timeout_s),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
                raise ConfigError(f"{name}={value!r} must be a number of seconds > 0")
        world = snapshot.engine_config.parallel_config.world_size
        self.world_size = world if workers is None else workers
        if self.world_size != world:
            raise ConfigError(f"workers={workers} differs from parallel_config.world_size={world} of the snapshot")
        if hook is not None:
            load_hook(hook)  # a typo fails here, naming the path, before any process starts
        hook_options_json = encode_hook_options(hook_options)
        self.engine_id = wire.engine_id_of(snapshot)
        self.snapshot = snapshot
        self.step_timeout_s = float(step_timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.worker_timeout_s = float(worker_timeout_s)
        self.close_timeout_s = float(close_timeout_s)
        self.shared_pool = shared_pool
        # Workers record transfer metrics in prometheus_client's multiprocess mode under this directory.
        self.metrics_dir = metrics_dir
        threads = torch_threads or max(1, (os.cpu_count() or 1) // self.world_size)
        # The name carries this process's pid: if it is SIGKILLed, a later start sweeps the file away.
        pool_id = owned_pool_id(f"{self.engine_id}-{uuid.uuid4().hex[:12]}") if shared_pool else None
        self._pool_id = pool_id
        snapshot_json = codecs.encode(snapshot, format="json").decode()
        self._specs = [
            WorkerSpec(
                rank=rank,
                world_size=self.world_size,
                snapshot_json=snapshot_json,
                shared_pool_id=pool_id,
                handshake_timeout_s=start_timeout_s,
                load_timeout_s=step_timeout_s,
                torch_threads=threads,
                heartbeat_interval_s=min(2.0, max(0.01, self.worker_timeout_s / 5)),
                checksums=checksums,
                tiering_json=None if tiering is None else msgspec.json.encode(tiering).decode(),
                metrics_dir=metrics_dir,
                hook=hook,
                hook_options_json=hook_options_json,
            )
            for rank in range(self.world_size)
        ]
        self._procs: dict[int, BaseProcess] = {}
        self._channels: dict[int, Channel] = {}
        self._last_seen: dict[int, float] = {}
        self.dead: set[int] = set()
        self._failing: set[int] = set()  # ranks that reported their own failure and are exiting
        self.errors: dict[int, str] = {}
        """Why each dead rank was given up."""
        self.handshakes: dict[int, wire.HandshakeResult] = {}

    # ------------------------------------------------------------------------------------------- startup

    @property
    def pool_id(self) -> str | None:
        """Name of the shared host pool's segment files (``kvoffload_{pool_id}...``), None for private pools."""
        return self._pool_id

    def start(self) -> None:
        """Check, spawn every worker and complete the Hello handshake with each (WorkerError if one fails).

        Before any process starts: every rank's config must be runnable (ConfigError naming the field), the
        host pools of all ranks together must fit in available memory (HostMemoryError with the numbers), and
        shared-pool files left by dead owners are removed.
        """
        plans = []
        for rank in range(self.world_size):
            ranked, config = rank_config(self.snapshot, rank)
            validate_runnable(ranked, config)
            plans.append(plan_host_pool_from_config(config))
        check_pools_fit(plans, shared=self.shared_pool)
        sweep_stale_pools()
        ctx = mp.get_context("spawn")
        tied = threading.current_thread() is threading.main_thread()  # PR_SET_PDEATHSIG follows the forking thread
        try:
            with contextlib.ExitStack() as env:
                if self.metrics_dir is not None:
                    from kvoffload.metrics import multiprocess_env

                    env.enter_context(multiprocess_env(self.metrics_dir))  # inherited by the spawned workers
                for spec in self._specs:
                    parent, child = ctx.Pipe(duplex=True)
                    spec = msgspec.structs.replace(spec, parent_pid=os.getpid(), parent_death_signal=tied)
                    proc = ctx.Process(
                        target=run_worker,
                        args=(child, msgspec.json.encode(spec)),
                        name=f"kvoffload-worker-{spec.rank}",
                        daemon=True,
                    )
                    start_ignoring_sigint(proc)
                    child.close()
                    self._procs[spec.rank] = proc
                    self._channels[spec.rank] = Channel(parent)
            self._handshake()
        except BaseException:
            self._unlink_pool()
            self.close(timeout_s=min(5.0, self.close_timeout_s))
            raise
        # Every worker replied after mapping the shared pool: its name is no longer needed, and removing it
        # now means no file is left behind whatever happens to the processes later.
        self._unlink_pool()

    def _handshake(self) -> None:
        """Hello to every worker and each one's reply, all within ``start_timeout_s``. A worker sends nothing
        until then (it imports, maps its pool, builds its hook), so it is given up (ended, WorkerError) when it
        exits, fails, is seen stopped for ``worker_timeout_s`` (its process state), or at the deadline."""
        local = wire.make_hello(PeerRole.SCHEDULER, 0, self.world_size, self.engine_id)
        for channel in self._channels.values():
            channel.send(local)
        deadline = time.monotonic() + self.start_timeout_s
        tick = min(0.25, self.worker_timeout_s / 4)
        pending = list(self._channels)
        stopped_since: dict[int, float] = {}
        while pending:
            now = time.monotonic()
            for rank in pending:
                if not process_stopped(self._procs[rank]):
                    stopped_since.pop(rank, None)
                elif now - stopped_since.setdefault(rank, now) >= self.worker_timeout_s:
                    self._give_up(
                        [rank],
                        f"worker {rank} was stopped for {self.worker_timeout_s:g}s during start-up "
                        "(worker_timeout_s): given up",
                    )
            if now >= deadline:
                self._give_up(
                    pending,
                    f"worker {pending[0]} did not complete the handshake within {self.start_timeout_s:g}s "
                    "(start_timeout_s)",
                )
            watched = [(self._channels[r].conn, r) for r in pending] + [(self._procs[r].sentinel, r) for r in pending]
            ready = wait([obj for obj, _ in watched], min(tick, deadline - now))
            for rank in dict.fromkeys(r for obj, r in watched if obj in ready):
                try:
                    reply = self._recv(rank, _remaining(deadline)).message
                    if not isinstance(reply, Hello):
                        raise WireError(f"worker {rank} answered the handshake with {type(reply).__name__}")
                    self.handshakes[rank] = wire.check_hello(local, reply)
                except (WorkerError, WireError, TimeoutError) as exc:
                    self._give_up([rank], str(exc), exc)
                self._last_seen[rank] = time.monotonic()  # heartbeats start now
                pending.remove(rank)

    def _give_up(self, ranks: list[int], reason: str, exc: Exception | None = None) -> NoReturn:
        """Mark ``ranks`` dead (their processes ended: close does not wait for them), raise ``exc`` or ``reason``."""
        for rank in ranks:
            self._mark_dead(rank, [], reason)
        if exc is not None:
            raise exc
        raise WorkerError(reason)

    def _forget_metrics(self, proc: BaseProcess) -> None:
        """Tell the multiprocess metrics that an exited worker's live gauges are gone."""
        if self.metrics_dir is not None and proc.pid is not None and not proc.is_alive():
            from kvoffload.metrics import mark_worker_dead

            mark_worker_dead(proc.pid, self.metrics_dir)

    def _unlink_pool(self) -> None:
        if self._pool_id is not None:
            with contextlib.suppress(FileNotFoundError):
                shared_pool_path(self._pool_id).unlink()

    def _recv(self, rank: int, timeout: float, *, late: str | None = None) -> wire.Decoded:
        """One message from ``rank`` within ``timeout`` (see :func:`~kvoffload.runtime._liveness.recv_live`)."""
        return recv_live(self._link(rank), timeout, self._last_seen, self._failing, late=late)

    def _link(self, rank: int) -> WorkerLink:
        return WorkerLink(rank, self._channels[rank], self._procs[rank], self.worker_timeout_s)

    # -------------------------------------------------------------------------------------------- steps

    @property
    def pids(self) -> dict[int, int]:
        """Process id of each spawned worker, by rank (for operators and fault drills)."""
        return {rank: proc.pid for rank, proc in self._procs.items() if proc.pid is not None}

    @property
    def live_ranks(self) -> list[int]:
        """Ranks still serving."""
        return [r for r in sorted(self._channels) if r not in self.dead]

    def step(self, plan: StepPlan, attachments: Sequence[bytes] = ()) -> ClusterStep:
        """Send ``plan`` to every live worker and gather their reports (a failing worker is marked dead)."""
        newly_dead: list[int] = []
        for rank in self.live_ranks:
            try:
                self._channels[rank].send(plan, attachments, timeout=self.worker_timeout_s)
            except DeadlineError:  # its buffers are full and it reads none: stopped, as the heartbeat would find
                stalled = f"took no byte of step {plan.step}'s plan for {self.worker_timeout_s:g}s (worker_timeout_s)"
                self._mark_dead(rank, newly_dead, f"worker {rank} {stalled}: stopped or frozen")
            except WorkerError as exc:
                self._mark_dead(rank, newly_dead, f"worker {rank}: {exc}")
        reports: list[WorkerReport] = []
        extras: dict[int, tuple[memoryview, ...]] = {}
        for rank in self.live_ranks:
            try:
                decoded = self._recv(rank, self.step_timeout_s)
            except (WorkerError, WireError, TimeoutError) as exc:
                reason = str(exc) if isinstance(exc, WorkerError) else f"worker {rank}: {type(exc).__name__}: {exc}"
                self._mark_dead(rank, newly_dead, reason)
                continue
            message = decoded.message
            if not isinstance(message, WorkerReport) or message.rank != rank:
                got = f"rank {message.rank}" if isinstance(message, WorkerReport) else type(message).__name__
                self._mark_dead(rank, newly_dead, f"worker {rank} answered the step with {got}")
                continue
            reports.append(message)
            extras[rank] = decoded.attachments
        return ClusterStep(tuple(reports), extras, tuple(newly_dead), {r: self.errors[r] for r in newly_dead})

    def _mark_dead(self, rank: int, newly_dead: list[int], reason: str, grace_s: float = _FAILED_EXIT_GRACE_S) -> None:
        """Record why ``rank`` is given up and end its process: SIGTERM, then SIGKILL (all a stopped one obeys)."""
        self.dead.add(rank)
        self.errors[rank] = reason
        newly_dead.append(rank)
        proc = self._procs[rank]
        if rank in self._failing:
            proc.join(grace_s)  # it is closing its hook, pool and tiers on its way out
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
        self._forget_metrics(proc)

    def kill_worker(self, rank: int) -> None:
        """Kill a worker process abruptly (fault-injection for tests and drills)."""
        if (proc := self._procs[rank]).is_alive():
            proc.kill()
        proc.join(5.0)

    def send_raw(self, rank: int, frames: Sequence[bytes]) -> None:
        """Send raw frames to a worker (fault-injection: a corrupted message)."""
        self._channels[rank].send_raw(frames)

    # ------------------------------------------------------------------------------------------ shutdown

    def close(self, timeout_s: float | None = None) -> ClusterStep:
        """Shut every live worker down cleanly and return their final (drain) reports, within a bound.

        All workers together get ``timeout_s`` (default ``close_timeout_s``) to drain, send their final report
        and exit; one that has not by then (a slow drain or hook, a stopped or frozen process, a peer that
        never answers Shutdown) is marked dead and killed, so close returns within about ``timeout_s`` + 1 s.
        Failures are reported as :meth:`step` reports them (``newly_dead`` and ``errors``): a worker that fails
        its drain, and one that fails on its way out after its final report (its hook's, pool's or tiers'
        close: a ``WorkerFailure`` after the report or an exit status other than 0), whose report is kept.
        """
        bound = self.close_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + bound
        reports: list[WorkerReport] = []
        extras: dict[int, tuple[memoryview, ...]] = {}
        newly_dead: list[int] = []
        for rank in self.live_ranks:
            try:
                self._channels[rank].send(Shutdown(reason="scheduler closing"), timeout=_remaining(deadline))
            except DeadlineError:
                stalled = f"took no byte of Shutdown within {bound:g}s of close (close_timeout_s): killed"
                self._mark_dead(rank, newly_dead, f"worker {rank} {stalled}", 0.0)
            except WorkerError as exc:
                self._mark_dead(rank, newly_dead, str(exc), _remaining(deadline))
        for rank in self.live_ranks:
            late = f"worker {rank} did not finish within {bound:g}s of close (close_timeout_s): killed"
            try:
                decoded = self._recv(rank, _remaining(deadline), late=late)
            except (WorkerError, WireError, TimeoutError) as exc:
                self._mark_dead(rank, newly_dead, str(exc), _remaining(deadline))
                continue
            message = decoded.message
            if not isinstance(message, WorkerReport) or message.rank != rank:
                got = f"rank {message.rank}" if isinstance(message, WorkerReport) else type(message).__name__
                self._mark_dead(rank, newly_dead, f"worker {rank} answered Shutdown with {got}", 0.0)
                continue
            reports.append(message)
            extras[rank] = decoded.attachments
        exited = max(deadline, time.monotonic() + 1.0)  # a worker that reported gets a moment to exit
        for rank, proc in self._procs.items():
            proc.join(_remaining(exited) if rank not in self.dead else 0.0)
            if rank in extras and (reason := exit_failure(self._link(rank), bound)) is not None:
                self._mark_dead(rank, newly_dead, reason, 0.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
            self._forget_metrics(proc)
            self._channels[rank].close()
        self._procs.clear()
        self._channels.clear()
        self._unlink_pool()
        return ClusterStep(tuple(reports), extras, tuple(newly_dead), {r: self.errors[r] for r in newly_dead})

    def __enter__(self) -> WorkerCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._procs:
            self.close()
