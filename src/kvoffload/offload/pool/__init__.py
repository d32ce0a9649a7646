"""The host pool: how many chunk rows fit the budget (torch-free), the rows themselves and their integrity table.

``plan_host_pool`` and the shared-pool file helpers import no torch, so the scheduler side can size the pool;
``HostPool`` and ``IntegrityTable`` (torch) load on first use.
"""

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_getattr as _lazy_getattr
from kvoffload.offload.pool._files import (
    available_host_memory_bytes,
    check_pools_fit,
    owned_pool_id,
    shared_pool_path,
    sweep_stale_pools,
)
from kvoffload.offload.pool._plan import (
    PAGE_SIZE,
    HostPoolPlan,
    host_budget,
    plan_host_pool,
    plan_host_pool_from_config,
    table_bytes,
    table_entries,
)

if TYPE_CHECKING:
    from kvoffload.offload.pool._host_pool import HostPool
    from kvoffload.offload.pool._integrity import BlockSlots, Digests, IntegrityTable

_LAZY = {
    "HostPool": "kvoffload.offload.pool._host_pool",
    "BlockSlots": "kvoffload.offload.pool._integrity",
    "Digests": "kvoffload.offload.pool._integrity",
    "IntegrityTable": "kvoffload.offload.pool._integrity",
}


__getattr__ = _lazy_getattr(__name__, _LAZY, globals())


__all__ = [
    "PAGE_SIZE",
    "BlockSlots",
    "Digests",
    "HostPool",
    "HostPoolPlan",
    "IntegrityTable",
    "available_host_memory_bytes",
    "check_pools_fit",
    "host_budget",
    "owned_pool_id",
    "plan_host_pool",
    "plan_host_pool_from_config",
    "shared_pool_path",
    "sweep_stale_pools",
    "table_bytes",
    "table_entries",
]
