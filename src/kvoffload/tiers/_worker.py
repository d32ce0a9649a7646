"""The worker side of the tiers: each rank runs the StepPlan's tier jobs on its own host rows.

The scheduler side (:class:`~kvoffload.tiers.Tiering`) decides what to cascade and promote; a
:class:`TierWorker` per rank does the IO between that rank's host rows and its tier namespace, and reports
each job back as a ``TierJobResult`` on the ``WorkerReport``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import cast

import torch

from kvoffload._generated import OffloadingConfig, TieringConfig, TierJob, TierJobResult, ValkeyTierConfig
from kvoffload._packed import Int64Array, pack_int32
from kvoffload.errors import ConfigError
from kvoffload.offload.keys import OffloadKey, key_tags
from kvoffload.offload.pool import BlockSlots, HostPool
from kvoffload.tiers._base import SecondaryTier
from kvoffload.tiers._config import open_tier
from kvoffload.tiers._namespace import namespace_for

__all__ = ["TierWorker"]

_RECENT = 4096  # cascaded keys remembered per tier (for raw baselines: the same records)


class TierWorker:
    """One rank's side of the tiers: runs the StepPlan's tier jobs on this rank's host rows.

    A cascade reads rows into the tier, a promotion writes tier records into rows (verified first). With a
    replicated layout only rank 0 cascades (every rank's rows are identical), and a shared pool's rows are
    promoted by its writer only; other ranks report those jobs done at once.

    Host integrity holds across tiers: a cascade first verifies each row's key tag and checksum in the pool's
    integrity table (a corrupted host chunk is never written out under a fresh record checksum: that key
    fails), and a promotion invalidates the rows' entries when it starts and seals them with the key's tag
    and the promoted bytes' checksum when its record has verified, so the load that follows checks them.
    """

    def __init__(
        self, tiering: TieringConfig, config: OffloadingConfig, pool: HostPool, *, checksums: bool = True
    ) -> None:
        if any(isinstance(t, ValkeyTierConfig) and not t.url for t in tiering.secondary_tiers):
            raise ConfigError("a valkey tier needs its url in the workers (start_embedded_servers fills it in)")
        self.rank = config.parallel.rank
        self.namespace = namespace_for(config, self.rank, row_bytes=pool.plan.slot_bytes)
        self._rows = pool.slot_rows()
        self._cascades = not config.replicated_layout or self.rank == 0
        self._promotes = pool.writes
        self.tiers: list[SecondaryTier] = []
        try:
            for tier_config in tiering.secondary_tiers:
                self.tiers.append(open_tier(tier_config, self.namespace))
        except BaseException:
            self.close()
            raise
        self._jobs: dict[int, int] = {}  # tier job id -> tier index
        self._done: list[TierJobResult] = []
        self._pool = pool
        self._checksums = checksums
        self._host = memoryview(cast("bytearray", pool.rows.reshape(-1).numpy()))
        # tier job id -> (is_promotion, chunk ids, tags, job index of each submitted key, indices failed at submit)
        self._submitted: dict[int, tuple[bool, list[int], list[int], list[int], list[int]]] = {}
        self._keys: dict[int, list[OffloadKey]] = {}  # tier job id -> the keys submitted to the tier
        self._recent: list[deque[OffloadKey]] = [deque(maxlen=_RECENT) for _ in self.tiers]
        self._step_promotions: list[int] = []  # the promotions of the last submit(), until waited for
        self._failed_promoted: set[int] = set()  # chunk ids the promotions since the last submit() failed to fill
        self.wait_s = tiering.promotion_wait_s

    def _slots(self, chunks: Sequence[int], tags: Sequence[int]) -> BlockSlots:
        """Every sub-block of this rank's slot in ``chunks``, expected to hold the keys tagged ``tags``."""
        pool, table = self._pool, self._pool.integrity
        bpc = pool.plan.blocks_per_chunk
        wkb = pool.plan.worker_kv_bytes_per_block
        chunk_ids = torch.tensor(chunks, dtype=torch.int64).repeat_interleave(bpc)
        subs = torch.arange(bpc, dtype=torch.int64).repeat(len(chunks))
        host = chunk_ids * pool.row_bytes + pool.slot_offset + subs * wkb
        chunk_np = chunk_ids.numpy()
        return BlockSlots(
            entries=table.entry_index(chunk_np, subs.numpy()),
            chunk_ids=chunk_np,
            host_offsets=host.tolist(),
            lengths=[wkb] * len(chunk_np),
            tags=torch.tensor(tags, dtype=torch.int64).repeat_interleave(bpc).numpy(),
        )

    def submit(self, jobs: Sequence[TierJob]) -> None:
        """Start the tier jobs of a step plan (returns at once)."""
        self._step_promotions = []  # those of an earlier step nobody waited for finish in the background
        self._failed_promoted = set()
        for job in jobs:
            act = self._promotes if job.is_promotion else self._cascades
            if job.tier >= len(self.tiers):
                bad = pack_int32(range(len(job.keys)))
                self._done.append(TierJobResult(job_id=job.job_id, failed=bad))
                continue
            if not act:  # another rank does this job's IO
                self._done.append(TierJobResult(job_id=job.job_id))
                continue
            chunks = Int64Array.from_buffer(job.chunk_ids).tolist()
            tags = key_tags(job.keys)
            keep = list(range(len(job.keys)))
            failed_now: list[int] = []
            if job.is_promotion:
                self._pool.integrity.invalidate(self._slots(chunks, tags))
            elif chunks:
                slots = self._slots(chunks, tags)
                corrupt = set(self._pool.integrity.verify(slots, self._host, checksums=self._checksums))
                failed_now = [i for i, c in enumerate(chunks) if c in corrupt]
                keep = [i for i, c in enumerate(chunks) if c not in corrupt]
            self._submitted[job.job_id] = (job.is_promotion, chunks, tags, keep, failed_now)
            views = [_row_view(self._rows[chunks[i]]) for i in keep]
            keys = [OffloadKey(job.keys[i]) for i in keep]  # the wire type holds plain bytes
            tier = self.tiers[job.tier]
            if not job.is_promotion:
                self._keys[job.job_id] = keys
            if job.is_promotion:
                tier.submit_load(job.job_id, keys, views)
            else:
                tier.submit_store(job.job_id, keys, views)
            self._jobs[job.job_id] = job.tier
            if job.is_promotion:
                self._step_promotions.append(job.job_id)

    def poll(self) -> list[TierJobResult]:
        """Tier jobs finished since the last call."""
        self._collect()
        out, self._done = self._done, []
        return out

    def _collect(self) -> None:
        """Settle the tier jobs that finished: a promotion's rows are sealed here, so a load may read them."""
        out = self._done
        for t, tier in enumerate(self.tiers):
            finished = tier.poll()
            if not finished:
                continue
            held = tier.stats()  # residency after these jobs, reported with each of them
            for r in finished:
                self._jobs.pop(r.job_id, None)
                keep = self._kept(r.job_id)
                stored = self._keys.pop(r.job_id, None)
                if stored is not None:
                    failed_at = set(r.failed)
                    self._recent[t].extend(k for i, k in enumerate(stored) if i not in failed_at)
                corrupt = sorted(keep[i] for i in r.corrupt) if keep is not None else list(r.corrupt)
                failed = self._settle(r.job_id, list(r.failed))
                out.append(
                    TierJobResult(
                        job_id=r.job_id,
                        failed=pack_int32(failed),
                        num_bytes=r.num_bytes,
                        seconds=r.seconds,
                        corrupt=pack_int32(corrupt),
                        resident_bytes=held.resident_bytes,
                        resident_records=held.resident_records,
                    )
                )

    @property
    def promotes(self) -> bool:
        """Whether this rank runs promotions into its rows (a shared pool's other ranks leave them to its writer)."""
        return self._promotes

    def failed_promotion_chunks(self) -> set[int]:
        """Host chunks that promotions since the last :meth:`submit` settled without filling (their rows stay
        unsealed): a load chained to one of them fails as a tier miss, without reading them."""
        return set(self._failed_promoted)

    def recent_keys(self, tier: int) -> list[OffloadKey]:
        """Keys this rank cascaded to tier ``tier`` successfully, the most recent last (up to 4096)."""
        return list(self._recent[tier])

    def _kept(self, job_id: int) -> list[int] | None:
        """Job indices of the keys submitted to the tier (the others failed verification first)."""
        entry = self._submitted.get(job_id)
        return None if entry is None else entry[3]

    def _settle(self, job_id: int, tier_failed: list[int]) -> list[int]:
        """Job indices of the failed keys; seals the host entries of the keys a promotion brought in."""
        entry = self._submitted.pop(job_id, None)
        if entry is None:
            return tier_failed
        is_promotion, chunks, tags, keep, failed_now = entry
        failed = sorted({keep[i] for i in tier_failed} | set(failed_now))
        if is_promotion:
            self._failed_promoted.update(chunks[i] for i in failed)
            done = sorted(set(range(len(chunks))) - set(failed))
            if done:
                slots = self._slots([chunks[i] for i in done], [tags[i] for i in done])
                self._pool.integrity.seal(slots, self._host, checksums=self._checksums)
        return failed

    def wait_for_promotions(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` (default ``promotion_wait_s``) for the promotions of the last :meth:`submit`, once:
        one still running then finishes in the background (a hung server costs one step, not every step). The
        finished ones are settled (their rows sealed) before it returns; :meth:`poll` reports them."""
        ids, self._step_promotions = self._step_promotions, []
        limit = self.wait_s if timeout is None else timeout
        if not ids or limit <= 0:
            return not ids
        deadline = time.monotonic() + limit
        ok = True
        for t, tier in enumerate(self.tiers):
            mine = [j for j in ids if self._jobs.get(j) == t]
            if mine:
                ok = tier.wait(mine, max(0.0, deadline - time.monotonic())) and ok
        self._collect()  # seal what the promotions brought in: this step's loads may read it
        return ok

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every tier job in flight."""
        ok = True
        for t, tier in enumerate(self.tiers):
            ids = [j for j, tt in self._jobs.items() if tt == t]
            ok = tier.wait(ids, timeout) and ok
        return ok

    def close(self) -> None:
        """Finish in-flight tier jobs and close the tiers."""
        for tier in self.tiers:
            tier.close()
        self.tiers = []


def _row_view(row: torch.Tensor) -> memoryview:
    """A writable memoryview of one contiguous host row (no copy)."""
    return memoryview(cast("bytearray", row.numpy()))
