"""The ``kvoffload`` command: translate every example (JSON and TOML in, JSON and TOML out), --explain,
one-line errors with exit status 2, and the schema subcommand."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvoffload import ConfigError, codecs
from kvoffload._cli import main
from kvoffload._toml import dumps_toml
from kvoffload.translate import load_snapshot, translate_snapshot

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.json"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value if v is not None]
    return value


def test_the_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {
        "llama-3.1-8b-tp2.json",
        "deepseek-v3-mla-tp8.json",
        "gemma-swa-hybrid.json",
        "mamba-hybrid.json",
    } <= names


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_translate_example_json_and_toml(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = json.loads(codecs.encode(translate_snapshot(load_snapshot(example)), format="json"))

    code, out, err = run(capsys, "translate", str(example))
    assert (code, err) == (0, "")
    assert json.loads(out) == expected
    assert out.startswith("{\n  ")  # pretty by default

    code, out, err = run(capsys, "translate", str(example), "--format", "toml")
    assert (code, err) == (0, "")
    assert tomllib.loads(out) == _drop_none(expected)

    # The same snapshot written as TOML translates to the same config.
    toml_input = tmp_path / f"{example.stem}.toml"
    toml_input.write_text(dumps_toml(json.loads(example.read_text())))
    code, out, err = run(capsys, "translate", str(toml_input))
    assert (code, err) == (0, "")
    assert json.loads(out) == expected


def test_example_highlights(capsys: pytest.CaptureFixture[str]) -> None:
    by_name = {p.name: p for p in EXAMPLES}
    llama = json.loads(run(capsys, "translate", str(by_name["llama-3.1-8b-tp2.json"]))[1])
    assert llama["worker_kv_bytes_per_block"] == 32 * 32768 and llama["parallel"]["is_parallelism_agnostic"]
    dsv3 = json.loads(run(capsys, "translate", str(by_name["deepseek-v3-mla-tp8.json"]))[1])
    assert dsv3["replicated_layout"] and dsv3["worker_kv_bytes_per_block"] == 61 * 73728
    gemma = json.loads(run(capsys, "translate", str(by_name["gemma-swa-hybrid.json"]))[1])
    assert [g["sliding_window_size_in_chunks"] for g in gemma["groups"]] == [None, 4, 4, 4, 4, 4]
    hybrid = json.loads(run(capsys, "translate", str(by_name["mamba-hybrid.json"]))[1])
    assert hybrid["cache"]["tokens_per_hash"] == 400 and len(hybrid["groups"]) == 10


def test_translate_explain(capsys: pytest.CaptureFixture[str]) -> None:
    example = next(p for p in EXAMPLES if p.name == "llama-3.1-8b-tp2.json")
    code, out, err = run(capsys, "translate", str(example), "--explain")
    assert (code, err) == (0, "")
    report, _, config = out.partition("\n\n")
    assert "replicated_layout.use_mla = False  # model_config.use_mla=False (needs True)" in report
    assert "is_parallelism_agnostic = True" in report
    assert "tokens_per_hash = 16" in report and "blocks_per_chunk = 16" in report
    assert json.loads(config)["cache"]["blocks_per_chunk"] == 16
    code, out, _ = run(capsys, "translate", str(example), "--explain", "--format", "toml")
    assert code == 0 and tomllib.loads(out.partition("\n\n")[2])["cache"]["tokens_per_hash"] == 16


def _write(tmp_path: Path, doc: dict[str, Any], name: str = "snap.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _example_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(next(p for p in EXAMPLES if p.name == "llama-3.1-8b-tp2.json").read_text())
    return doc


def test_invalid_file_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _example_doc()
    doc["engine_config"]["parallel_config"]["tensor_parallel_size"] = 0
    path = _write(tmp_path, doc)
    code, out, err = run(capsys, "translate", str(path))
    assert (code, out) == (2, "")
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "$.engine_config.parallel_config.tensor_parallel_size" in lines[0] and "(got 0)" in lines[0]
    assert str(path) in lines[0]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"engine_config": {', "invalid JSON"),
        ('{"engine_config": {}, "kv_cache_config": {}}', "missing required field `model_config`"),
    ],
)
def test_broken_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, fragment: str) -> None:
    path = tmp_path / "broken.json"
    path.write_text(content)
    code, _, err = run(capsys, "translate", str(path))
    assert code == 2 and len(err.splitlines()) == 1 and fragment in err


def test_missing_and_bad_toml_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "translate", str(tmp_path / "nope.json"))
    assert code == 2 and err.startswith("error: ") and "cannot read" in err
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine_config\n")
    code, _, err = run(capsys, "translate", str(bad))
    assert code == 2 and len(err.splitlines()) == 1 and "invalid TOML" in err


def test_translator_rejection_prints_vllm_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _example_doc()
    doc["engine_config"]["kv_transfer_config"]["kv_connector_extra_config"] = {"block_size": 24}
    code, out, err = run(capsys, "translate", str(_write(tmp_path, doc)))
    assert (code, out) == (2, "")
    assert err == (
        "error: 'block_size'=24 in kv_connector_extra_config must be a multiple of the GPU KV cache block "
        "size (16 tokens). Use 32 instead, or set 'blocks_per_chunk' to express the chunk size in blocks.\n"
    )


def test_bare_assertion_prints_its_detail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _example_doc()
    doc["engine_config"]["kv_transfer_config"] = None
    code, _, err = run(capsys, "translate", str(_write(tmp_path, doc)), "--explain")
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: engine_config.kv_transfer_config is None") and "AssertionError" in err


def test_explain_on_failure_prints_decisions_then_the_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _example_doc()
    doc["engine_config"]["kv_transfer_config"]["kv_connector_extra_config"] = {"blocks_per_chunk": "many"}
    code, out, err = run(capsys, "translate", str(_write(tmp_path, doc)), "--explain")
    assert code == 2 and "tokens_per_hash = 16" in out
    assert err == (
        "error: kv_connector_extra_config['blocks_per_chunk']='many' is not an integer: invalid literal for "
        "int() with base 10: 'many'\n"
    )


def test_schema_json_schema_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schema", "--json-schema")
    schema = json.loads(out)
    assert code == 0 and "EngineSnapshot" in schema["$defs"]
    code, default, _ = run(capsys, "schema")
    assert code == 0 and json.loads(default) == schema
    code, out, _ = run(capsys, "schema", "--version")
    from kvoffload import SCHEMA_FINGERPRINT, SCHEMA_VERSION

    assert (code, out) == (0, f"kvoffload schema {SCHEMA_VERSION} (fingerprint {SCHEMA_FINGERPRINT})\n")


def test_help_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["translate", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "None values are omitted" in help_text and "--explain" in help_text
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main(["schema", "--version", "--json-schema"])
    capsys.readouterr()


def test_dumps_toml_writer() -> None:
    data: dict[str, Any] = {
        "a": 1,
        "b": None,
        "weird key": 'q"uote\\\n\x7f',
        "f": 2.5,
        "flags": [True, None, False],
        "inline": [{"x": 1, "y": None}, 3],
        "t": {"u": {"v": []}, "w": {}},
        "rows": [{"k": 1}, {"k": 2, "n": {"z": "é"}}],
    }
    parsed = tomllib.loads(dumps_toml(data))
    assert parsed == {
        "a": 1,
        "weird key": 'q"uote\\\n\x7f',
        "f": 2.5,
        "flags": [True, False],
        "inline": [{"x": 1}, 3],
        "t": {"u": {"v": []}, "w": {}},
        "rows": [{"k": 1}, {"k": 2, "n": {"z": "é"}}],
    }


def test_console_script_has_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"engine_config": 1, "kv_cache_config": {}}')
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from kvoffload._cli import main; sys.exit(main())",
            "translate",
            str(bad),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------------------------
# hostile input: one error line, exit 2, bounded reads
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("deep.json", "[" * 1000 + "]" * 1000),
        ("deep-field.json", '{"engine_config": ' + "[" * 1000 + "]" * 1000 + "}"),
        ("deep.toml", "a = " + "[" * 1000 + "]" * 1000),
    ],
)
def test_deeply_nested_input_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    code, out, err = run(capsys, "translate", str(path))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("error: ") and "nested too deeply" in err


def test_deeply_nested_extra_config_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = json.dumps(_example_doc()).replace(
        '"kv_connector_extra_config": {', '"kv_connector_extra_config": {"x": ' + "[" * 1000 + "]" * 1000 + ", ", 1
    )
    path = tmp_path / "deep-extra.json"
    path.write_text(text)
    code, _, err = run(capsys, "translate", str(path))
    assert code == 2 and err.count("\n") == 1 and "nested too deeply" in err


def test_input_size_is_capped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # /dev/zero never ends: the default cap refuses it after reading max_bytes + 1 bytes.
    code, out, err = run(capsys, "translate", "/dev/zero")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "larger than max_bytes=16777216" in err
    example = EXAMPLES[0]
    size = example.stat().st_size
    code, _, err = run(capsys, "translate", str(example), "--max-bytes", str(size - 1))
    assert code == 2 and f"larger than max_bytes={size - 1}" in err
    code, _, err = run(capsys, "translate", str(example), "--max-bytes", "1MiB")
    assert (code, err) == (0, "")
    with pytest.raises(ConfigError, match="max_bytes=0"):
        load_snapshot(example, max_bytes=0)


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (
            lambda d: d["engine_config"]["parallel_config"].update(rank=99),
            "parallel_config.rank=99 is outside world_size=2",
        ),
        (
            lambda d: d["engine_config"]["kv_transfer_config"]["kv_connector_extra_config"].update(cpu_bytes_to_use=-1),
            "kv_connector_extra_config['cpu_bytes_to_use']=-1 must be > 0",
        ),
        (
            lambda d: d["engine_config"]["kv_transfer_config"]["kv_connector_extra_config"].update(
                cpu_bytes_to_use=4096
            ),
            "kv_connector_extra_config['cpu_bytes_to_use']=4096 holds no chunk",
        ),
        (
            lambda d: d["engine_config"]["kv_transfer_config"]["kv_connector_extra_config"].update(
                cpu_bytes_to_use="lots"
            ),
            "kv_connector_extra_config['cpu_bytes_to_use']='lots' is not a number of bytes",
        ),
        (
            lambda d: d["engine_config"]["kv_transfer_config"]["kv_connector_extra_config"].update(
                eviction_policy="mru"
            ),
            "kv_connector_extra_config['eviction_policy']='mru' is not a known cache policy",
        ),
        (
            lambda d: d["kv_cache_config"].update(kv_cache_tensors=[]),
            "kv_cache_tensors holds 0 engine-resident tensors",
        ),
    ],
)
def test_snapshot_that_decodes_but_cannot_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate: Any, fragment: str
) -> None:
    doc = _example_doc()
    mutate(doc)
    code, out, err = run(capsys, "translate", str(_write(tmp_path, doc)))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("error: ") and fragment in err


# The synthetic cases vLLM 0.33.0 accepts that cannot run: no KV tensor, a world_size that is not TP x PP x PCP,
# or tensors that do not hold the specs' pages (a worker's layout check refuses them).
_NO_TENSORS = "kv_cache_config.kv_cache_tensors holds 0 engine-resident tensors"
_UNRUNNABLE_RECORDED_CASES = {
    "sample-00000-full": _NO_TENSORS,
    "sample-00005-swa_mla": _NO_TENSORS,
    "sample-00524-hisparse": _NO_TENSORS,
    "sample-00002-chunked": "parallel_config.world_size=9 is not tensor_parallel_size=4 x pipeline_parallel_size=2",
    "sample-00008-hybrid_swa": "parallel_config.world_size=4 is not tensor_parallel_size=1",
    "sample-00001-uniform_mla": "kv_cache_config cannot run: layer 'model.layers.1.self_attn.attn': the page of "
    "block 4095 ends at byte 536838144, beyond kv_cache_tensors[0].size=268435456",
    "sample-00382-uniform_mla": "the page of block 4095 ends at byte 319261632, beyond kv_cache_tensors[0].size=",
    "sample-00114-mla": "kv_cache_config cannot run: group 0: its pages take 503808 bytes per block, more than the "
    "host slot of worker_kv_bytes_per_block=83968",
    "sample-00149-mla": "group 0: its pages take 221184 bytes per block",
    "sample-00375-swa_mla": "group 0: its pages take 9216 bytes per block",
}


def test_recorded_vllm_cases_are_refused_only_when_they_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every case vLLM 0.33.0 accepts translates on the command line to vLLM's config, except those that cannot
    run, each refused with one line naming why (the translator itself still returns vLLM's config for them)."""
    cases = [json.loads(line) for line in (Path(__file__).parent / "data" / "translate_cases.jsonl").open()]
    accepted = [c for c in cases if "ok" in c["expect"]]
    assert len(accepted) == 20
    refused = {}
    for case in accepted:
        path = tmp_path / f"{case['name']}.json"
        path.write_text(json.dumps(case["input"]))
        code, out, err = run(capsys, "translate", str(path))
        if code:
            assert (code, out) == (2, "") and err.count("\n") == 1 and err.startswith("error: "), err
            refused[case["name"]] = err
        else:
            assert json.loads(out) == case["expect"]["ok"]
        config = json.loads(codecs.encode(translate_snapshot(load_snapshot(path)), format="json"))
        assert config == case["expect"]["ok"], case["name"]
    assert set(refused) == set(_UNRUNNABLE_RECORDED_CASES)
    for name, fragment in _UNRUNNABLE_RECORDED_CASES.items():
        assert fragment in refused[name], (name, refused[name])


