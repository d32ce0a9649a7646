"""Stateful property test: HostBlockManager against a simple model, for LRU and ARC.

The model tracks, per key, its chunk id and state (pending write, or ready with a pin count). It
predicts every lookup, which keys an offer stores, whether the offer must be refused, the chunk ids of
loads and, for LRU, the exact victims (a plain list in recency order). For ARC, whose victim choice is
adaptive, it checks that victims were ready, unpinned and not offered.
"""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvoffload.errors import InvalidStateError
from kvoffload.offload.manager import HostBlockManager, LookupResult, OffloadEvent

KEYS = [b"key-%02d" % i + b"\x00\x00\x00\x00" for i in range(12)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)

PENDING = -1


class ManagerMachine(RuleBasedStateMachine):
    """Drive the manager with random offers, completions, loads, touches and lookups."""

    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.manager = HostBlockManager(0)
        self.num_chunks = 0
        self.state: dict[bytes, int] = {}  # key -> PENDING or number of pins (0 = ready, unpinned)
        self.chunk: dict[bytes, int] = {}  # key -> chunk id
        self.order: list[bytes] = []  # LRU model: least recent first
        self.pending_batches: list[list[bytes]] = []
        self.pins: list[list[bytes]] = []
        self.events_seen: list[OffloadEvent] = []

    @initialize(num_chunks=st.integers(0, 6))
    def create(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks
        self.manager = HostBlockManager(num_chunks, self.policy, enable_events=True)

    # ------------------------------------------------------------------ rules

    @rule(keys=key_lists)
    def offer(self, keys: list[bytes]) -> None:
        to_store = list(dict.fromkeys(key for key in keys if key not in self.state))
        free = self.num_chunks - len(self.state)
        need = len(to_store) - free
        offered = set(keys)
        candidates = [key for key in self.order if self.state[key] == 0 and key not in offered]
        live_ids_before = set(self.chunk.values())

        plan = self.manager.prepare_store(keys)

        if to_store and need > len(candidates):
            assert plan is None
            event("offer refused")
            return
        event("offer evicts" if need > 0 else "offer fits" if to_store else "offer stores nothing")
        assert plan is not None
        assert plan.keys_to_store == to_store
        assert len(plan.evicted_keys) == max(need, 0)
        assert len(set(plan.evicted_keys)) == len(plan.evicted_keys)
        for key in plan.evicted_keys:
            assert key not in offered, "an offered key was evicted"
            assert self.state[key] == 0, "a pending or pinned key was evicted"
        if self.policy == "lru":
            assert plan.evicted_keys == candidates[: max(need, 0)]
        freed = {self.chunk[key] for key in plan.evicted_keys}
        for key in plan.evicted_keys:
            del self.state[key]
            del self.chunk[key]
            self.order.remove(key)
        assert len(plan.chunk_ids) == len(to_store) == len(set(plan.chunk_ids))
        for chunk_id in plan.chunk_ids:
            assert 0 <= chunk_id < self.num_chunks
            assert chunk_id not in live_ids_before or chunk_id in freed
        for key, chunk_id in zip(to_store, plan.chunk_ids, strict=True):
            self.state[key] = PENDING
            self.chunk[key] = chunk_id
            self.order.append(key)
        if to_store:
            self.pending_batches.append(to_store)

    @rule(keys=key_lists)
    def offer_and_store(self, keys: list[bytes]) -> None:
        """Offer, then complete the store at once: fills the pool with ready chunks quickly."""
        batches = len(self.pending_batches)
        self.offer(keys)
        if len(self.pending_batches) > batches:
            batch = self.pending_batches.pop()
            self.manager.complete_store(batch)
            for key in batch:
                self.state[key] = 0

    @precondition(lambda self: bool(self.pending_batches))
    @rule(index=st.integers(0, 100), success=st.booleans(), extra=key_lists)
    def complete_store(self, index: int, success: bool, extra: list[bytes]) -> None:
        batch = self.pending_batches.pop(index % len(self.pending_batches))
        # extra keys (ready, pinned, absent or pending in another batch) are only affected if pending
        keys = batch + extra
        self.manager.complete_store(keys, success)
        for key in dict.fromkeys(keys):
            if self.state.get(key) != PENDING:
                continue
            if success:
                self.state[key] = 0
            else:
                del self.state[key]
                del self.chunk[key]
                self.order.remove(key)
        if extra:
            self.pending_batches = [
                [key for key in other if self.state.get(key) == PENDING] for other in self.pending_batches
            ]
            self.pending_batches = [other for other in self.pending_batches if other]

    def ready_keys(self) -> list[bytes]:
        return [key for key in self.order if self.state[key] >= 0]

    @precondition(lambda self: any(v >= 0 for v in self.state.values()))
    @rule(picks=st.lists(st.integers(0, 100), max_size=5))
    def load(self, picks: list[int]) -> None:
        ready = self.ready_keys()
        keys = [ready[i % len(ready)] for i in picks]
        assert self.manager.prepare_load(keys) == [self.chunk[key] for key in keys]
        for key in keys:
            self.state[key] += 1
        if keys:
            self.pins.append(keys)

    @rule(keys=key_lists)
    def load_invalid(self, keys: list[bytes]) -> None:
        if all(key in self.state and self.state[key] >= 0 for key in keys):
            return
        evictable = self.manager.num_evictable_chunks
        with pytest.raises(InvalidStateError):
            self.manager.prepare_load(keys)
        assert self.manager.num_evictable_chunks == evictable  # nothing stays pinned

    @precondition(lambda self: bool(self.pins))
    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        keys = self.pins.pop(index % len(self.pins))
        self.manager.complete_load(keys)
        for key in keys:
            self.state[key] -= 1

    @rule(keys=key_lists)
    def touch(self, keys: list[bytes]) -> None:
        self.manager.touch(keys)
        for key in reversed(keys):
            if key in self.state:
                self.order.remove(key)
                self.order.append(key)

    @rule(keys=key_lists, reused=key_lists)
    def finish_request(self, keys: list[bytes], reused: list[bytes]) -> None:
        self.manager.on_request_finished(keys, reused)
        self.touch_model_only(keys)

    def touch_model_only(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            if key in self.state:
                self.order.remove(key)
                self.order.append(key)

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key: bytes) -> None:
        expected = (
            LookupResult.MISS
            if key not in self.state
            else LookupResult.HIT_PENDING
            if self.state[key] == PENDING
            else LookupResult.HIT
        )
        assert self.manager.lookup(key) == expected

    @rule()
    def take_events(self) -> None:
        for offload_event in self.manager.take_events():
            assert offload_event.keys
            if offload_event.metadata_only:
                assert offload_event.removed
                assert not any(key in self.state for key in offload_event.keys)
            self.events_seen.append(offload_event)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def capacity_and_free_chunks(self) -> None:
        assert len(self.manager) == len(self.state) <= self.num_chunks
        assert self.manager.num_free_chunks + len(self.state) == self.num_chunks

    @invariant()
    def chunk_ids_unique_and_known(self) -> None:
        assert len(set(self.chunk.values())) == len(self.chunk)
        for key, chunk_id in self.chunk.items():
            assert self.manager.chunk_id(key) == chunk_id

    @invariant()
    def evictable_count_and_usage(self) -> None:
        evictable = sum(1 for v in self.state.values() if v == 0)
        assert self.manager.num_evictable_chunks == evictable
        if self.num_chunks:
            stats = self.manager.stats()
            pending = sum(1 for v in self.state.values() if v == PENDING)
            assert stats.usage == pytest.approx((len(self.state) - evictable) / self.num_chunks)
            assert stats.write_usage == pytest.approx(pending / self.num_chunks)

    @invariant()
    def lru_order_matches(self) -> None:
        if self.policy == "lru":
            assert self.manager.policy.lru_order() == self.order  # type: ignore[attr-defined]

    def teardown(self) -> None:
        for keys in self.pins:
            self.manager.complete_load(keys)
            for key in keys:
                self.state[key] -= 1
        self.pins.clear()
        for batch in self.pending_batches:
            self.manager.complete_store(batch)
        assert not self.manager.has_pending_work(), "a pin or a pending store was not released"
        assert self.manager.num_evictable_chunks == len(self.manager)


class ARCManagerMachine(ManagerMachine):
    policy = "arc"


_settings = settings(max_examples=200, stateful_step_count=50, deadline=None)

TestLRUManagerStateMachine = ManagerMachine.TestCase
TestLRUManagerStateMachine.settings = _settings
TestARCManagerStateMachine = ARCManagerMachine.TestCase
TestARCManagerStateMachine.settings = _settings
