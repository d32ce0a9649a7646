"""Backpressure drop policies as classes: the built-ins, a registered one, and an out-of-tree one by dotted path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvoffload._generated import BackpressureConfig, FsTierConfig, TieringConfig
from kvoffload.errors import ConfigError, ConfigImportError
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.pool import plan_host_pool_from_config
from kvoffload.tiers import (
    BackpressureSettings,
    DropPolicy,
    DropStorePolicy,
    EMABackpressureDetector,
    ThrottledDropPolicy,
    Tiering,
    _policies,
    register_drop_policy,
    resolve_backpressure,
)
from tests.tiers.test_tier_health import _config

MiB = 1 << 20


class EveryOther:
    """Keeps every second store under pressure, and remembers what it was told."""

    def __init__(self) -> None:
        self.asked = 0
        self.skipped: list[int] = []
        self.resets = 0

    def should_store(self, detector: EMABackpressureDetector) -> bool:
        self.asked += 1
        return self.asked % 2 == 0

    def on_store_skipped(self, num_chunks: int) -> None:
        self.skipped.append(num_chunks)

    def reset(self) -> None:
        self.resets += 1


@pytest.fixture(autouse=True)
def _empty_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_policies, "_REGISTERED", {})


def _pressured(policy_cls: str) -> EMABackpressureDetector:
    settings = resolve_backpressure(
        "fs", None, BackpressureConfig(policy_cls=policy_cls, warmup_completions=1, cooldown_s=0.0)
    )
    detector = EMABackpressureDetector(settings)
    detector.record(MiB, 1.0)  # 1 s per MiB: far above the high water mark
    assert detector.under_pressure
    return detector


def test_the_builtins_are_classes_chosen_by_name() -> None:
    assert isinstance(_pressured("ThrottledDropPolicy").policy, ThrottledDropPolicy)
    assert isinstance(_pressured("throttled").policy, ThrottledDropPolicy)
    detector = _pressured("drop")
    assert isinstance(detector.policy, DropStorePolicy) and isinstance(detector.policy, DropPolicy)
    assert detector.settings.policy == "DropStorePolicy"
    assert all(detector.should_drop() for _ in range(3))


def test_a_registered_policy_gets_the_decisions_the_skips_and_the_resets() -> None:
    register_drop_policy("every_other", EveryOther)
    detector = _pressured("every_other")
    policy = detector.policy
    assert isinstance(policy, EveryOther) and policy.resets == 1, "reset once when the detector starts"
    assert [detector.should_drop(3) for _ in range(4)] == [True, False, True, False]
    assert policy.asked == 4 and policy.skipped == [3, 3]
    assert (detector.dropped_stores, detector.dropped_chunks) == (2, 6)
    assert detector.drop_rate() == 1.0, "a policy without drop_rate counts as dropping all under pressure"
    for _ in range(10):
        detector.record(MiB, 0.0)  # ten fast stores in a row clear the pressure: the policy forgets
    assert not detector.under_pressure and policy.resets == 2
    detector.reset()
    assert policy.resets == 3


def test_names_taken_and_non_policies_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^Drop policy 'drop' is already registered\.$"):
        register_drop_policy("drop", EveryOther)
    register_drop_policy("mine", EveryOther)
    with pytest.raises(ConfigError, match=r"^Drop policy 'mine' is already registered\.$"):
        register_drop_policy("mine", EveryOther)
    with pytest.raises(ConfigError, match="must be a class with should_store"):
        register_drop_policy("bad", int)
    with pytest.raises(
        ConfigError, match=r"policy_cls='nope' is not one of ThrottledDropPolicy, DropStorePolicy, mine"
    ):
        resolve_backpressure("fs", None, BackpressureConfig(policy_cls="nope"))


def test_an_out_of_tree_policy_by_dotted_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_policies.py").write_text(
        textwrap.dedent(
            """
            class NeverDrop:
                def should_store(self, detector):
                    return True

                def on_store_skipped(self, num_chunks):
                    pass

                def reset(self):
                    pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    detector = _pressured("my_policies.NeverDrop")
    assert type(detector.policy).__name__ == "NeverDrop" and not any(detector.should_drop() for _ in range(5))
    with pytest.raises(ImportError) as info:
        resolve_backpressure("valkey", None, BackpressureConfig(policy_cls="no_such_module_kvo.Policy"))
    assert isinstance(info.value, ConfigImportError)
    assert str(info.value).startswith("valkey tier: policy_cls='no_such_module_kvo.Policy': cannot import module")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    with pytest.raises(ConfigImportError, match="has no 'Missing'"):
        resolve_backpressure("fs", None, BackpressureConfig(policy_cls="my_policies.Missing"))


def test_tiering_builds_each_tiers_policy(tmp_path: Path) -> None:
    register_drop_policy("every_other", EveryOther)
    tiering = TieringConfig(
        secondary_tiers=(
            FsTierConfig(root_dir=str(tmp_path), backpressure=BackpressureConfig(policy_cls="every_other")),
        ),
    )
    config = _config(workers=1)
    tiers = Tiering(config, HostBlockManager(plan_host_pool_from_config(config).num_chunks), tiering)
    try:
        assert isinstance(tiers.backpressure(0).policy, EveryOther)
    finally:
        tiers.close()


def test_a_policy_instance_can_be_given_to_the_detector() -> None:
    policy = EveryOther()
    detector = EMABackpressureDetector(BackpressureSettings(0.01, 0.002, warmup_completions=1), policy=policy)
    assert detector.policy is policy and policy.resets == 1
