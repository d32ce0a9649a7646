"""Moves KV pages between the engine's KV memory and the host pool, asynchronously.

The names below are the surface (``__all__``); the modules behind them are private:

* :mod:`kvoffload._placement` (torch-free, shared with the scheduler side's checks) - where each offloaded
  layer's page lives in engine memory and in the host per-block slot (:func:`build_transfer_layout`,
  :func:`transfer_layout_from_config`).
* ``_runs`` - one job's coalesced byte runs (:func:`build_copy_runs`) and the sub-blocks it touches
  (:func:`build_block_slots`, for the integrity table).
* ``_backend`` / ``_cpu`` (with ``_views``) / ``_cuda`` - the :class:`CopyBackend` protocol and its CPU (threads) and
  CUDA (streams) implementations; the CUDA one plans in ``_cuda_plan`` (numpy), issues with ``_cuda_ops`` and
  has an optional zero-copy Triton kernel in ``_cuda_kernel``.
* ``_engine`` - :class:`CopyEngine`, the facade a worker uses: validate, plan, submit, poll.
"""

from kvoffload._placement import (
    CopySegment,
    GroupLayout,
    KVCacheTensorLike,
    LayerPlacement,
    TransferLayout,
    build_transfer_layout,
    transfer_layout_from_config,
)
from kvoffload.offload.worker.copy._backend import CopyBackend, Direction
from kvoffload.offload.worker.copy._engine import CopyEngine
from kvoffload.offload.worker.copy._job import CopyJob
from kvoffload.offload.worker.copy._runs import CopyRuns, IdsLike, build_block_slots, build_copy_runs, check_job_ids

__all__ = [
    "CopyBackend",
    "CopyEngine",
    "CopyJob",
    "CopyRuns",
    "CopySegment",
    "Direction",
    "GroupLayout",
    "IdsLike",
    "KVCacheTensorLike",
    "LayerPlacement",
    "TransferLayout",
    "build_block_slots",
    "build_copy_runs",
    "build_transfer_layout",
    "check_job_ids",
    "transfer_layout_from_config",
]
