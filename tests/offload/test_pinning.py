"""Registering the host pool: what is registered (exactly the rows this process maps, once, never per rank),
in the background (construction does not wait), and unregistered once, after the memory's last use.

The bookkeeping runs here with a recording registrar (``register``/``unregister`` are the class's seams for
the CUDA runtime's calls); the tests marked ``cuda`` register for real and skip without a GPU.
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from kvoffload.errors import ConfigError, InvalidStateError
from kvoffload.offload.pool import HostPool, HostPoolPlan, plan_host_pool
from kvoffload.offload.pool._pinning import HostRegistration, live_registrations, pin_bytes

F = TypeVar("F", bound=Callable[..., object])


def needs_cuda(test: F) -> F:
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def _plan(*, world_size: int = 1, rank: int = 0, replicated: bool = False, budget: int = 10**6) -> HostPoolPlan:
    return plan_host_pool(
        worker_kv_bytes_per_block=1000,
        world_size=world_size,
        blocks_per_chunk=3,
        cpu_bytes_to_use=budget,
        replicated=replicated,
        rank=rank,
    )


class Registrar:
    """Records the registration calls; ``hold`` keeps a registration running until released."""

    def __init__(self, error: str | None = None, hold: bool = False) -> None:
        self.registered: list[tuple[int, int, int]] = []  # (address, size, thread)
        self.unregistered: list[int] = []
        self.error = error
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def register(self, address: int, size: int) -> str | None:
        self.registered.append((address, size, threading.get_ident()))
        assert self.release.wait(30)
        return self.error

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


class Owner:
    """Stands for the memory behind an address (weakly referenceable)."""


# -- what is registered -------------------------------------------------------------------------------


def test_pin_bytes_are_the_rows_one_process_maps() -> None:
    private = _plan(world_size=4, rank=2)
    assert pin_bytes(private, shared=False) == private.num_chunks * private.slot_bytes == 81 * 3000
    for rank in range(4):
        split = _plan(world_size=4, rank=rank)
        assert pin_bytes(split, shared=True) == split.total_bytes == split.num_chunks * split.row_bytes
        replicated = _plan(world_size=4, rank=rank, replicated=True)
        # one copy of the cache for all ranks: each rank registers the one file's rows, not world_size of them
        assert pin_bytes(replicated, shared=True) == replicated.total_bytes
        assert replicated.total_bytes <= 10**6  # within the budget, not multiplied by the ranks


def test_pools_report_what_they_register() -> None:
    with HostPool(_plan(world_size=4, rank=2)) as private:
        assert private.pin_bytes == 81 * 3000 == private.rows.numel()
        assert private.wait_pinned(timeout=60) == private.is_pinned == torch.cuda.is_available()
    engine_id = f"test-{uuid.uuid4().hex[:12]}"
    plans = [_plan(world_size=2, rank=r, replicated=True) for r in (0, 1)]
    with HostPool(plans[0], engine_id=engine_id) as rank0, HostPool(plans[1], engine_id=engine_id) as rank1:
        for pool in (rank0, rank1):
            assert pool.pin_bytes == plans[0].total_bytes == pool.rows.numel()  # the rows, not the table after them
        assert rank0.rows.data_ptr() != rank1.rows.data_ptr()  # two mappings of one file: each registers its own


# -- the registration ---------------------------------------------------------------------------------


def test_registration_runs_in_the_background_exactly_once() -> None:
    registrar = Registrar(hold=True)
    owner = Owner()
    started = time.monotonic()
    registration = HostRegistration(0x10000, 5000, owner, register=registrar.register, unregister=registrar.unregister)
    assert time.monotonic() - started < 5
    assert not registration.done and not registration.pinned and not registration.wait(timeout=0.01)
    assert live_registrations()[0x10000] == 5000
    registrar.release.set()
    assert registration.wait(timeout=30) and registration.pinned and registration.error is None
    assert registration.seconds is not None
    ((address, size, thread),) = registrar.registered
    assert (address, size) == (0x10000, 5000) and thread != threading.get_ident()
    registration.close()
    registration.close()
    assert registrar.unregistered == [0x10000]
    assert 0x10000 not in live_registrations() and not registration.pinned


@pytest.mark.parametrize(("address", "size"), [(0x20000, 100), (0x20000 - 50, 51), (0x20000 + 99, 1000)])
def test_an_overlapping_range_is_refused_without_registering(address: int, size: int) -> None:
    registrar = Registrar()
    first = HostRegistration(0x20000, 100, Owner(), register=registrar.register, unregister=registrar.unregister)
    try:
        with pytest.raises(InvalidStateError, match="overlaps a live registration"):
            HostRegistration(address, size, Owner(), register=registrar.register, unregister=registrar.unregister)
        first.wait(30)
        assert len(registrar.registered) == 1
    finally:
        first.close()
    # once unregistered, the range may be registered again (a new mapping at the same address)
    again = HostRegistration(0x20000, 100, Owner(), register=registrar.register, unregister=registrar.unregister)
    again.close()
    assert [a for a, _, _ in registrar.registered] == [0x20000, 0x20000]


def test_the_neighbouring_range_is_not_an_overlap() -> None:
    registrar = Registrar()
    ranges = [(0x30000, 100), (0x30000 + 100, 100)]
    both = [
        HostRegistration(a, n, Owner(), register=registrar.register, unregister=registrar.unregister) for a, n in ranges
    ]
    for registration in both:
        assert registration.wait(30)
        registration.close()
    assert sorted(registrar.unregistered) == [0x30000, 0x30064]


@pytest.mark.parametrize("failure", ["error", "raise"])
def test_a_refused_registration_stays_pageable_and_is_not_unregistered(failure: str) -> None:
    registrar = Registrar(error="cudaHostRegister: out of memory (2)")

    def raising(address: int, size: int) -> str | None:
        raise RuntimeError("driver gone")

    register = registrar.register if failure == "error" else raising
    registration = HostRegistration(0x40000, 10, Owner(), register=register, unregister=registrar.unregister)
    assert not registration.wait(timeout=30) and registration.done
    assert registration.error == (
        "cudaHostRegister: out of memory (2)" if failure == "error" else "RuntimeError: driver gone"
    )
    registration.close()
    assert registrar.unregistered == []
    assert 0x40000 not in live_registrations()


def test_the_owner_lives_until_unregistered() -> None:
    registrar = Registrar()
    owner = Owner()
    alive = weakref.ref(owner)
    registration = HostRegistration(0x50000, 10, owner, register=registrar.register, unregister=registrar.unregister)
    del owner
    gc.collect()
    assert alive() is not None
    registration.close()
    gc.collect()
    assert alive() is None


def test_a_registration_needs_bytes() -> None:
    with pytest.raises(ConfigError, match="size=0: a registration needs bytes"):
        HostRegistration(0x60000, 0, Owner(), register=Registrar().register)


# -- on a GPU -----------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_a_private_pool_registers_exactly_its_rows_in_the_background() -> None:
    plan = plan_host_pool(
        worker_kv_bytes_per_block=1 << 20,
        world_size=1,
        blocks_per_chunk=1,
        cpu_bytes_to_use=1 << 31,
        replicated=False,
        rank=0,
    )
    torch.cuda.init()  # type: ignore[no-untyped-call]  # not part of the construction timed below
    started = time.perf_counter()
    with HostPool(plan) as pool:
        constructed = time.perf_counter() - started
        address = pool.rows.data_ptr()
        assert live_registrations()[address] == pool.pin_bytes == plan.num_chunks * plan.slot_bytes
        assert pool.wait_pinned(timeout=120), pool.pin_error
        assert pool.rows.is_pinned()
        seconds = pool._res.registration.seconds  # type: ignore[union-attr]
        assert seconds is not None and constructed < seconds, (constructed, seconds)
    assert address not in live_registrations()


@needs_cuda
def test_cuda_each_rank_registers_its_own_mapping_of_a_shared_pool() -> None:
    engine_id = f"test-{uuid.uuid4().hex[:12]}"
    plans = [_plan(world_size=2, rank=r) for r in (0, 1)]
    with HostPool(plans[0], engine_id=engine_id) as rank0, HostPool(plans[1], engine_id=engine_id) as rank1:
        for pool in (rank0, rank1):
            assert pool.wait_pinned(timeout=60), pool.pin_error
            assert live_registrations()[pool.rows.data_ptr()] == plans[0].total_bytes
            assert pool.rows.is_pinned()
