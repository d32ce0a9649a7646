"""Stateful property test: the pool's memory of why keys left, and ``remove``, against the manager model.

Extends the HostBlockManager state machine (tests/offload/test_manager_state.py) with ``remove(keys, reason)``
and ``miss_reason(key)``: the model remembers every departure (evicted, store failed, removed for a reason;
a key removed while pinned is dead at once and freed at its last unpin) and predicts each answer.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import rule

from kvoffload import MissReason
from kvoffload.errors import InvalidStateError
from kvoffload.offload.manager import LookupResult
from tests.offload.test_manager_state import KEYS, PENDING, ManagerMachine, key_lists

REMOVE_REASONS = st.sampled_from([MissReason.CORRUPT, MissReason.TIER_UNAVAILABLE])


class MissMachine(ManagerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.departed: dict[bytes, MissReason] = {}
        self.dead: set[bytes] = set()  # removed while pinned: lookups miss, freed at the last unpin

    def _drop_model(self, key: bytes, reason: MissReason) -> None:
        del self.state[key]
        del self.chunk[key]
        self.order.remove(key)
        self.departed[key] = reason
        self.dead.discard(key)

    def ready_keys(self) -> list[bytes]:
        return [key for key in super().ready_keys() if key not in self.dead]

    @rule(picks=st.lists(st.integers(0, 100), max_size=5))
    def load(self, picks: list[int]) -> None:
        if self.ready_keys():  # dead keys are not loadable: the base precondition does not know them
            super().load(picks)

    @rule(keys=key_lists)
    def offer(self, keys: list[bytes]) -> None:
        before = set(self.state)
        super().offer(keys)
        for key in before - set(self.state):
            self.departed[key] = MissReason.EVICTED

    @rule(index=st.integers(0, 100), success=st.booleans(), extra=key_lists)
    def complete_store(self, index: int, success: bool, extra: list[bytes]) -> None:
        if not self.pending_batches:
            return
        before = set(self.state)
        super().complete_store(index, success, extra)
        for key in before - set(self.state):
            self.departed[key] = MissReason.STORE_FAILED

    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        if not self.pins:
            return
        keys = self.pins[index % len(self.pins)]
        super().release(index)
        for key in dict.fromkeys(keys):
            if self.state.get(key) == 0 and key in self.dead:
                self._drop_model(key, self.departed[key])

    @rule(keys=key_lists)
    def load_invalid(self, keys: list[bytes]) -> None:
        if all(key in self.state and self.state[key] >= 0 and key not in self.dead for key in keys):
            return
        with pytest.raises(InvalidStateError):
            self.manager.prepare_load(keys)

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key: bytes) -> None:
        if key not in self.state or key in self.dead:
            expected = LookupResult.MISS
        else:
            expected = LookupResult.HIT_PENDING if self.state[key] == PENDING else LookupResult.HIT
        assert self.manager.lookup(key) == expected

    @rule(keys=key_lists, reason=REMOVE_REASONS)
    def remove(self, keys: list[bytes], reason: MissReason) -> None:
        if any(self.state.get(key) == PENDING for key in keys):
            size = len(self.manager)
            with pytest.raises(InvalidStateError, match="in flight"):
                self.manager.remove(keys, reason)
            assert len(self.manager) == size
            return
        unique = list(dict.fromkeys(keys))
        expected = [key for key in unique if key in self.state and key not in self.dead]
        assert self.manager.remove(keys, reason) == expected
        for key in unique:
            if key not in self.state:
                self.departed[key] = reason
            elif key in self.dead:
                continue  # already dropped: its first reason stands
            elif self.state[key] == 0:
                self._drop_model(key, reason)
            else:
                self.dead.add(key)
                self.departed[key] = reason

    @rule(key=st.sampled_from(KEYS))
    def miss_reason(self, key: bytes) -> None:
        if key in self.state and key not in self.dead:
            expected = MissReason.STORE_PENDING if self.state[key] == PENDING else None
        else:
            expected = self.departed.get(key, MissReason.NEVER_STORED)
        assert self.manager.miss_reason(key) is expected


class ARCMissMachine(MissMachine):
    policy = "arc"


_settings = settings(max_examples=150, stateful_step_count=50, deadline=None)

TestLRUMissStateMachine = MissMachine.TestCase
TestLRUMissStateMachine.settings = _settings
TestARCMissStateMachine = ARCMissMachine.TestCase
TestARCMissStateMachine.settings = _settings
