"""Where pages live: the transfer layout of copy segments, defined in :mod:`kvoffload._placement`.

The layout is pure integer math and lives outside the worker side so that the scheduler side
(:func:`kvoffload.translate.validate_runnable`) can run the very checks a worker runs, without loading torch.
This module keeps the copy engine's imports where they were.
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

__all__ = [
    "CopySegment",
    "GroupLayout",
    "KVCacheTensorLike",
    "LayerPlacement",
    "TransferLayout",
    "build_transfer_layout",
    "transfer_layout_from_config",
]
