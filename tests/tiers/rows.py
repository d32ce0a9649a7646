"""Row, key and round-trip helpers shared by the tier tests (disk and Valkey)."""

from __future__ import annotations

import torch

from kvoffload.tiers import Namespace, SecondaryTier, namespace_for
from tests.helpers import offloading_config


def namespace(row: int, rank: int = 0, dtype: str = "float16") -> Namespace:
    """The namespace of a plain config whose host rows are ``row`` bytes."""
    return namespace_for(offloading_config(worker_kv_bytes_per_block=row, dtype=dtype), rank)


def random_rows(n: int, row: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, row), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt]) * 32 + i.to_bytes(4, "big") for i in range(n)]


def views(rows: torch.Tensor) -> list[memoryview]:
    return [memoryview(r.numpy()) for r in rows]


def store(tier: SecondaryTier, chunk_keys: list[bytes], rows: torch.Tensor, job: int = 1) -> tuple[int, ...]:
    """Store ``rows`` under ``chunk_keys`` and wait; the indices of the keys that failed."""
    tier.submit_store(job, chunk_keys, views(rows))
    assert tier.wait([job], 30)
    (result,) = tier.poll()
    return tuple(result.failed)


def load(tier: SecondaryTier, chunk_keys: list[bytes], row: int, job: int = 2) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Load ``chunk_keys`` into fresh rows and wait; the rows and the indices of the keys that failed."""
    out = torch.zeros((len(chunk_keys), row), dtype=torch.uint8)
    tier.submit_load(job, chunk_keys, views(out))
    assert tier.wait([job], 30)
    (result,) = tier.poll()
    return out, tuple(result.failed)
