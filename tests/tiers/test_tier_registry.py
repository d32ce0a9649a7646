"""Tier types registered by name (vLLM's ``SecondaryTierFactory``) and unimportable ``module_path`` errors."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload._generated import CustomTierConfig, FsTierConfig, TieringConfig
from kvoffload.errors import ConfigError, ConfigImportError
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.pool import plan_host_pool_from_config
from kvoffload.tiers import TierBase, Tiering, _registry, open_tier, register_tier_type, tiering_config_from_extra
from tests.tiers.rows import keys, load, namespace, random_rows, store
from tests.tiers.test_tier_health import _config

_MODULE = '''
from kvoffload.tiers import TierBase


class DictTier(TierBase):
    """Records in a dict: the smallest real tier."""

    name = "dict"

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
'''


@pytest.fixture
def dict_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    """The DictTier class of a module on sys.path; the registry is emptied again afterwards."""
    (tmp_path / "dict_tiers.py").write_text(textwrap.dedent(_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_registry, "_REGISTERED", {})
    import dict_tiers  # type: ignore[import-not-found]

    yield dict_tiers.DictTier


def test_a_registered_type_is_opened_by_name_without_module_path(dict_tier: type) -> None:
    register_tier_type("dict", dict_tier)
    (config,) = tiering_config_from_extra({"secondary_tiers": [{"type": "dict", "capacity": 4}]}).secondary_tiers
    assert isinstance(config, CustomTierConfig) and config.tier_type == "dict"
    assert (config.module_path, config.class_name, dict(config.options)) == ("dict_tiers", "DictTier", {"capacity": 4})
    tier = open_tier(config, namespace(64))
    try:
        assert isinstance(tier, dict_tier) and tier.capacity == 4  # type: ignore[attr-defined]
        rows = random_rows(2, 64)
        assert store(tier, keys(2), rows) == ()  # type: ignore[arg-type]
        out, failed = load(tier, keys(2), 64)  # type: ignore[arg-type]
        assert failed == () and bool((out == rows).all())
    finally:
        tier.close()


def test_a_registered_type_names_the_tier_in_stats_and_labels(dict_tier: type) -> None:
    register_tier_type("dict", dict_tier)
    tiering = tiering_config_from_extra({"secondary_tiers": [{"type": "dict"}]})
    config = _config(workers=1)
    tiers = Tiering(config, HostBlockManager(plan_host_pool_from_config(config).num_chunks), tiering)
    try:
        assert (tiers.stats[0].name, tiers.stats[0].label, tiers.stats[0].vllm_label) == ("dict", "dict0", "1:dict")
        assert tiers.describe() == ["[0] dict dict_tiers.DictTier"], "the start line names the registered type"
    finally:
        tiers.close()


def test_a_process_that_did_not_register_the_type_imports_its_class(dict_tier: type) -> None:
    """A spawned worker never ran the registration: the entry names the class's module, which it imports."""
    config = CustomTierConfig(class_name="DictTier", module_path="dict_tiers", tier_type="dict")
    tier = open_tier(config, namespace(64))
    try:
        assert type(tier).__name__ == "DictTier"
    finally:
        tier.close()


def test_names_taken_are_refused_with_vllms_text(dict_tier: type) -> None:
    for name in ("fs", "valkey", "obj", "custom"):
        with pytest.raises(ConfigError, match=rf"^Tier .{name}. is already registered\.$"):
            register_tier_type(name, dict_tier)
    register_tier_type("dict", dict_tier)
    with pytest.raises(ValueError, match=r"^Tier 'dict' is already registered\.$"):
        register_tier_type("dict", dict_tier)
    with pytest.raises(ConfigError, match=r"must be a class deriving from kvoffload\.tiers\.TierBase"):
        register_tier_type("other", dict)


def test_an_unknown_type_lists_the_supported_ones(dict_tier: type) -> None:
    register_tier_type("dict", dict_tier)
    with pytest.raises(ConfigError) as info:
        tiering_config_from_extra({"secondary_tiers": [{"type": "tape"}]})
    assert str(info.value).endswith(
        "Unknown secondary tier type: 'tape'. Supported types: ['fs', 'valkey', 'obj', 'custom', 'dict']. "
        "For an out-of-tree tier, also set 'module_path'."
    )
    assert "type='tape' is not one of fs, valkey, obj, custom, dict" in str(info.value)


def test_an_unimportable_module_path_is_an_import_error_naming_the_tier_and_module(tmp_path: Path) -> None:
    tiering = tiering_config_from_extra(
        {
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(tmp_path)},
                {"type": "MyTier", "module_path": "no_such_module_kvo_xyz", "capacity": 1},
            ]
        }
    )
    config = _config(workers=1)
    manager = HostBlockManager(plan_host_pool_from_config(config).num_chunks)
    with pytest.raises(ImportError) as info:
        Tiering(config, manager, tiering)
    error = info.value
    assert isinstance(error, ConfigImportError) and isinstance(error, ConfigError)
    assert str(error).startswith(
        "secondary_tiers[1] (MyTier): cannot import 'MyTier' from module_path='no_such_module_kvo_xyz': "
        "ModuleNotFoundError: No module named 'no_such_module_kvo_xyz'"
    )
    assert isinstance(error.__cause__, ModuleNotFoundError)
    missing = CustomTierConfig(class_name="Nope", module_path="kvoffload.tiers")
    with pytest.raises(ConfigImportError, match=r"custom tier 'Nope': module_path='kvoffload.tiers' has no 'Nope'"):
        open_tier(missing, namespace(64))


def test_builtin_types_still_open(tmp_path: Path) -> None:
    tier = open_tier(FsTierConfig(root_dir=str(tmp_path)), namespace(64))
    try:
        assert isinstance(tier, TierBase)
    finally:
        tier.close()
    assert TieringConfig() == tiering_config_from_extra({})


def test_tier_base_is_abstract_a_subclass_missing_its_medium_cannot_be_built() -> None:
    class Half(TierBase):
        def _store_batch(self, keys, rows):  # type: ignore[no-untyped-def]
            return [len(r) for r in rows]

    with pytest.raises(TypeError, match=r"abstract method.*_delete"):
        Half(n_read_threads=1, n_write_threads=1)  # type: ignore[abstract]
