"""The scheduler's extension: how features below the host pool (tiers) plug into its decisions.

An extension is composed into an :class:`~kvoffload.offload.scheduler.OffloadScheduler`
(``OffloadScheduler(config, manager, extension=...)``), never subclassed from it: the scheduler calls these
hooks at fixed points of a step and the extension keeps its own state. It sees the scheduler's requests only
through the arguments it is given, and the host pool through the manager it was built with.
:class:`SchedulerExtension` is the base, every hook a no-op: an extension overrides the hooks it needs, and a
plain instance is the null extension of a scheduler with nothing below its pool.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass

from kvoffload._generated import TierJob, WorkerReport
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager import OffloadEvent
from kvoffload.offload.scheduler._results import ExtensionFigures
from kvoffload.offload.scheduler._tier_filter import TierFilter

__all__ = ["LookupAdvice", "SchedulerExtension"]


@dataclass(frozen=True, slots=True)
class LookupAdvice:
    """What an extension tells one lookup of a request, before the lookup looks at the host pool.

    ``defer``: answer "ask again later" (a tier query or a promotion is in flight); the scheduler counts it as a
    re-ask (``lookups_deferred``), not a lookup. ``unavailable``: host misses a tier could not be asked for (down,
    or not answering in time); their misses count as ``tier_unavailable``. ``chained``: keys the extension writes
    into the host pool with this step's plan ahead of its loads; the lookup counts them as hits and pins them.
    """

    defer: bool = False
    unavailable: Set[OffloadKey] = frozenset()
    chained: Set[OffloadKey] = frozenset()


_NO_ADVICE = LookupAdvice()


class SchedulerExtension:
    """Hooks an :class:`~kvoffload.offload.scheduler.OffloadScheduler` calls, in step order; each a no-op here."""

    def on_new_request(self, req_id: str, load_tiers: TierFilter) -> None:
        """A request was registered with a ``load_tiers`` filter (``add_request``; only called when one was
        given): the tiers its loads may come from (vLLM's ``kv_load_tiers``). Without a call, every tier."""

    def advise_lookup(
        self, req_id: str, keys: Sequence[Sequence[OffloadKey]], num_computed_tokens: int
    ) -> LookupAdvice:
        """Called before a lookup looks at the host pool (see :class:`LookupAdvice`).

        ``keys`` are the request's chunk keys per offloaded group (config order). An extension defers while it
        is still finding out, or bringing into the host pool, chunks the pool does not hold.
        """
        return _NO_ADVICE

    def on_store_completed(self, keys: Sequence[OffloadKey]) -> None:
        """A store job completed on every worker and its chunks are ready in the host pool."""

    def plan_tier_jobs(self) -> tuple[TierJob, ...]:
        """The tier jobs to send with this step's plan; called before the step's stores are planned."""
        return ()

    def on_worker_reports(self, reports: Sequence[WorkerReport]) -> None:
        """This step's worker reports, after the scheduler counted their copy-job results."""

    def fail_in_flight(self) -> None:
        """A worker died: fail every job of the extension's that it may never report."""

    def on_request_finished(self, req_id: str) -> None:
        """The request finished or was aborted: forget what the extension kept for it."""

    def take_events(self) -> list[OffloadEvent]:
        """KV events of what lies below the host pool (records stored or removed, medium ``STORAGE``) since the
        last call; the scheduler's :meth:`~kvoffload.offload.scheduler.OffloadScheduler.take_events` adds them."""
        return []

    def has_pending_work(self) -> bool:
        """Whether the extension has jobs in flight or work still to plan."""
        return False

    def reset(self) -> None:
        """The host pool is being reset (vLLM ``reset_cache``); called before the pool is cleared."""

    def on_reset_flushed(self) -> None:
        """Every copy job in flight at the last reset has reported (at once when none was): no late write can
        land in a freed host row any more (vLLM's ``on_reset_flushed``)."""

    def figures(self) -> ExtensionFigures:
        """What the extension did, for metrics and logs (read on the scheduler's thread; the rows are live)."""
        return ExtensionFigures()

    def describe(self) -> list[str]:
        """One phrase per tier for the engine's start line (kind, where, capacity)."""
        return []

    def close(self) -> None:
        """Release the extension's threads, connections and files."""
