"""The host block manager: which offload key lives in which host chunk, and in which state (vLLM 0.33 semantics).

Scheduler side, torch-free. ``_state`` holds the key -> chunk table and its read side (lookups, pins, miss
reasons), ``_manager`` the write side (stores, evictions, drops, resets, events), ``_results`` what it answers,
``_requests`` a finished request's keys as the policy gets them; ``policies/`` the replacement policies and the
per-request context (``RequestContext``: key positions) they are handed.
"""

from kvoffload.offload.manager._manager import HostBlockManager
from kvoffload.offload.manager._results import LookupResult, ManagerStats, OffloadEvent, StorePlan

__all__ = ["HostBlockManager", "LookupResult", "ManagerStats", "OffloadEvent", "StorePlan"]
