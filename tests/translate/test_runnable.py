"""``validate_runnable``: what vLLM's translator accepts but kvoffload cannot run, refused before any worker starts.

The placement checks are the workers' own (``transfer_layout_from_config``), run on the scheduler side without
torch; the translator's answer for the same snapshots stays vLLM's.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvoffload import ConfigError, EngineSnapshot, codecs
from kvoffload.demo import default_snapshot
from kvoffload.offload.worker.copy import transfer_layout_from_config
from kvoffload.translate import translate_snapshot, validate_runnable

Doc = dict[str, Any]


def _doc() -> Doc:
    doc: Doc = msgspec.json.decode(codecs.encode(default_snapshot(workers=2), format="json"))
    return doc


def _snapshot(doc: Doc) -> EngineSnapshot:
    return codecs.decode(msgspec.json.encode(doc), EngineSnapshot, format="json")


def _tensor(doc: Doc) -> Doc:
    tensor: Doc = doc["kv_cache_config"]["kv_cache_tensors"][0]
    return tensor


def _spec(doc: Doc) -> Doc:
    spec: Doc = doc["kv_cache_config"]["kv_cache_groups"][0]["kv_cache_spec"]
    return spec


def _extra(doc: Doc) -> Doc:
    extra: Doc = doc["engine_config"]["kv_transfer_config"]["kv_connector_extra_config"]
    return extra


def _parallel(doc: Doc) -> Doc:
    parallel: Doc = doc["engine_config"]["parallel_config"]
    return parallel


def _fs(**kw: object) -> list[dict[str, object]]:
    return [{"type": "fs", "root_dir": "/nonexistent/kvo", **kw}]


_LAYER0 = r"^kv_cache_config cannot run: layer 'model\.layers\.0\.self_attn\.attn': "

CASES: list[tuple[str, Callable[[Doc], object], str]] = [
    (
        "block_stride-0",
        lambda d: _tensor(d).update(block_stride=0),
        _LAYER0 + r"block_stride=0 of kv_cache_tensors\[0\] is smaller than its page_bytes=32768",
    ),
    (
        "head_size-2**62",
        lambda d: _spec(d).update(head_size=2**62),
        _LAYER0 + r"block_stride=32768 .* page_bytes=1180591620717411303424,",
    ),
    (
        "num_kv_heads-2**62",
        lambda d: _spec(d).update(num_kv_heads=2**62),
        _LAYER0 + r"block_stride=32768 .* page_bytes=37778931862957161709568,",
    ),
    (
        "layer-in-no-tensor",
        lambda d: _tensor(d).update(layers=_tensor(d)["layers"][:3]),
        r"group 0 layer 'model\.layers\.3\.self_attn\.attn' is in no kv_cache_tensors placement",
    ),
    (
        "offset-2**62",
        lambda d: _tensor(d).update(offset=2**62),
        _LAYER0 + r"the page of block 255 ends at byte 4611686018435776512, beyond kv_cache_tensors\[0\]\.size=",
    ),
    (
        "tensor-size-0",
        lambda d: _tensor(d).update(size=0),
        _LAYER0 + r"the page of block 255 ends at byte 8388608, beyond kv_cache_tensors\[0\]\.size=0 ",
    ),
    (
        "num_blocks-2**40",
        lambda d: d["kv_cache_config"].update(num_blocks=2**40),
        r"the page of block 1099511627775 ends at byte \d+, beyond kv_cache_tensors\[0\]\.size=33554432 "
        r"\(num_blocks=1099511627776\)$",
    ),
    (
        "block_size-str",
        lambda d: _extra(d).update(block_size="32"),
        r"^kv_connector_extra_config\['block_size'\]='32' is not a valid connector option: Expected `int \| null`, "
        "got `str`$",
    ),
    (
        "block_size-float",
        lambda d: _extra(d).update(block_size=32.5),
        r"^kv_connector_extra_config\['block_size'\]=32\.5 is not a valid connector option: .* got `float`$",
    ),
    (
        "store_threshold--1",
        lambda d: _extra(d).update(store_threshold=-1),
        r"^kv_connector_extra_config\['store_threshold'\]=-1 is not a valid connector option: Expected `int` >= 0$",
    ),
    (
        "tier-type-tape",
        lambda d: _extra(d).update(secondary_tiers=[{"type": "tape"}]),
        r"^kv_connector_extra_config: secondary_tiers\[0\]: type='tape' is not one of fs, valkey, obj, custom",
    ),
    (
        "tier-unknown-key",
        lambda d: _extra(d).update(secondary_tiers=_fs(bogus=1)),
        r"^kv_connector_extra_config: secondary_tiers\[0\] \(fs\): Object contains unknown field `bogus`$",
    ),
    (
        "tier-n_read_threads--1",
        lambda d: _extra(d).update(secondary_tiers=_fs(n_read_threads=-1)),
        r"secondary_tiers\[0\] \(fs\): Expected `int` >= 1 - at `\$\.n_read_threads` \(got -1\)$",
    ),
    (
        "tier-poll-interval",
        lambda d: _extra(d).update(tier_poll_interval_s="soon"),
        r"^kv_connector_extra_config: tiering config: .*tier_poll_interval_s",
    ),
    (
        "tp3-world2",
        lambda d: _parallel(d).update(tensor_parallel_size=3),
        r"^parallel_config\.world_size=2 is not tensor_parallel_size=3 x pipeline_parallel_size=1 x "
        r"prefill_context_parallel_size=1 = 3: ",
    ),
    (
        "external-launcher-dp",
        lambda d: _parallel(d).update(distributed_executor_backend="external_launcher", data_parallel_size=2),
        r"^parallel_config\.world_size=2 is not .* x data_parallel_size=2 = 4: ",
    ),
]


@pytest.mark.parametrize(("mutate", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_translatable_but_unrunnable_is_refused(mutate: Callable[[Doc], object], pattern: str) -> None:
    doc = _doc()
    mutate(doc)
    snapshot = _snapshot(doc)
    config = translate_snapshot(snapshot)  # the translator, like vLLM's, lets it through
    with pytest.raises(ConfigError, match=pattern):
        validate_runnable(snapshot, config)


def test_the_same_checks_as_a_worker() -> None:
    """A layout refused up front is exactly the one a worker refuses when it starts."""
    doc = _doc()
    _tensor(doc).update(block_stride=0)
    snapshot = _snapshot(doc)
    config = translate_snapshot(snapshot)
    with pytest.raises(ConfigError) as worker:
        transfer_layout_from_config(snapshot.kv_cache_config, config)
    with pytest.raises(ConfigError) as up_front:
        validate_runnable(snapshot, config)
    assert str(up_front.value) == f"kv_cache_config cannot run: {worker.value}"


def test_runnable_snapshots_pass() -> None:
    for workers in (1, 2, 4):
        snapshot = default_snapshot(workers=workers)
        validate_runnable(snapshot, translate_snapshot(snapshot))
    doc = _doc()
    _extra(doc).update(block_size=32, store_threshold=2, secondary_tiers=_fs(n_read_threads=2))
    _parallel(doc).update(distributed_executor_backend="external_launcher", data_parallel_size=1)
    snapshot = _snapshot(doc)
    validate_runnable(snapshot, translate_snapshot(snapshot))


def test_validate_runnable_loads_no_torch(tmp_path: Path) -> None:
    """It runs on the scheduler side (the cluster, the CLI), which never imports torch, valkey or zmq: placement,
    connector options and tier configs included."""
    code = (
        "import sys\n"
        "from kvoffload.translate import load_snapshot, translate_snapshot, validate_runnable\n"
        "s = load_snapshot(sys.argv[1])\n"
        "validate_runnable(s, translate_snapshot(s))\n"
        "print(sorted(m for m in ('torch', 'valkey', 'zmq') if m in sys.modules))\n"
    )
    doc = msgspec.json.decode((Path(__file__).resolve().parents[2] / "examples" / "llama-3.1-8b-tp2.json").read_bytes())
    _extra(doc).update(secondary_tiers=_fs(), tier_poll_interval_s=0.01)
    example = tmp_path / "with-tiers.json"
    example.write_bytes(msgspec.json.encode(doc))
    out = subprocess.run(
        [sys.executable, "-c", code, str(example)], capture_output=True, text=True, check=False, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
