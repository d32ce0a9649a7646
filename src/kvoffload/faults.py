"""Fault injection for tests and chaos runs: load faults at random points of the tiers and the copy path.

Off unless the environment variable :data:`FAULTS_ENV` holds a JSON :class:`FaultPlan`, or ``@PATH`` of a file
holding one (every process of an engine reads it, so spawned workers inject too; a plan file is read again when it
changes, so a test can switch faults between rounds of one engine, and no file means no faults). Each fault is one
the engine must survive without a wrong token: a tier record read that fails its check (its row scribbled over
first, as a damaged record leaves it), a record deleted between the lookup and the read, a host-to-engine load job
failed without copying (its engine blocks left as they were), or a signal sent to a server process the first time
a tier reads (a Valkey server frozen or killed mid-promotion). With ``log`` set, every fault appends one line to
that file, so a run can count what it injected across processes.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Sequence
from functools import lru_cache

import msgspec

from kvoffload.errors import ConfigError

__all__ = ["FAULTS_ENV", "FaultPlan", "Faults", "active_faults"]

FAULTS_ENV = "KVOFFLOAD_FAULTS"


class FaultPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What to inject, and how often (probabilities in [0, 1])."""

    seed: int = 0
    """Seeds each process's generator (mixed with its pid, so ranks draw differently)."""
    tier_record: float = 0.0
    """Per record of a tier load: the read fails as a damaged record (the row is scribbled over first)."""
    tier_delete: float = 0.0
    """Per tier load batch: half its records are deleted just before the read (another process removed them)."""
    host_load: float = 0.0
    """Per host-to-engine load job: the job fails without copying."""
    signal_pid: int = 0
    """A process to signal the first time a tier load runs in this process (0: none)."""
    signal_name: str = "SIGSTOP"
    """The signal sent to ``signal_pid`` (``SIGSTOP`` freezes a server, ``SIGKILL`` kills it)."""
    log: str = ""
    """A file every injected fault appends one line to (``kind count``); empty: no log."""

    def __post_init__(self) -> None:
        for name in ("tier_record", "tier_delete", "host_load"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{FAULTS_ENV}: {name} must be a probability in [0, 1], got {value!r}")
        if self.signal_name not in signal.Signals.__members__:
            raise ConfigError(f"{FAULTS_ENV}: signal_name {self.signal_name!r} is not a signal name")


class Faults:
    """The injection points, drawing from one plan (thread-safe: tier threads and the worker share it)."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed * 1_000_003 + os.getpid())
        self._lock = threading.Lock()
        self._signalled = False
        self.injected: dict[str, int] = {}
        """Faults injected in this process, by kind."""

    def _draw(self, p: float) -> bool:
        if p <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < p

    def _count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.injected[kind] = self.injected.get(kind, 0) + n
        if self.plan.log:
            with open(self.plan.log, "a", encoding="ascii") as out:  # one short line: appends do not interleave
                out.write(f"{kind} {n}\n")

    def before_tier_load(self, count: int) -> list[int]:
        """At the start of a tier load batch of ``count`` records: send the plan's signal once, and return the
        indices of the records to delete before the read (empty unless ``tier_delete`` drew this batch)."""
        plan = self.plan
        if plan.signal_pid:
            with self._lock:
                first, self._signalled = not self._signalled, True
            if first:
                self._count("signal")
                os.kill(plan.signal_pid, signal.Signals[plan.signal_name])
        if count and self._draw(plan.tier_delete):
            doomed = list(range(0, count, 2))
            self._count("tier_delete", len(doomed))
            return doomed
        return []

    def damaged_records(self, rows: Sequence[memoryview], read: Sequence[bool]) -> list[int]:
        """After a tier load batch: which of the records read (``read[i]``) fail as damaged; their rows are
        scribbled over, as a record caught by its checksum leaves the row it was read into."""
        picked = [i for i, ok in enumerate(read) if ok and self._draw(self.plan.tier_record)]
        for i in picked:
            row = rows[i]
            row[: min(64, row.nbytes)] = bytes(range(min(64, row.nbytes)))
        if picked:
            self._count("tier_record", len(picked))
        return picked

    def fail_host_load(self) -> bool:
        """Whether this host-to-engine load job fails without copying."""
        if self._draw(self.plan.host_load):
            self._count("host_load")
            return True
        return False


def active_faults() -> Faults | None:
    """The faults of this process now: None (the default) unless :data:`FAULTS_ENV` holds a plan or names a plan
    file that exists. Cheap enough for every load batch: one ``stat`` for a plan file, nothing otherwise."""
    text = os.environ.get(FAULTS_ENV, "")
    if not text:
        return None
    if not text.startswith("@"):
        return _faults(text, 0)
    try:
        changed = os.stat(text[1:]).st_mtime_ns
    except OSError:
        return None
    return _faults(text, changed)


@lru_cache(maxsize=1)
def _faults(source: str, changed: int) -> Faults:
    """The faults of a plan (``@PATH``: read from that file, modified at ``changed``); one instance per version."""
    if source.startswith("@"):
        try:
            with open(source[1:], "rb") as f:
                source_bytes = f.read(1 << 16)
        except OSError as exc:
            raise ConfigError(f"{FAULTS_ENV}: cannot read the plan file {source[1:]!r}: {exc}") from None
    else:
        source_bytes = source.encode()
    try:
        plan = msgspec.json.decode(source_bytes, type=FaultPlan)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{FAULTS_ENV}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{FAULTS_ENV} is not a JSON fault plan: {exc}") from None
    return Faults(plan)
