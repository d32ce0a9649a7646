"""Replacement policies of the host pool: the :class:`CachePolicy` interface, LRU, ARC, and the registry.

A policy orders resident chunks and picks eviction victims; the manager calls it at vLLM 0.33's points.
Register your own with :func:`register_policy` and name it in the manager (``HostBlockManager(policy=...)``), or
name a class of a module (``HostBlockManager(policy="MyPolicy", cache_policy_module_path="my.module")``). A request's
:class:`RequestContext` carries its keys' end-token positions to the policy.
"""

from kvoffload.offload.manager.policies._arc import ARCPolicy
from kvoffload.offload.manager.policies._base import CachePolicy, check_evict_count
from kvoffload.offload.manager.policies._context import RequestContext, order_request_keys
from kvoffload.offload.manager.policies._lru import LRUPolicy
from kvoffload.offload.manager.policies._registry import (
    PolicyFactory,
    available_policies,
    make_policy,
    policy_factory,
    register_policy,
)

__all__ = [
    "ARCPolicy",
    "CachePolicy",
    "LRUPolicy",
    "PolicyFactory",
    "RequestContext",
    "available_policies",
    "check_evict_count",
    "make_policy",
    "order_request_keys",
    "policy_factory",
    "register_policy",
]
