"""The scheduler's extension interface: how features below the host pool (tiers) plug into its decisions.

An extension is composed into an :class:`~kvoffload.offload.scheduler.OffloadScheduler`
(``OffloadScheduler(config, manager, extension=...)``), never subclassed from it: the scheduler calls these
hooks at fixed points of a step and the extension keeps its own state. It sees the scheduler's requests only
through the arguments it is given, and the host pool through the manager it was built with.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Protocol

from kvoffload._generated import TierJob, WorkerReport
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager import OffloadEvent
from kvoffload.offload.scheduler._tier_filter import TierFilter

__all__ = ["SchedulerExtension"]


class SchedulerExtension(Protocol):
    """Hooks an :class:`~kvoffload.offload.scheduler.OffloadScheduler` calls, in step order."""

    def on_new_request(self, req_id: str, load_tiers: TierFilter) -> None:
        """A request was registered with a ``load_tiers`` filter (``add_request``; only called when one was
        given): the tiers its loads may come from (vLLM's ``kv_load_tiers``). Without a call, every tier."""
        ...

    def defer_lookup(self, req_id: str, keys: Sequence[Sequence[OffloadKey]], num_computed_tokens: int) -> bool:
        """Called before a lookup looks at the host pool; True answers "ask again later" instead.

        ``keys`` are the request's chunk keys per offloaded group (config order). An extension defers while it
        is still finding out, or bringing into the host pool, chunks the pool does not hold (a tier query or a
        promotion in flight); the scheduler counts the deferral as a re-ask (``lookups_deferred``), not a lookup.
        """
        ...

    def unavailable_keys(self, req_id: str) -> Set[OffloadKey]:
        """Keys of the request's chunks, missing from the host pool, that the extension could not look for (a tier
        was unavailable or did not answer in time); the lookup counts their misses as ``tier_unavailable``."""
        ...

    def chained_promotions(self, req_id: str) -> Set[OffloadKey]:
        """Keys of the request the extension is writing into the host pool with this step's plan, ahead of the
        plan's loads (the workers run such a write before a load that reads its chunks): the lookup counts them
        as hits and pins them before their write completes. Empty when the extension does not chain."""
        ...

    def on_store_completed(self, keys: Sequence[OffloadKey]) -> None:
        """A store job completed on every worker and its chunks are ready in the host pool."""
        ...

    def plan_tier_jobs(self) -> tuple[TierJob, ...]:
        """The tier jobs to send with this step's plan; called before the step's stores are planned."""
        ...

    def on_worker_reports(self, reports: Sequence[WorkerReport]) -> None:
        """This step's worker reports, after the scheduler counted their copy-job results."""
        ...

    def fail_in_flight(self) -> None:
        """A worker died: fail every job of the extension's that it may never report."""
        ...

    def on_request_finished(self, req_id: str) -> None:
        """The request finished or was aborted: forget what the extension kept for it."""
        ...

    def take_events(self) -> list[OffloadEvent]:
        """KV events of what lies below the host pool (records stored or removed, medium ``STORAGE``) since the
        last call; the scheduler's :meth:`~kvoffload.offload.scheduler.OffloadScheduler.take_events` adds them."""
        ...

    def has_pending_work(self) -> bool:
        """Whether the extension has jobs in flight or work still to plan."""
        ...

    def reset(self) -> None:
        """The host pool is being reset (vLLM ``reset_cache``); called before the pool is cleared."""
        ...

    def close(self) -> None:
        """Release the extension's threads, connections and files."""
        ...
