"""Out-of-tree tiers named by ``module_path``: a real tier class is opened, a look-alike is refused."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvoffload.errors import ConfigClassError, ConfigError, ConfigModuleNotFoundError
from kvoffload.tiers import TierBase, open_tier, tiering_config_from_extra
from kvoffload.tiers._health import tier_type
from tests.tiers.rows import keys, load, namespace, random_rows, store

_MODULE = '''
from unittest.mock import MagicMock

from kvoffload.tiers import TierBase


class MemoryTier(TierBase):
    """Records in a dict: the smallest real tier."""

    name = "memory"

    def __init__(self, *, namespace, capacity=0):
        super().__init__(n_read_threads=1, n_write_threads=1)
        self.namespace, self.capacity, self.records = namespace, capacity, {}

    def _store_batch(self, keys, rows):
        for key, row in zip(keys, rows):
            self.records[bytes(key)] = bytes(row)
        return [len(row) for row in rows]

    def _load_batch(self, keys, rows):
        out = []
        for key, row in zip(keys, rows):
            data = self.records.get(bytes(key))
            if data is not None:
                row[:] = data
            out.append(None if data is None else len(data))
        return out

    def _exists_batch(self, keys):
        return [bytes(k) in self.records for k in keys]

    def _delete(self, key):
        self.records.pop(bytes(key), None)


class LooksLikeATier(MagicMock):
    """Has every attribute a tier has, and is no tier."""
'''


def _tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, class_name: str) -> object:
    (tmp_path / "my_tiers.py").write_text(textwrap.dedent(_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = {"secondary_tiers": [{"type": class_name, "module_path": "my_tiers", "capacity": 4}]}
    (config,) = tiering_config_from_extra(extra).secondary_tiers
    return open_tier(config, namespace(64))


def test_a_custom_tier_class_is_opened_and_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _tier(tmp_path, monkeypatch, "MemoryTier")
    assert isinstance(tier, TierBase) and tier.capacity == 4  # type: ignore[attr-defined]
    try:
        rows = random_rows(2, 64)
        assert store(tier, keys(2), rows) == ()  # type: ignore[arg-type]
        out, failed = load(tier, keys(2), 64)  # type: ignore[arg-type]
        assert failed == () and bool((out == rows).all())
    finally:
        tier.close()  # type: ignore[attr-defined]


def test_a_look_alike_is_refused_before_it_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mock has every attribute name of the protocol: vLLM refuses a class that is not a tier, so do we."""
    with pytest.raises(ConfigError, match=r"my_tiers\.LooksLikeATier must be a class deriving from"):
        _tier(tmp_path, monkeypatch, "LooksLikeATier")


def test_a_module_path_that_names_no_module_is_a_module_not_found_error() -> None:
    """vLLM's factory lets ``import_module`` raise: ``ModuleNotFoundError``; ours is one too, and a ConfigError."""
    extra = {"secondary_tiers": [{"type": "SomeTier", "module_path": "nonexistent.module.path"}]}
    (config,) = tiering_config_from_extra(extra).secondary_tiers
    with pytest.raises(
        ModuleNotFoundError, match=r"secondary_tiers\[0\] \(SomeTier\).*nonexistent\.module\.path"
    ) as info:
        open_tier(config, namespace(64), index=0)
    assert isinstance(info.value, ConfigModuleNotFoundError | ConfigError)


def test_a_class_that_is_not_a_tier_is_an_assertion_error_as_in_vllm() -> None:
    """vLLM asserts ``issubclass(cls, SecondaryTierManager)``; ours raises an error that is an AssertionError."""
    extra = {"secondary_tiers": [{"type": "MagicMock", "module_path": "unittest.mock"}]}
    (config,) = tiering_config_from_extra(extra).secondary_tiers
    with pytest.raises(AssertionError, match=r"unittest\.mock\.MagicMock must be a class deriving from") as info:
        open_tier(config, namespace(64))
    assert isinstance(info.value, ConfigClassError)


def test_an_out_of_tree_tier_is_named_after_its_type_as_in_vllm() -> None:
    extra = {"secondary_tiers": [{"type": "MemoryTier", "module_path": "my_tiers"}]}
    (config,) = tiering_config_from_extra(extra).secondary_tiers
    assert tier_type(config) == "MemoryTier"


@pytest.mark.parametrize("entry", [{}, {"type": ""}, {"type": None, "root_dir": "/tmp"}])
def test_a_tier_entry_without_a_type_has_vllms_text(entry: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]: .*Secondary tier configuration must include 'type'"):
        tiering_config_from_extra({"secondary_tiers": [entry]})
