"""The worker side (torch): :class:`OffloadWorker` applies each ``StepPlan`` to one rank's copy engine.

``copy/`` moves the pages (placement, copy runs, CPU and CUDA backends, the ``CopyEngine`` facade);
:class:`LayerwiseCopies` splits the loads a step reads and its stores into per-layer copies.
"""

from kvoffload.offload.worker._layerwise import LayerwiseCopies
from kvoffload.offload.worker._worker import OffloadWorker

__all__ = ["LayerwiseCopies", "OffloadWorker"]
