"""What a secondary tier is: batch stores and loads of records keyed by chunk key, asynchronous, with lookups.

A tier instance serves ONE namespace (one model configuration and rank: see :func:`kvoffload.tiers.namespace_for`). It
never touches engine memory: it moves whole host chunk rows (this rank's slot of a host pool row) to and
from its medium as :mod:`records <kvoffload.tiers._record>`. ``submit_store``/``submit_load`` return at once;
the work runs on the tier's own threads and finished jobs are collected with ``poll`` (the one verb of the
copy engine, the tier worker and the tiers), so tier IO never blocks an engine step.

Faults never reach the engine as exceptions: a failing medium (disk full, server gone) marks the tier
*unavailable* for a back-off interval (doubling up to ``max_backoff_s``); meanwhile lookups miss and stores
are dropped (counted), then the next operation probes the medium again. A medium made of parts (the nodes of a
Valkey cluster) that loses one part fails only the keys that part holds (counted as unreachable), and the tier
stays available. A bad record is a miss, counted and deleted. Every tier holds at most ``max_bytes`` of records
(:class:`~kvoffload.tiers._residency.Residency`: past it the least recently written or read go first) and reports
what it holds (``resident_bytes``, ``resident_records``). :class:`TierBase` implements this bookkeeping once; a
concrete tier writes ``_store_batch``, ``_load_batch``, ``_exists_batch`` and ``_delete``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvoffload._ints import cdiv
from kvoffload.errors import InvalidStateError, RecordError, TierError
from kvoffload.faults import active_faults
from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.scheduler import Direction
from kvoffload.tiers._interface import SecondaryTier, TierIOResult, TierStats
from kvoffload.tiers._record import HEADER_SIZE
from kvoffload.tiers._residency import Residency, index_in_background

__all__ = ["SecondaryTier", "TierBase", "TierIOResult", "TierStats"]


_Out = int | RecordError | TierError | None
"""A batch item's outcome (see :class:`TierBase`)."""


@dataclass(slots=True)
class _Job:
    job_id: int
    direction: Direction
    num_keys: int
    started: float
    pending: int
    failed: list[int] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    unreachable: list[int] = field(default_factory=list)
    num_bytes: int = 0


