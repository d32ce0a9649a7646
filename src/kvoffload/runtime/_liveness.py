"""How the scheduler hears from one worker process: a receive that skips heartbeats and gives the worker up
when it fails, exits, hangs up or stays silent past its heartbeat deadline, and what a worker that sent its final
report still has to say on its way out."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from kvoffload import wire
from kvoffload._generated import Heartbeat, WorkerFailure
from kvoffload.errors import WireError, WorkerError
from kvoffload.runtime._channel import Channel

__all__ = ["WorkerLink", "exit_failure", "recv_live"]


@dataclass(frozen=True, slots=True)
class WorkerLink:
    """One worker as the scheduler sees it: its rank, pipe, process and heartbeat deadline."""

    rank: int
    channel: Channel
    proc: BaseProcess
    worker_timeout_s: float


def recv_live(
    link: WorkerLink, timeout: float, last_seen: dict[int, float], failing: set[int], *, late: str | None = None
) -> wire.Decoded:
    """Receive one message from ``link`` within ``timeout``, skipping heartbeats.

    Raises WorkerError naming the rank when the worker reports a failure (its exception type and message; the rank
    is added to ``failing``), exits, stays silent past the heartbeat deadline counted from ``last_seen[rank]``
    (stopped or frozen; no deadline before the handshake set it) or past ``timeout`` (then with the message
    ``late`` when given). Every message received moves ``last_seen[rank]`` on.
    """
    rank, channel, proc = link.rank, link.channel, link.proc
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        seen = last_seen.get(rank)
        alive_until = float("inf") if seen is None else seen + link.worker_timeout_s
        # Messages already waiting count first: heartbeats queue up while the scheduler is busy elsewhere.
        ready = wait([channel.conn, proc.sentinel], max(0.0, min(deadline, alive_until) - now))
        if not ready:
            if time.monotonic() >= alive_until:
                raise WorkerError(
                    f"worker {rank} sent no heartbeat for {link.worker_timeout_s:g}s (worker_timeout_s): "
                    "stopped or frozen"
                )
            if time.monotonic() >= deadline:
                raise WorkerError(late or f"worker {rank} did not answer within {timeout:g}s")
            continue
        if channel.conn in ready:
            try:
                decoded = channel.recv(max(link.worker_timeout_s, 1.0))
            except WorkerError:
                proc.join(1.0)
                raise WorkerError(f"worker {rank} hung up without a reason (exit status {proc.exitcode})") from None
            if seen is not None:
                last_seen[rank] = time.monotonic()
            message = decoded.message
            if isinstance(message, Heartbeat):
                continue
            if isinstance(message, WorkerFailure):
                failing.add(rank)
                raise WorkerError(
                    f"worker {rank} failed at step {message.step}: {message.error_type}: {message.message}"
                )
            return decoded
        if proc.sentinel in ready:
            proc.join(1.0)
            raise WorkerError(f"worker {rank} exited with status {proc.exitcode}")


def exit_failure(link: WorkerLink, close_timeout_s: float) -> str | None:
    """Why a worker that sent its final report did not end cleanly (None when it did): a ``WorkerFailure``
    sent after the report (its hook's, pool's or tiers' close failed), no exit by the close deadline, or an exit
    status other than 0."""
    rank, channel, proc = link.rank, link.channel, link.proc
    with contextlib.suppress(WorkerError, WireError, TimeoutError):  # a hang-up ends what it had to say
        while channel.conn.poll(0):
            message = channel.recv(1.0).message
            if isinstance(message, WorkerFailure):
                return f"worker {rank} failed after its final report: {message.error_type}: {message.message}"
    if proc.is_alive():
        return (
            f"worker {rank} did not exit within {close_timeout_s:g}s of close (close_timeout_s) after its final report"
        )
    if proc.exitcode:
        return f"worker {rank} exited with status {proc.exitcode} after its final report"
    return None
