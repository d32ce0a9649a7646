"""Early load pins (``prepare_load(..., pending_ok=...)``): a load pinned on a chunk whose write is still in flight.

Chained promotions pin a promoted chunk for its load before the promotion completes. The pin must carry over
when the write seals (the chunk stays unevictable until the load releases it), and a failed write must never
be served: the chunk turns dead and is freed at its last unpin. A stateful test checks the manager against a
model under random stores, early and normal pins, releases, seals and failures.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.errors import InvalidStateError
from kvoffload.offload.keys import OffloadKey, make_offload_key
from kvoffload.offload.manager import HostBlockManager, LookupResult

KEYS = [make_offload_key(bytes([i]) * 32, 0) for i in range(8)]


def _stored_pending(manager: HostBlockManager, keys: list[OffloadKey]) -> None:
    plan = manager.prepare_store(keys)
    assert plan is not None and plan.keys_to_store == keys


def test_an_early_pin_carries_over_when_the_write_seals() -> None:
    manager = HostBlockManager(2)
    key = KEYS[0]
    _stored_pending(manager, [key])
    with pytest.raises(InvalidStateError, match="not ready"):
        manager.prepare_load([key])  # without pending_ok a pending key cannot be loaded
    chunk = manager.prepare_load([key], pending_ok={key})
    assert chunk == [manager.chunk_id(key)]
    assert manager.lookup(key) is LookupResult.HIT_PENDING
    manager.complete_store([key])
    assert manager.is_ready(key)
    assert manager.num_evictable_chunks == 0  # still pinned by the early load
    manager.complete_load([key])
    assert manager.num_evictable_chunks == 1
    assert not manager.has_pending_work()


def test_a_failed_write_with_an_early_pin_is_never_served_and_freed_at_the_last_unpin() -> None:
    manager = HostBlockManager(1)
    key = KEYS[0]
    _stored_pending(manager, [key])
    manager.prepare_load([key], pending_ok={key})
    manager.complete_store([key], success=False)
    assert manager.lookup(key) is LookupResult.MISS
    assert not manager.is_ready(key)
    with pytest.raises(InvalidStateError):
        manager.prepare_load([key])
    assert manager.num_free_chunks == 0  # the early reader still holds the chunk
    manager.complete_load([key])
    assert manager.num_free_chunks == 1
    assert key not in manager
    assert not manager.has_pending_work()


def test_an_early_pin_released_before_the_write_completes() -> None:
    """The chained load failed first (reports are counted before tier results): the write still seals cleanly."""
    manager = HostBlockManager(1)
    key = KEYS[0]
    _stored_pending(manager, [key])
    manager.prepare_load([key], pending_ok={key})
    manager.complete_load([key])
    with pytest.raises(InvalidStateError):
        manager.complete_load([key])  # only one pin was taken
    manager.complete_store([key])
    assert manager.num_evictable_chunks == 1


def test_a_refused_early_pin_leaves_no_pin_behind() -> None:
    manager = HostBlockManager(3)
    ready, pending = KEYS[0], KEYS[1]
    _stored_pending(manager, [ready, pending])
    manager.complete_store([ready])
    with pytest.raises(InvalidStateError):
        manager.prepare_load([pending, ready, KEYS[5]], pending_ok={pending})  # KEYS[5] is not stored
    manager.complete_store([pending])
    assert manager.num_evictable_chunks == 2  # neither the early nor the normal pin stayed


class EarlyPinMachine(RuleBasedStateMachine):
    """Random stores, early and normal pins, releases, seals and failures, against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = HostBlockManager(len(KEYS))
        self.pending: dict[bytes, int] = {}  # key -> early pins
        self.ready: dict[bytes, int] = {}  # key -> pins
        self.dead: dict[bytes, int] = {}  # failed with early pins -> pins left
        self.pins: list[bytes] = []  # one entry per pin taken

    @precondition(lambda self: len(self.pending) + len(self.ready) + len(self.dead) < len(KEYS))
    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        absent = [k for k in KEYS if k not in self.pending and k not in self.ready and k not in self.dead]
        key = data.draw(st.sampled_from(absent))
        _stored_pending(self.manager, [key])
        self.pending[key] = 0

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def pin_early(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pending)))
        self.manager.prepare_load([key], pending_ok={key})
        self.pending[key] += 1
        self.pins.append(key)

    @precondition(lambda self: bool(self.ready))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.ready)))
        self.manager.prepare_load([key], pending_ok={key})  # pending_ok does not change a ready key's pin
        self.ready[key] += 1
        self.pins.append(key)

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.manager.complete_load([key])
        for table in (self.pending, self.ready, self.dead):
            if key in table:
                table[key] -= 1
                if table is self.dead and not table[key]:
                    del table[key]
                break

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), success=st.booleans())
    def finish_write(self, data: st.DataObject, success: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.pending)))
        self.manager.complete_store([key], success=success)
        pins = self.pending.pop(key)
        if success:
            self.ready[key] = pins
        elif pins:
            self.dead[key] = pins

    @invariant()
    def agrees_with_the_model(self) -> None:
        manager = self.manager
        for key in KEYS:
            expected = (
                LookupResult.HIT
                if key in self.ready
                else LookupResult.HIT_PENDING
                if key in self.pending
                else LookupResult.MISS
            )
            assert manager.lookup(key) is expected
            assert manager.is_ready(key) == (key in self.ready)
        resident = len(self.pending) + len(self.ready) + len(self.dead)
        assert len(manager) == resident
        assert manager.num_free_chunks == len(KEYS) - resident
        assert manager.num_evictable_chunks == sum(1 for pins in self.ready.values() if pins == 0)
        assert manager.has_pending_work() == (bool(self.pending) or bool(self.pins))


TestEarlyPins = EarlyPinMachine.TestCase
TestEarlyPins.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
