"""Which way a job moves bytes; one enum from the scheduler's jobs to the copy backends and the tiers."""

from __future__ import annotations

import enum

__all__ = ["Direction"]


class Direction(enum.Enum):
    """Which way a job moves bytes: STORE is engine → host, LOAD is host → engine."""

    STORE = "store"
    LOAD = "load"

    @property
    def is_store(self) -> bool:
        """True for :attr:`STORE` (the ``is_store`` flag of a :class:`~kvoffload.JobResult`)."""
        return self is Direction.STORE

    @classmethod
    def of(cls, is_store: bool) -> Direction:
        """The direction a wire flag (``is_store``) names."""
        return cls.STORE if is_store else cls.LOAD
