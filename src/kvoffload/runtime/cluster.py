"""The scheduler side of the runtime: spawn N worker processes, handshake, fan StepPlans out, gather reports.

``WorkerCluster`` owns the worker processes (``multiprocessing`` spawn) and one pipe to each. Every receive
has a timeout, and a worker that dies, hangs past the timeout, or sends a malformed message is marked dead:
its process is terminated and :meth:`WorkerCluster.step` reports it in ``newly_dead`` so the scheduler can
fail the jobs it will never report (requests then fall back to recompute) and carry on with the others.
``close`` shuts workers down cleanly (Shutdown, final drain report, join), kills stragglers, and leaves no
orphan processes or shared-memory files.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import msgspec

from .. import wire
from .._generated import EngineSnapshot, Hello, PeerRole, Shutdown, StepPlan, WorkerReport, codecs
from ..errors import ConfigError, WireError, WorkerError
from ..offload.host_pool import shared_pool_path
from .channel import Channel
from .worker_process import WorkerSpec, run_worker

__all__ = ["ClusterStep", "WorkerCluster"]


@dataclass(frozen=True, slots=True)
class ClusterStep:
    """Reports of the live workers for one step, their attachments, and the ranks that just died."""

    reports: tuple[WorkerReport, ...]
    attachments: dict[int, tuple[memoryview, ...]]
    newly_dead: tuple[int, ...]


class WorkerCluster:
    """N worker processes serving one scheduler over the wire (see module docstring)."""

    def __init__(
        self,
        snapshot: EngineSnapshot,
        *,
        workers: int | None = None,
        shared_pool: bool = False,
        simulate: bool = False,
        step_timeout_s: float = 120.0,
        start_timeout_s: float = 120.0,
        memcpy_probe_bytes: int = 0,
        torch_threads: int | None = None,
        metrics_dir: str | None = None,
    ) -> None:
        world = snapshot.engine_config.parallel_config.world_size
        self.world_size = world if workers is None else workers
        if self.world_size != world:
            raise ConfigError(f"workers={workers} differs from parallel_config.world_size={world} of the snapshot")
        transfer = snapshot.engine_config.kv_transfer_config
        self.engine_id = (transfer.engine_id if transfer else None) or "kvoffload"
        self.snapshot = snapshot
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        # Workers record transfer metrics in prometheus_client's multiprocess mode under this directory.
        self.metrics_dir = metrics_dir
        threads = torch_threads or max(1, (os.cpu_count() or 1) // self.world_size)
        pool_id = f"{self.engine_id}-{uuid.uuid4().hex[:12]}" if shared_pool else None
        self._pool_id = pool_id
        snapshot_json = codecs.encode_engine_snapshot_json(snapshot).decode()
        self._specs = [
            WorkerSpec(
                rank=rank,
                world_size=self.world_size,
                snapshot_json=snapshot_json,
                shared_pool_id=pool_id,
                simulate=simulate,
                handshake_timeout_s=start_timeout_s,
                load_timeout_s=step_timeout_s,
                memcpy_probe_bytes=memcpy_probe_bytes,
                torch_threads=threads,
                metrics_dir=metrics_dir,
            )
            for rank in range(self.world_size)
        ]
        self._procs: dict[int, BaseProcess] = {}
        self._channels: dict[int, Channel] = {}
        self.dead: set[int] = set()
        self.handshakes: dict[int, wire.HandshakeResult] = {}

    # ------------------------------------------------------------------------------------------- startup

    def start(self) -> None:
        """Spawn every worker and complete the Hello handshake with each (WorkerError if one fails)."""
        ctx = mp.get_context("spawn")
        with contextlib.ExitStack() as env:
            if self.metrics_dir is not None:
                from ..metrics import multiprocess_env

                env.enter_context(multiprocess_env(self.metrics_dir))  # inherited by the spawned workers
            for spec in self._specs:
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=run_worker,
                    args=(child, msgspec.json.encode(spec)),
                    name=f"kvoffload-worker-{spec.rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self._procs[spec.rank] = proc
                self._channels[spec.rank] = Channel(parent)
        try:
            local = wire.make_hello(PeerRole.SCHEDULER, 0, self.world_size, self.engine_id)
            for channel in self._channels.values():
                channel.send(local)
            for rank in self._channels:
                reply = self._recv(rank, self.start_timeout_s).message
                if not isinstance(reply, Hello):
                    raise WireError(f"worker {rank} answered the handshake with {type(reply).__name__}")
                self.handshakes[rank] = wire.check_hello(local, reply)
        except BaseException:
            self._unlink_pool()
            self.close(timeout_s=5.0)
            raise
        # Every worker replied after mapping the shared pool: its name is no longer needed, and removing it
        # now means no file is left behind whatever happens to the processes later.
        self._unlink_pool()

    def _forget_metrics(self, proc: BaseProcess) -> None:
        """Tell the multiprocess metrics that an exited worker's live gauges are gone."""
        if self.metrics_dir is not None and proc.pid is not None and not proc.is_alive():
            from ..metrics import mark_worker_dead

            mark_worker_dead(proc.pid, self.metrics_dir)

    def _unlink_pool(self) -> None:
        if self._pool_id is not None:
            with contextlib.suppress(FileNotFoundError):
                shared_pool_path(self._pool_id).unlink()

    def _recv(self, rank: int, timeout: float) -> wire.Decoded:
        """Receive from one worker, turning a death while waiting into WorkerError with its exit code."""
        proc = self._procs[rank]
        channel = self._channels[rank]
        ready = wait([channel.conn, proc.sentinel], timeout)
        if channel.conn in ready:
            return channel.recv(timeout)
        if proc.sentinel in ready:
            proc.join(1.0)
            raise WorkerError(f"worker {rank} exited with status {proc.exitcode}")
        raise WorkerError(f"worker {rank} did not answer within {timeout}s")

    # -------------------------------------------------------------------------------------------- steps

    @property
    def live_ranks(self) -> list[int]:
        """Ranks still serving."""
        return [r for r in sorted(self._channels) if r not in self.dead]

    def step(self, plan: StepPlan, attachments: Sequence[bytes] = ()) -> ClusterStep:
        """Send ``plan`` to every live worker and gather their reports (a failing worker is marked dead)."""
        newly_dead: list[int] = []
        for rank in self.live_ranks:
            try:
                self._channels[rank].send(plan, attachments)
            except WorkerError:
                self._mark_dead(rank, newly_dead)
        reports: list[WorkerReport] = []
        extras: dict[int, tuple[memoryview, ...]] = {}
        for rank in self.live_ranks:
            try:
                decoded = self._recv(rank, self.step_timeout_s)
            except (WorkerError, WireError, TimeoutError):
                self._mark_dead(rank, newly_dead)
                continue
            if not isinstance(decoded.message, WorkerReport) or decoded.message.rank != rank:
                self._mark_dead(rank, newly_dead)
                continue
            reports.append(decoded.message)
            extras[rank] = decoded.attachments
        return ClusterStep(tuple(reports), extras, tuple(newly_dead))

    def _mark_dead(self, rank: int, newly_dead: list[int]) -> None:
        self.dead.add(rank)
        newly_dead.append(rank)
        proc = self._procs[rank]
        if proc.is_alive():
            proc.terminate()
        proc.join(5.0)
        self._forget_metrics(proc)

    def kill_worker(self, rank: int) -> None:
        """Kill a worker process abruptly (fault-injection for tests and drills)."""
        proc = self._procs[rank]
        if proc.pid is not None and proc.is_alive():
            proc.kill()
        proc.join(5.0)

    def send_raw(self, rank: int, frames: Sequence[bytes]) -> None:
        """Send raw frames to a worker (fault-injection: a corrupted message)."""
        self._channels[rank].send_raw(frames)

    # ------------------------------------------------------------------------------------------ shutdown

    def close(self, timeout_s: float = 30.0) -> ClusterStep:
        """Shut every live worker down cleanly and return their final (drain) reports."""
        reports: list[WorkerReport] = []
        extras: dict[int, tuple[memoryview, ...]] = {}
        newly_dead: list[int] = []
        for rank in self.live_ranks:
            try:
                self._channels[rank].send(Shutdown(reason="scheduler closing"))
                decoded = self._recv(rank, timeout_s)
                if isinstance(decoded.message, WorkerReport):
                    reports.append(decoded.message)
                    extras[rank] = decoded.attachments
            except (WorkerError, WireError, TimeoutError):
                newly_dead.append(rank)
        for rank, proc in self._procs.items():
            proc.join(timeout_s if rank not in self.dead else 1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
            self._forget_metrics(proc)
            self._channels[rank].close()
        self._procs.clear()
        self._channels.clear()
        self._unlink_pool()
        return ClusterStep(tuple(reports), extras, tuple(newly_dead))

    def __enter__(self) -> WorkerCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._procs:
            self.close()