# ------------------------------------------------------------------------------------------------------------
# issue 22: every flag and snapshot value ends in one error line with exit status 2, never a traceback
# ------------------------------------------------------------------------------------------------------------

_NINES = "9" * 400


def _cli_process(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvoffload ARGV`` as a user runs it (bounded: these all fail before reading anything large)."""
    return subprocess.run(
        [sys.executable, "-m", "kvoffload", *argv], capture_output=True, text=True, check=False, timeout=60
    )


def _one_error_line(stderr: str, fragment: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: "), stderr
    assert fragment in stderr, stderr


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        # MemoryError: the read used to preallocate max_bytes + 1 bytes
        ("100TiB", "argument --max-bytes: '100TiB' is 109951162777600 bytes: it must be from 1 to 1073741824 bytes"),
        # OverflowError from read(2**70 + 1)
        (str(2**70), f"argument --max-bytes: '{2**70}' is more than 9223372036854775807 bytes (8 EiB)"),
        # OverflowError from int(float("9" * 400))
        (_NINES, "argument --max-bytes: '999999999999999999999999'... (400 characters) is more than"),
        ("0.5", "argument --max-bytes: '0.5' is 0 bytes: it must be from 1 to 1073741824 bytes"),
        ("lots", "argument --max-bytes: 'lots' is not a size (e.g. 268435456, 256MiB, 1GiB)"),
    ],
)
def test_max_bytes_out_of_bounds_is_one_error_line(value: str, fragment: str) -> None:
    proc = _cli_process("translate", str(EXAMPLES[0]), "--max-bytes", value)
    assert (proc.returncode, proc.stdout) == (2, "")
    _one_error_line(proc.stderr, fragment)
    assert "_parse_max_bytes" not in proc.stderr and "invalid" not in proc.stderr  # a sentence, not a function


def test_usage_errors_are_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, fragment in [
        (["translate"], "kvoffload translate: the following arguments are required: FILE"),
        (["demo", "--workers", "two"], "kvoffload demo: argument --workers: invalid int value: 'two'"),
        (["demo", "--policy", "mru"], "argument --policy: invalid choice: 'mru'"),
        (["nope"], "kvoffload: argument COMMAND: invalid choice: 'nope'"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        out, err = capsys.readouterr()
        assert (exit_info.value.code, out) == (2, ""), argv
        _one_error_line(err, fragment)


def test_large_max_bytes_reads_only_what_the_file_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = EXAMPLES[0]
    code, out, err = run(capsys, "translate", str(example), "--max-bytes", "1GiB")
    assert (code, err) == (0, "") and json.loads(out)
    # The library takes any cap and reads in chunks: no allocation of the cap, no OverflowError.
    assert load_snapshot(example, max_bytes=2**70) == load_snapshot(example)


def _extra(doc: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = doc["engine_config"]["kv_transfer_config"]["kv_connector_extra_config"]
    return extra


def _tensor(doc: dict[str, Any]) -> dict[str, Any]:
    tensor: dict[str, Any] = doc["kv_cache_config"]["kv_cache_tensors"][0]
    return tensor


def _spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["kv_cache_config"]["kv_cache_groups"][0]["kv_cache_spec"]
    return spec


_LAYER0 = "kv_cache_config cannot run: layer 'model.layers.0.self_attn.attn': "


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (
            lambda d: _tensor(d).update(block_stride=0),
            _LAYER0 + "block_stride=0 of kv_cache_tensors[0] is smaller than its page_bytes=32768",
        ),
        (
            lambda d: _spec(d).update(head_size=2**62),
            _LAYER0 + "block_stride=32768 of kv_cache_tensors[0] is smaller than its page_bytes=1180591620717411303424",
        ),
        (
            lambda d: _spec(d).update(num_kv_heads=2**62),
            _LAYER0
            + "block_stride=32768 of kv_cache_tensors[0] is smaller than its page_bytes=37778931862957161709568",
        ),
        (
            lambda d: _tensor(d).update(layers=_tensor(d)["layers"][:-1]),
            "group 0 layer 'model.layers.31.self_attn.attn' is in no kv_cache_tensors placement",
        ),
        (
            lambda d: _tensor(d).update(offset=2**62),
            _LAYER0 + "the page of block 57343 ends at byte 4611686020306436096, beyond kv_cache_tensors[0].size=",
        ),
        (
            lambda d: _tensor(d).update(size=0),
            _LAYER0 + "the page of block 57343 ends at byte 1879048192, beyond kv_cache_tensors[0].size=0",
        ),
        (
            lambda d: d["kv_cache_config"].update(num_blocks=2**40),
            "beyond kv_cache_tensors[0].size=60129542144 (num_blocks=1099511627776)",
        ),
        (
            lambda d: _extra(d).update(block_size="32"),
            "kv_connector_extra_config['block_size']='32' is not a valid connector option: Expected `int | null`",
        ),
        (
            lambda d: _extra(d).update(block_size=32.5),
            "kv_connector_extra_config['block_size']=32.5 is not a valid connector option: Expected `int | null`",
        ),
        (
            lambda d: _extra(d).update(secondary_tiers=[{"type": "tape"}]),
            "kv_connector_extra_config: secondary_tiers[0]: type='tape' is not one of fs, valkey, obj, custom",
        ),
        (
            lambda d: _extra(d).update(secondary_tiers=[{"type": "fs", "root_dir": "/x", "bogus": 1}]),
            "kv_connector_extra_config: secondary_tiers[0] (fs): Object contains unknown field `bogus`",
        ),
        (
            lambda d: _extra(d).update(secondary_tiers=[{"type": "fs", "root_dir": "/x", "n_read_threads": -1}]),
            "secondary_tiers[0] (fs): Expected `int` >= 1 - at `$.n_read_threads` (got -1)",
        ),
        (
            lambda d: d["engine_config"]["parallel_config"].update(tensor_parallel_size=3),
            "parallel_config.world_size=2 is not tensor_parallel_size=3 x pipeline_parallel_size=1 x "
            "prefill_context_parallel_size=1 = 3",
        ),
    ],
    ids=[
        "block_stride-0",
        "head_size-2**62",
        "num_kv_heads-2**62",
        "layer-in-no-tensor",
        "offset-2**62",
        "tensor-size-0",
        "num_blocks-2**40",
        "block_size-str",
        "block_size-float",
        "tier-type-tape",
        "tier-unknown-key",
        "tier-n_read_threads--1",
        "tp3-world2",
    ],
)
def test_snapshot_vllm_translates_but_that_cannot_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate: Any, fragment: str
) -> None:
    doc = _example_doc()
    mutate(doc)
    path = _write(tmp_path, doc)
    translate_snapshot(load_snapshot(path))  # vLLM's translator accepts it: the translator must too
    code, out, err = run(capsys, "translate", str(path))
    assert (code, out) == (2, "")
    _one_error_line(err, fragment)
