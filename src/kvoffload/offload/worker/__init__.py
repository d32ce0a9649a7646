"""The worker side (torch): :class:`OffloadWorker` applies each ``StepPlan`` to one rank's copy engine.

``copy/`` moves the pages (placement, copy runs, CPU and CUDA backends, the ``CopyEngine`` facade).
"""

from kvoffload.offload.worker._worker import OffloadWorker

__all__ = ["OffloadWorker"]
