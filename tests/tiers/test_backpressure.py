"""The EMA backpressure detector and its drop policies, on a fake clock (no wall-clock asserts)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload._generated import BackpressureConfig
from kvoffload.errors import ConfigError
from kvoffload.tiers import BackpressureSettings, EMABackpressureDetector, resolve_backpressure

MiB = 1 << 20


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _detector(**kw: object) -> tuple[EMABackpressureDetector, _Clock]:
    clock = _Clock()
    base: dict[str, object] = {"high_water_s": 0.010, "low_water_s": 0.002, "warmup_completions": 3}
    base.update(kw)
    return EMABackpressureDetector(BackpressureSettings(**base), clock), clock  # type: ignore[arg-type]


def test_defaults_and_merge_order() -> None:
    fs = resolve_backpressure("fs", None, None)
    assert (fs.high_water_s, fs.low_water_s, fs.failure_threshold) == (0.010, 0.002, 3)
    vk = resolve_backpressure("valkey", None, None)
    assert (vk.high_water_s, vk.low_water_s, vk.failure_threshold) == (0.050, 0.010, None)
    merged = resolve_backpressure(
        "fs", BackpressureConfig(high_water_s=0.5, alpha=0.5), BackpressureConfig(high_water_s=0.2, policy_cls="drop")
    )
    assert merged.high_water_s == 0.2 and merged.alpha == 0.5 and merged.policy == "DropStorePolicy"
    with pytest.raises(ConfigError, match="policy_cls='nope'"):
        resolve_backpressure("fs", None, BackpressureConfig(policy_cls="nope"))
    with pytest.raises(ConfigError, match=r"low_water_s=0\.3 exceeds high_water_s=0\.01"):
        resolve_backpressure("fs", None, BackpressureConfig(low_water_s=0.3))


def test_warmup_seeds_the_ema_then_pressure_and_throttled_drops() -> None:
    det, _ = _detector()
    for _ in range(2):
        det.record(MiB, 0.050)
    assert det.ema is None and not det.should_drop()
    det.record(MiB, 0.050)
    assert det.ema == pytest.approx(0.050) and det.under_pressure
    # drop rate = (0.05 - 0.01) / 0.01 / 2 = 2 -> capped at 1: every store is dropped
    assert all(det.should_drop(4) for _ in range(5))
    assert det.dropped_stores == 5 and det.dropped_chunks == 20


def test_partial_drop_rate_spreads_drops_evenly() -> None:
    det, _ = _detector(warmup_completions=1)
    det.record(MiB, 0.015)  # rate = (0.015 - 0.01) / 0.01 / 2 = 0.25
    assert det.drop_rate() == pytest.approx(0.25)
    drops = [det.should_drop() for _ in range(8)]
    assert sum(drops) == 2 and drops == [False, False, False, True] * 2


def test_pressure_clears_below_low_water_then_cooldown_drops_every_second_store() -> None:
    det, clock = _detector(warmup_completions=1, alpha=1.0, cooldown_s=1.0)
    det.record(MiB, 0.050)
    assert det.under_pressure
    det.record(MiB, 0.001)
    assert not det.under_pressure
    assert [det.should_drop() for _ in range(4)] == [True, False, True, False]
    clock.t += 2.0
    assert not any(det.should_drop() for _ in range(4))


def test_idle_decay_clears_pressure() -> None:
    det, clock = _detector(warmup_completions=1, decay_half_life_s=2.0, cooldown_s=0.0)
    det.record(MiB, 0.016)
    assert det.under_pressure
    clock.t += 6.0  # three half-lives: 0.016 -> 0.002... below low water after one more
    clock.t += 2.0
    assert not det.should_drop() and not det.under_pressure


def test_consecutive_failures_force_pressure() -> None:
    det, _ = _detector(failure_threshold=3)
    det.record(MiB, 0.0, success=False)
    det.record(MiB, 0.0, success=False)
    assert not det.under_pressure
    det.record(MiB, 0.0, success=False)
    assert det.under_pressure and det.ema is not None and det.ema >= 0.040
    assert det.should_drop()


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40))
def test_fast_stores_never_drop(latencies: list[float]) -> None:
    det, _ = _detector(warmup_completions=1)
    for s in latencies:
        det.record(MiB, s * 0.0019)  # always under the low water mark
    assert not det.under_pressure and not det.should_drop()


def test_a_failure_ends_the_healthy_streak() -> None:
    """Three failures after a long run of fast stores force pressure, and it holds: the healthy fast path needs
    consecutive fast completions, which the failures interrupted."""
    det, clock = _detector(failure_threshold=3)
    for _ in range(25):
        det.record(MiB, 0.001)  # 0.001 s/MiB: below low water
        clock.t += 0.01
    for _ in range(3):
        det.record(MiB, 0.0, success=False)
    assert det.under_pressure
    clock.t += 0.001  # the next decision comes a moment later (the idle decay re-evaluates pressure)
    assert det.should_drop() and det.under_pressure, "pressure must not clear at the next decision"


def test_reset_forgets_everything() -> None:
    det, _clock = _detector(failure_threshold=1)
    det.record(MiB, 0.0, success=False)
    assert det.under_pressure and det.should_drop()
    det.reset()
    assert not det.under_pressure and det.ema is None and det.dropped_stores == 0 and not det.should_drop()
    for _ in range(3):
        det.record(MiB, 0.001)  # a fresh warm-up
    assert det.ema == pytest.approx(0.001) and not det.under_pressure


def test_reset_sets_the_last_update_time_to_zero_as_vllm_does() -> None:
    det, clock = _detector()
    clock.t = 50.0
    for _ in range(3):
        det.record(MiB, 0.001)
    assert det._last_update == 50.0
    det.reset()
    assert det._last_update == 0.0  # vLLM's reset: _last_update = 0.0 (not "now")


def test_store_latency_ema_is_vllms_view_of_the_ema() -> None:
    det, _clock = _detector()
    assert det.store_latency_ema == 0.0
    det.store_latency_ema = 5.0
    det.under_pressure = True
    assert det.ema == 5.0 and det.should_drop()
    det.reset()
    assert det.store_latency_ema == 0.0 and not det.under_pressure and not det.should_drop()
