"""Backpressure of cascades into a slow tier (vLLM 0.33's EMA detector and drop policies).

The detector keeps an exponential moving average of store latency per MiB. It is seeded with the mean of
the first ``warmup_completions`` samples; pressure starts when the EMA exceeds ``high_water_s`` and clears
when it falls below ``low_water_s`` (also through idle decay: ``ema *= 0.5 ** (idle / half_life)``). After
``failure_threshold`` consecutive failed stores pressure is forced with ``ema >= 4 * high``. Ten consecutive
samples below the low mark reset to a healthy fast path. For ``cooldown_s`` after pressure clears every
second store is dropped. Under pressure the drop policy decides (a class, :mod:`~kvoffload.tiers._policies`):
``ThrottledDropPolicy`` drops a growing share, ``drop_rate = min(1, (ema - high) / high / ramp_factor)`` (an
accumulator spreads the drops evenly); ``DropStorePolicy`` drops everything; ``policy_cls`` may also name a
registered or out-of-tree class. Drops are counted per store and per chunk. The engine never waits: a dropped
cascade only means that chunk is not in that tier.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvoffload._generated import BackpressureConfig
from kvoffload.errors import ConfigError
from kvoffload.tiers._policies import (
    DropPolicy,
    DropStorePolicy,
    ThrottledDropPolicy,
    drop_policy_class,
    make_drop_policy,
)

__all__ = ["BackpressureSettings", "EMABackpressureDetector", "resolve_backpressure"]

_MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class BackpressureSettings:
    """Resolved backpressure parameters of one tier."""

    high_water_s: float
    low_water_s: float
    alpha: float = 0.15
    warmup_completions: int = 10
    decay_half_life_s: float = 2.0
    cooldown_s: float = 1.0
    failure_threshold: int | None = None
    policy: str = "ThrottledDropPolicy"
    """The drop policy's name (``policy_cls``: a built-in's class name, a registered name, or ``pkg.mod.Class``)."""
    ramp_factor: float = 2.0


_DETECTORS = {"EMABackpressureDetector", "ema"}
_STORAGE_TYPES = ("fs", "obj")
"""The tier types whose stores force pressure after 3 consecutive failures by default (vLLM's storage tiers: a
remote fs tier too)."""


def resolve_backpressure(
    tier_type: str, top: BackpressureConfig | None, own: BackpressureConfig | None, *, remote: bool = False
) -> BackpressureSettings:
    """Merge per field: tier's own > top-level ``backpressure`` > the tier type's defaults (vLLM's rule: network
    defaults for every tier but a disk one, and for a disk tier whose ``locality`` is ``REMOTE``: ``remote``;
    ``failure_threshold`` 3 for the disk and object-store tiers, remote or not)."""
    network = tier_type != "fs" or remote
    high, low = (0.050, 0.010) if network else (0.010, 0.002)
    defaults = BackpressureSettings(high, low, failure_threshold=3 if tier_type in _STORAGE_TYPES else None)

    merged: dict[str, object] = {}
    for source in (top, own):  # the tier's own fields win over the top-level ones
        if source is not None:
            merged.update((k, v) for k, v in msgspec.structs.asdict(source).items() if v is not None)
    detector = merged.pop("backpressure_cls", None) or "EMABackpressureDetector"
    if detector not in _DETECTORS:
        raise ConfigError(f"{tier_type} tier: backpressure_cls={detector!r} is not supported (EMABackpressureDetector)")
    policy_name = merged.pop("policy_cls", None) or "ThrottledDropPolicy"
    try:
        policy, _ = drop_policy_class(str(policy_name))  # checked now: a bad name fails at start, naming the tier
    except ConfigError as exc:
        raise type(exc)(f"{tier_type} tier: {exc}") from exc.__cause__
    # The schema typed and bounded every field already; convert checks the merge against the settings' types.
    settings = msgspec.convert({**dataclasses.asdict(defaults), **merged, "policy": policy}, BackpressureSettings)
    if settings.low_water_s > settings.high_water_s:
        raise ConfigError(
            f"{tier_type} tier: backpressure low_water_s={settings.low_water_s} exceeds "
            f"high_water_s={settings.high_water_s}"
        )
    return settings


class EMABackpressureDetector:
    """Decides, store by store, whether a cascade into one tier is dropped (see the module docstring).

    ``policy``: the drop policy (default: a new one of the class ``settings.policy`` names).
    """

    def __init__(
        self,
        settings: BackpressureSettings,
        clock: Callable[[], float] = time.monotonic,
        *,
        policy: DropPolicy | None = None,
    ) -> None:
        self.settings = settings
        self.policy = make_drop_policy(settings.policy, settings.ramp_factor) if policy is None else policy
        self._clock = clock
        self.ema: float | None = None
        self._warmup: list[float] = []
        self.under_pressure = False
        self._cleared_at: float | None = None
        self.reset()

    def reset(self) -> None:
        """Forget everything learned (vLLM ``reset_cache``): EMA, warm-up, pressure, cooldown, streaks, drop
        counters."""
        self.ema = None
        self._warmup = []
        self.under_pressure = False
        self._cleared_at = None
        self._last_update = 0.0  # as vLLM: no update since the reset (a decay needs an EMA, which a record sets first)
        self._consecutive_failures = 0
        self._healthy_streak = 0
        self._cooldown_toggle = False
        self.policy.reset()
        self.dropped_stores = 0
        self.dropped_chunks = 0
        self.samples = 0

    @property
    def store_latency_ema(self) -> float:
        """vLLM's name for the EMA of store latency (s per MiB): 0.0 before the warm-up completes or after a reset."""
        return self.ema or 0.0

    @store_latency_ema.setter
    def store_latency_ema(self, value: float) -> None:
        self.ema = value

    def record(self, num_bytes: int, seconds: float, *, success: bool = True) -> None:
        """Feed one finished store: its bytes and latency (a failure counts towards ``failure_threshold``)."""
        s = self.settings
        now = self._clock()
        self._last_update = now
        if not success:
            self._consecutive_failures += 1
            self._healthy_streak = 0  # a failing tier is not healthy: its fast path must not clear pressure
            if s.failure_threshold is not None and self._consecutive_failures >= s.failure_threshold:
                self.ema = max(self.ema or 0.0, 4 * s.high_water_s)
                self.under_pressure = True
            return
        self._consecutive_failures = 0
        sample = seconds / max(num_bytes / _MiB, 1e-9)
        self.samples += 1
        if self.ema is None:
            self._warmup.append(sample)
            if len(self._warmup) < s.warmup_completions:
                return
            self.ema = sum(self._warmup) / len(self._warmup)
            self._warmup = []
        else:
            self.ema = s.alpha * sample + (1 - s.alpha) * self.ema
        self._healthy_streak = self._healthy_streak + 1 if sample < s.low_water_s else 0
        self._update(now)

    def _update(self, now: float) -> None:
        s = self.settings
        if self.ema is None:
            return
        if not self.under_pressure and self.ema > s.high_water_s:
            self.under_pressure = True
        elif self.under_pressure and (self.ema < s.low_water_s or self._healthy_streak >= 10):
            self.under_pressure = False
            self._cleared_at = now
            self.policy.reset()

    def _decay(self, now: float) -> None:
        if self.ema is None:
            return
        idle = now - self._last_update
        if idle > 0:
            self.ema *= 0.5 ** (idle / self.settings.decay_half_life_s)
            self._last_update = now
            self._update(now)

    def drop_rate(self) -> float:
        """Share of stores the policy drops now (a policy without ``drop_rate``: 1.0 under pressure)."""
        if not self.under_pressure or self.ema is None:
            return 0.0
        policy = self.policy
        return policy.drop_rate(self) if isinstance(policy, ThrottledDropPolicy | DropStorePolicy) else 1.0

    def should_drop(self, num_chunks: int = 1) -> bool:
        """Whether the next store (of ``num_chunks`` chunks) is dropped; drops are counted."""
        now = self._clock()
        self._decay(now)
        drop = False
        if self.under_pressure:
            drop = not self.policy.should_store(self)
        elif self._cleared_at is not None and now - self._cleared_at < self.settings.cooldown_s:
            self._cooldown_toggle = not self._cooldown_toggle
            drop = self._cooldown_toggle
        if drop:
            self.dropped_stores += 1
            self.dropped_chunks += num_chunks
            self.policy.on_store_skipped(num_chunks)
        return drop
