"""One copy job as the copy engine takes it: which engine blocks move to (or from) which host chunks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload._generated import TransferJob
from kvoffload._packed import Int32Array, Int64Array
from kvoffload.offload._direction import Direction
from kvoffload.offload.worker.copy._runs import IdsLike

__all__ = ["CopyJob"]


@dataclass(frozen=True, slots=True)
class CopyJob:
    """A store (engine → host) or load (host → engine) of some blocks of each offloaded group.

    Group ``g`` moves ``group_sizes[g]`` blocks starting at its ``block_indices[g]``-th block of the request;
    ``block_ids`` lists the engine block ids of all groups back to back; ``chunk_ids[i]`` is the host chunk of
    the ``i``-th chunk touched and ``chunk_tags[i]`` its key tag (:func:`~kvoffload.offload.keys.key_tag`;
    None: untagged).
    """

    job_id: int
    direction: Direction
    group_sizes: Sequence[int]
    block_indices: Sequence[int]
    block_ids: IdsLike
    chunk_ids: IdsLike
    chunk_tags: IdsLike | None = None

    @classmethod
    def from_transfer(cls, job: TransferJob, direction: Direction) -> CopyJob:
        """The copy job a StepPlan's :class:`~kvoffload.TransferJob` describes (packed arrays unpacked)."""
        return cls(
            job_id=job.job_id,
            direction=direction,
            group_sizes=Int32Array.from_buffer(job.group_sizes).tolist(),
            block_indices=Int32Array.from_buffer(job.block_indices).tolist(),
            block_ids=Int64Array.from_buffer(job.block_ids).to_tensor(),
            chunk_ids=Int64Array.from_buffer(job.chunk_ids).to_tensor(),
            chunk_tags=Int64Array.from_buffer(job.chunk_tags).to_tensor() if job.chunk_tags else None,
        )
