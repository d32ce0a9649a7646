"""Tier lookups on one background thread, bounded in time (``tier_lookup_timeout_s``, ``tier_down_after_s``).

A request's query gets at most the timeout from its submission: past it the lookup answers from the host pool.
While a query older than the timeout still runs, no new query is queued behind it: lookups answer at once. A tier
is declared down by evidence, not by the engine's own starvation: a lookup that failed, or one still unanswered
after ``tier_down_after_s`` (a hung server); a query that is merely slower than the timeout (a busy host) costs its
request a miss and nothing else. Abandoned queries and recovery probes still finish on the thread; their outcomes
are collected later, so a tier that comes back is noticed without a request paying for it. :meth:`LookupGate.warm`
makes the first contact from the thread at start, so no request pays for starting it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from kvoffload.errors import ConfigError
from kvoffload.offload.keys import OffloadKey
from kvoffload.tiers._base import SecondaryTier
from kvoffload.tiers._health import TierHealth

__all__ = ["LookupGate", "Query", "QueryAnswer"]

_PROBE_KEY = OffloadKey(bytes(36))
"""A key no chunk has: asking for it touches every tier's medium (a stat, an EXISTS) without reading a record."""


@dataclass(frozen=True, slots=True)
class QueryAnswer:
    """Per tier: whether each key is in every rank's namespace, and why the tier could not be asked (None: it was)."""

    found: tuple[tuple[bool, ...], ...]
    faults: tuple[str | None, ...]


@dataclass(slots=True)
class Query:
    """One request's tier query: its keys, the answer to come, and when it was submitted."""

    keys: list[OffloadKey]
    future: Future[QueryAnswer]
    submitted: float


def _ask(per_rank: Sequence[SecondaryTier], keys: Sequence[OffloadKey]) -> tuple[tuple[bool, ...], str | None]:
    """Whether each key is in every rank's namespace, and why some rank's instance could not be asked."""
    present = [True] * len(keys)
    fault: str | None = None
    for tier in per_rank:
        was_up = tier.available
        asked = [i for i, p in enumerate(present) if p]  # a key one rank lacks is missing: the others skip it
        try:
            found = tier.lookup([keys[i] for i in asked]) if asked else []
            for i, hit in zip(asked, found, strict=True):
                present[i] = hit
        except Exception as exc:  # an out-of-tree tier that raises (built-in tiers never do)
            present = [False] * len(keys)
            fault = fault or f"{type(exc).__name__}: {exc}"
            continue
        if fault is None and not (was_up and tier.available):
            fault = tier.stats().last_error or "unavailable"
    return tuple(present), fault