class TierBase(ABC):
    """Thread pools, job tracking, availability back-off and counters shared by the built-in tiers.

    Subclasses split a job into batches (``_batches``) that run on the read or write pool; each batch
    returns per-item outcomes. An item outcome is the byte count on success, ``None`` for a miss, a
    :class:`RecordError` for a corrupt record (deleted here; one that is sound but unverifiable here is a miss
    and stays) and any other :class:`TierError` for an item whose part of the medium could not be reached while
    the rest answered (a failure; the tier stays available); a :class:`TierError` raised by a batch marks the
    tier unavailable and fails the batch's items. Lookups (``_exists_batch``) answer per key likewise: a bool,
    or a :class:`TierError` for an unreachable key.
    """

    name = "tier"

    def __init__(
        self,
        *,
        n_read_threads: int,
        n_write_threads: int,
        retry_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_bytes: int | None = None,
    ) -> None:
        self.residency = Residency(max_bytes, where=f"{self.name} tier: ")
        """The records this instance holds, least recent first, and its byte bound (see the module docstring)."""
        self._readers = ThreadPoolExecutor(max(1, n_read_threads), thread_name_prefix=f"kvo-{self.name}-read")
        self._writers = ThreadPoolExecutor(max(1, n_write_threads), thread_name_prefix=f"kvo-{self.name}-write")
        self._n_read = max(1, n_read_threads)
        self._n_write = max(1, n_write_threads)
        self._lock = threading.Lock()
        self._done_cv = threading.Condition(self._lock)
        self._jobs: dict[int, _Job] = {}
        self._finished: list[TierIOResult] = []
        self._stats = TierStats()
        self._retry_backoff_s = retry_backoff_s
        self._max_backoff_s = max_backoff_s
        self._backoff_s = retry_backoff_s
        self._down_until = 0.0
        self._in_outage = False  # between a fault and the next success
        self._closed = False
        self._busy: dict[Direction, tuple[int, float]] = {}  # jobs in flight per direction, since when
        self._indexed = threading.Event()
        self._indexed.set()  # until _index_in_background starts a listing

    # ------------------------------------------------------------------ to implement

    @abstractmethod
    def _store_batch(self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> Sequence[int | TierError | None]:
        """Write each row under its key: per item, bytes written, or a TierError for an item that failed."""

    @abstractmethod
    def _load_batch(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview]
    ) -> Sequence[int | RecordError | TierError | None]:
        """Read each key's record into its row: per item, bytes read, None for a miss, a RecordError for a bad
        record, or a TierError for an item that could not be read."""

    @abstractmethod
    def _exists_batch(self, keys: Sequence[OffloadKey]) -> Sequence[bool | TierError]:
        """Whether each key has a record: per key, a bool, or a TierError for a key that could not be asked."""

    @abstractmethod
    def _delete(self, key: bytes) -> None:
        """Remove the record of ``key`` (a bad one); a missing record is no error."""

    def _record_bytes(self, key: bytes, payload_bytes: int) -> int:
        """Bytes a record of ``key`` with ``payload_bytes`` of payload takes on the medium (default: header and
        payload; a medium that pads records says so)."""
        return HEADER_SIZE + len(key) + payload_bytes

    @property
    def max_bytes(self) -> int | None:
        """The most bytes of records this instance keeps (None: unbounded)."""
        return self.residency.max_bytes

    def _enforce_bound(self) -> None:
        """Delete the least recent records past ``max_bytes`` (a record larger than the bound is not kept either)."""
        victims = self.residency.over_limit()
        if not victims:
            return
        with self._lock:
            self._stats.evictions += len(victims)
        for key in victims:
            try:
                self._delete(key)
            except Exception as exc:  # a medium fault, as in lookups: never an exception to the caller
                self._mark_down(exc)
                return

    def _index_in_background(self, listing: Callable[[], Iterable[tuple[bytes, int]]]) -> None:
        """Index the records already on the medium (``listing``, oldest first) off the start path, then apply the
        bound (see :func:`~kvoffload.tiers._residency.index_in_background`)."""
        self._indexed = index_in_background(
            self.residency, listing, then=self._enforce_bound, what=self._describe(), name=f"kvo-{self.name}-index"
        )

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Wait until the records found at start are indexed (True), or ``timeout`` passed (False)."""
        return self._indexed.wait(timeout)

    def _batches(self, n: int, direction: Direction) -> list[range]:
        """How a job of ``n`` items is split across the pool (default: evenly over the pool's threads)."""
        parts = min(n, self._n_write if direction is Direction.STORE else self._n_read)
        if parts <= 1:
            return [range(n)]
        step = cdiv(n, parts)
        return [range(i, min(n, i + step)) for i in range(0, n, step)]

    @property
    def read_threads(self) -> int:
        """Threads that run load batches."""
        return self._n_read

    @property
    def write_threads(self) -> int:
        """Threads that run store batches."""
        return self._n_write

    # ------------------------------------------------------------------ availability

    @property
    def available(self) -> bool:
        """False while the tier backs off after a fault; the first operation after the back-off probes it."""
        return time.monotonic() >= self._down_until

    def is_healthy(self) -> bool:
        """The hot-path check, for every lookup: no IO, no lock, one clock read. False from a fault until an
        operation succeeds again (while it backs off, and after the back-off until the medium answered)."""
        return not self._in_outage and time.monotonic() >= self._down_until

    def probe(self) -> str | None:
        """Why the tier cannot be used right now (None: it can), asking the medium where that is cheap."""
        if self.available:
            return None
        with self._lock:
            return self._stats.last_error or "unavailable"

    def _mark_down(self, exc: BaseException) -> None:
        """A fault: the tier backs off. Faults of operations already in flight when it went down (several
        batches of one job, concurrent jobs) belong to the same outage and neither extend nor double the
        back-off; only a probe that fails after the back-off doubles it."""
        now = time.monotonic()
        with self._lock:
            self._stats.last_error = f"{type(exc).__name__}: {exc}"
            if now < self._down_until:
                return
            if not self._in_outage:
                self._in_outage = True
                self._stats.unavailable_events += 1
            self._down_until = now + self._backoff_s
            self._backoff_s = min(self._max_backoff_s, self._backoff_s * 2)

    def _mark_up(self) -> None:
        if self._in_outage or self._backoff_s != self._retry_backoff_s:
            with self._lock:
                self._in_outage = False
                self._backoff_s = self._retry_backoff_s

    def _describe(self) -> str:
        """How log lines name this tier instance."""
        return f"{self.name} tier"

    # ------------------------------------------------------------------ jobs

    def submit_store(self, job_id: int, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> None:
        """Start writing ``rows[i]`` as the record of ``keys[i]`` (dropped, counted, while unavailable)."""
        self._submit(job_id, keys, rows, Direction.STORE)

    def submit_load(self, job_id: int, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> None:
        """Start reading the records of ``keys`` into ``rows`` (all fail at once while unavailable)."""
        self._submit(job_id, keys, rows, Direction.LOAD)

    def _submit(
        self, job_id: int, keys: Sequence[OffloadKey], rows: Sequence[memoryview], direction: Direction
    ) -> None:
        if self._closed:
            raise InvalidStateError(f"tier {self.name} is closed")
        if len(keys) != len(rows):
            raise InvalidStateError(f"tier job {job_id}: {len(keys)} keys but {len(rows)} rows")
        with self._lock:
            if job_id in self._jobs:
                raise InvalidStateError(f"tier job {job_id} is already in flight")
        n = len(keys)
        if n == 0 or not self.available:
            with self._lock:
                if direction is Direction.STORE:
                    self._stats.stores_dropped += n
                else:
                    self._stats.load_misses += n
                self._finished.append(TierIOResult(job_id, direction, n, tuple(range(n)), 0, 0.0))
                self._done_cv.notify_all()
            return
        batches = self._batches(n, direction)
        job = _Job(job_id, direction, n, time.perf_counter(), len(batches))
        with self._lock:
            self._jobs[job_id] = job
            count, since = self._busy.get(direction, (0, job.started))
            self._busy[direction] = (count + 1, since)
        pool = self._writers if direction is Direction.STORE else self._readers
        for part in batches:
            pool.submit(self._run_batch, job, [keys[i] for i in part], [rows[i] for i in part], part.start)

    def _run_batch(self, job: _Job, keys: list[OffloadKey], rows: list[memoryview], offset: int) -> None:
        outcomes: list[_Out]
        faults = active_faults() if job.direction is Direction.LOAD else None
        answered = False  # the medium answered the batch (its Nones are misses, not a fault's)
        try:
            if faults is not None:
                for i in faults.before_tier_load(len(keys)):
                    self._delete(keys[i])
            outcomes = list(
                self._store_batch(keys, rows) if job.direction is Direction.STORE else self._load_batch(keys, rows)
            )
            answered = True
            self._mark_up()
            if faults is not None:
                for i in faults.damaged_records(rows, [isinstance(o, int) for o in outcomes]):
                    outcomes[i] = RecordError(f"record of key {keys[i].hex()} damaged (an injected fault)")
        except TierError as exc:
            self._mark_down(exc)
            outcomes = [None] * len(keys)
        except Exception as exc:  # a bug or an unexpected library error must not hang the job
            self._mark_down(exc)
            outcomes = [None] * len(keys)
        # A record this reader cannot verify (damaged=False) is a miss here and stays for the readers that can.
        corrupt = [k for k, o in zip(keys, outcomes, strict=True) if isinstance(o, RecordError) and o.damaged]
        corrupt_at = [offset + i for i, o in enumerate(outcomes) if isinstance(o, RecordError) and o.damaged]
        for key in corrupt:
            self.residency.remove(key)
            try:
                self._delete(key)
            except Exception as exc:
                self._mark_down(exc)
        if answered:
            self._note_residency(job, keys, rows, outcomes)
        with self._lock:
            st = self._stats
            for i, outcome in enumerate(outcomes):
                if isinstance(outcome, int):
                    job.num_bytes += outcome
                    if job.direction is Direction.STORE:
                        st.stores += 1
                    else:
                        st.loads += 1
                        st.load_hits += 1
                else:
                    job.failed.append(offset + i)
                    if isinstance(outcome, TierError) and not isinstance(outcome, RecordError):
                        job.unreachable.append(offset + i)
                        st.unreachable_keys += 1
                    if job.direction is Direction.STORE:
                        st.store_failures += 1
                    else:
                        st.loads += 1
                        st.load_misses += 1
            st.corrupt_records += len(corrupt)
            job.corrupt.extend(corrupt_at)
            job.pending -= 1
            if job.pending == 0:
                now = time.perf_counter()
                seconds = now - job.started
                count, since = self._busy[job.direction]
                busy = now - since if count == 1 else 0.0
                if count == 1:
                    del self._busy[job.direction]
                else:
                    self._busy[job.direction] = (count - 1, since)
                if job.direction is Direction.STORE:
                    st.bytes_written += job.num_bytes
                    st.write_seconds += seconds
                    st.write_busy_seconds += busy
                else:
                    st.bytes_read += job.num_bytes
                    st.read_seconds += seconds
                    st.read_busy_seconds += busy
                del self._jobs[job.job_id]
                self._finished.append(
                    TierIOResult(
                        job.job_id,
                        job.direction,
                        job.num_keys,
                        tuple(sorted(job.failed)),
                        job.num_bytes,
                        seconds,
                        tuple(sorted(job.corrupt)),
                        tuple(sorted(job.unreachable)),
                    )
                )
                self._done_cv.notify_all()

    def _note_residency(self, job: _Job, keys: list[OffloadKey], rows: list[memoryview], outcomes: list[_Out]) -> None:
        """Written or read records become the most recent (a read one written by another engine joins), missing
        ones leave; after stores the bound evicts past ``max_bytes``."""
        done = zip(keys, rows, outcomes, strict=True)
        held = [(k, self._record_bytes(k, len(r))) for k, r, o in done if isinstance(o, int)]
        gone = [k for k, o in zip(keys, outcomes, strict=True) if o is None] if job.direction is Direction.LOAD else []
        if self.residency.note(held, gone) and job.direction is Direction.STORE:
            self._enforce_bound()

    def poll(self) -> list[TierIOResult]:
        """Jobs finished since the last call."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: Sequence[int], timeout: float | None = None) -> bool:
        """Block until none of ``job_ids`` is in flight (True) or ``timeout`` seconds passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        wanted = set(job_ids)
        with self._done_cv:
            while wanted & self._jobs.keys():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._done_cv.wait(left)
        return True

    def in_flight(self) -> int:
        """Jobs submitted and not finished yet."""
        with self._lock:
            return len(self._jobs)

    # ------------------------------------------------------------------ lookups, stats, lifetime

    def lookup(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Whether each key has a record; all misses while unavailable or when the medium fails (and misses for
        the keys of a part of it that cannot be reached)."""
        if not keys:
            return []
        if not self.available:
            return [False] * len(keys)
        unreachable = 0
        try:
            answers = self._exists_batch(keys)
            self._mark_up()
            found = [not isinstance(a, TierError) and bool(a) for a in answers]
            unreachable = sum(isinstance(a, TierError) for a in answers)
        except Exception as exc:  # a medium fault (OSError, the client's errors) is a miss, never an exception
            self._mark_down(exc)
            found = [False] * len(keys)
        with self._lock:
            self._stats.lookups += len(keys)
            self._stats.lookup_hits += sum(found)
            self._stats.unreachable_keys += unreachable
        return found

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        """Remove the records of ``keys`` (a missing one is no error; a medium fault marks the tier down)."""
        for key in keys:
            self.residency.remove(key)
            try:
                self._delete(key)
            except Exception as exc:  # a medium fault, as in lookups: never an exception to the caller
                self._mark_down(exc)
                return

    def forget(self, keys: Sequence[bytes]) -> None:
        """The scheduler found these records missing (a promotion failed): drop whatever this instance remembers
        of them (its residency; a tier that caches lookups drops them there too, so it asks the medium again)."""
        for key in keys:
            self.residency.remove(key)

    def stats(self) -> TierStats:
        """A copy of the counters (``available`` and residency as of now)."""
        with self._lock:
            st = self._stats
            return dataclasses.replace(
                st,
                available=self.available,
                resident_bytes=self.residency.nbytes,
                resident_records=len(self.residency),
                extra=dict(st.extra),
            )

    def close(self) -> None:
        """Let in-flight jobs finish, then stop the thread pools."""
        if self._closed:
            return
        self._closed = True
        self._writers.shutdown(wait=True)
        self._readers.shutdown(wait=True)

    def __enter__(self) -> TierBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