class LookupGate:
    """The scheduler's tier query thread over ``tiers`` (per tier, one instance per rank namespace)."""

    def __init__(
        self, tiers: Sequence[Sequence[SecondaryTier]], timeout_s: float, down_after_s: float, *, log: logging.Logger
    ) -> None:
        for name, value in (("tier_lookup_timeout_s", timeout_s), ("tier_down_after_s", down_after_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        self._tiers = tiers
        self.timeout_s = float(timeout_s)
        self.down_after_s = max(float(down_after_s), self.timeout_s)
        self.late = 0
        """Queries given up past the timeout (``tier_lookups_late``): their requests missed, the tier stayed up."""
        self._log = log
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvo-tier-lookup")
        self._lock = threading.Lock()
        self._running: tuple[int, float] | None = None  # (tier being asked, when its query was submitted)
        self._outstanding: set[Future[QueryAnswer]] = set()
        self._orphans: list[Future[QueryAnswer]] = []  # abandoned queries and probes, collected for health

    def stuck(self) -> tuple[int, float] | None:
        """The tier that a query older than the timeout is still asking, and its age (None: not stuck)."""
        with self._lock:
            running = self._running
        if running is None:
            return None
        age = time.monotonic() - running[1]
        return (running[0], age) if age > self.timeout_s else None

    def idle(self) -> bool:
        """Whether no query or probe is queued or running."""
        with self._lock:
            return not self._outstanding

    def submit(self, keys: list[OffloadKey], health: TierHealth) -> Query | None:
        """Queue a query for ``keys``; None (the lookup answers at once) when every tier backs off after a fault,
        or while the thread is stuck on an older query."""
        if not any(all(t.available for t in per_rank) for per_rank in self._tiers):
            return None
        if self.stuck() is not None:
            self.watch(health)
            return None
        submitted = time.monotonic()
        return Query(keys, self._start(keys, submitted), submitted)

    def warm(self, wait_s: float) -> bool:
        """Start the query thread and make its first contact with every tier (a probe), waiting up to ``wait_s``
        for it, so the first request's lookup pays for neither; whether the probe answered in time (its outcome
        reaches tier health through :meth:`watch` either way)."""
        self.probe()
        pending = [f for f in self._orphans if not f.done()]
        if pending:
            wait_futures(pending, timeout=wait_s)
        return all(f.done() for f in self._orphans)

    def watch(self, health: TierHealth) -> None:
        """Tier health from the thread: finished abandoned queries and probes bring answers, a query unanswered
        past ``tier_down_after_s`` marks its tier down, and a down tier whose back-off is over is probed."""
        for answer in self.collect():
            health.apply(answer.faults)
        stuck = self.stuck()
        if stuck is not None:
            tier, age = stuck
            if age > self.down_after_s:
                health.down(
                    tier, f"a lookup has not answered for {age:.2f} s (tier_down_after_s={self.down_after_s:g})"
                )
        elif self.idle() and any(
            health.is_down(i) and all(t.available for t in per_rank) for i, per_rank in enumerate(self._tiers)
        ):
            self.probe()

    def wait(self, query: Query, seconds: float) -> None:
        """Wait up to ``seconds`` (never past the query's timeout) for its answer."""
        left = min(seconds, self.timeout_s - (time.monotonic() - query.submitted))
        if left > 0:
            wait_futures([query.future], timeout=left)

    def expired(self, query: Query) -> bool:
        """Whether the query has had its ``tier_lookup_timeout_s`` without an answer."""
        return not query.future.done() and time.monotonic() - query.submitted > self.timeout_s

    def abandon(self, query: Query, *, late: bool = False) -> None:
        """Give up on a query: cancelled if it has not started, else its outcome is kept for :meth:`collect`.
        ``late``: it had its timeout (counted in :attr:`late`; the first one is said at INFO)."""
        if late:
            self.late += 1
            if self.late == 1:
                self._log.info(
                    "kvoffload: a tier lookup took longer than tier_lookup_timeout_s=%g s: its request recomputes "
                    "the chunks it asked for (tier_unavailable); the tier stays up unless a lookup fails or stays "
                    "unanswered for tier_down_after_s=%g s (late lookups are counted as tier_lookups_late)",
                    self.timeout_s,
                    self.down_after_s,
                )
        if not query.future.cancel():
            self._orphans.append(query.future)

    def probe(self) -> bool:
        """Ask every tier for a key no chunk has, if the thread is idle; True if asked (see :meth:`collect`)."""
        if not self.idle():
            return False
        self._orphans.append(self._start([_PROBE_KEY], time.monotonic()))
        return True

    def collect(self) -> list[QueryAnswer]:
        """The answers of abandoned queries and probes finished since the last call."""
        done = [f for f in self._orphans if f.done()]
        if not done:
            return []
        self._orphans = [f for f in self._orphans if not f.done()]
        return [f.result() for f in done if not f.cancelled() and f.exception() is None]

    def _start(self, keys: list[OffloadKey], submitted: float) -> Future[QueryAnswer]:
        future = self._pool.submit(self._run, keys, submitted)
        with self._lock:
            self._outstanding.add(future)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: Future[QueryAnswer]) -> None:
        with self._lock:
            self._outstanding.discard(future)

    def _run(self, keys: list[OffloadKey], submitted: float) -> QueryAnswer:
        """Ask every tier in order (on the query thread)."""
        found: list[tuple[bool, ...]] = []
        faults: list[str | None] = []
        try:
            for t, per_rank in enumerate(self._tiers):
                with self._lock:
                    self._running = (t, submitted)
                present, fault = _ask(per_rank, keys)
                found.append(present)
                faults.append(fault)
        finally:
            with self._lock:
                self._running = None
        return QueryAnswer(tuple(found), tuple(faults))

    def close(self) -> None:
        """Drop queued queries and wait for the running one at most the timeout (a hung one is left behind)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            outstanding = list(self._outstanding)
        if outstanding:
            wait_futures(outstanding, timeout=self.timeout_s)
