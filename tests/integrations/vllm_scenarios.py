"""Scenarios run in a real vLLM engine, one engine per process (tests/integrations/test_vllm.py runs them).

Each scenario builds one engine on the tiny model at ``MODEL_DIR``, drives it, and prints one JSON line
``RESULT {...}`` with what the test asserts on. Run: ``python vllm_scenarios.py SCENARIO MODEL_DIR OUT_DIR``.
A separate process per engine keeps vLLM's process-global state (distributed groups, torch threads, logging)
out of the test process, and lets the multi-process scenario use vLLM's default engine-core process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for testing/ (not shipped)

from testing.tiny_model import WORDS

SYSTEM = "the system cache memory block offload host device layer head attention value key page " * 12
QUESTIONS = ["question one about the first answer", "question two about a large token", "question three"]

ENGINE_KW: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 1024,
    "enforce_eager": True,
    "block_size": 32,
    "kv_cache_memory_bytes": 4 << 20,  # 64 blocks of 32 tokens: small enough that other requests evict a prefix
    "enable_prefix_caching": True,
    "seed": 0,
    "max_num_seqs": 4,
}


def connector_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20, **extra},
    }


def prompts() -> list[str]:
    return [f"{SYSTEM}{q}" for q in QUESTIONS]


def long_decodes() -> list[str]:
    """Four requests decoding at once whose KV outgrows the engine's 64 blocks: vLLM preempts some."""
    return [f"{SYSTEM[: 40 * (i + 1)]} long answer {i}" for i in range(4)]


def fillers(count: int) -> list[str]:
    """Prompts with other prefixes, enough to push the shared prefix out of the engine's small KV pool."""
    out = []
    for i in range(count):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(600)]
        out.append(f"{i} " + " ".join(words))
    return out


def generate(llm: Any, batch: list[str], max_tokens: int = 12) -> tuple[list[list[int]], list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(batch, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [int(o.num_cached_tokens or 0) for o in outs]


def stats_dict(llm: Any) -> dict[str, Any]:
    import msgspec

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return msgspec.to_builtins(connector.scheduler_stats)


def one_by_one(llm: Any, batch: list[str]) -> tuple[list[list[int]], list[int]]:
    """Generate prompts one after another (each one's prefix is stored before the next looks it up)."""
    tokens: list[list[int]] = []
    cached: list[int] = []
    for prompt in batch:
        t, c = generate(llm, [prompt])
        tokens += t
        cached += c
    return tokens, cached


def baseline(model: str, out: Path) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(model=model, distributed_executor_backend="uni", **ENGINE_KW)
    tokens, cached = one_by_one(llm, prompts())
    filler_tokens, _ = generate(llm, fillers(2))
    decode_tokens, _ = generate(llm, long_decodes(), max_tokens=600)
    return {"tokens": tokens, "cached": cached, "filler_tokens": filler_tokens, "decode_tokens": decode_tokens}


def connector(model: str, out: Path, load_mode: str) -> dict[str, Any]:
    """``load_mode`` async or sync, or ``layerwise``: sync loads and the stores copied layer by layer."""
    import msgspec
    from vllm import LLM

    from kvoffload import codecs
    from kvoffload.integrations.vllm import snapshot_from_vllm

    extra: dict[str, Any] = {"load_mode": load_mode, "block_size": 64}
    if load_mode == "layerwise":
        extra.update(load_mode="sync", layerwise_transfers=True)
    llm = LLM(
        model=model,
        distributed_executor_backend="uni",
        kv_transfer_config=connector_config(extra),
        **ENGINE_KW,
    )
    result: dict[str, Any] = {}
    result["first_tokens"], result["first_cached"] = one_by_one(llm, prompts())
    result["after_first"] = stats_dict(llm)

    # 1. The engine's own prefix cache is emptied: the shared prefix comes back from host memory.
    llm.reset_prefix_cache()
    result["reset_tokens"], result["reset_cached"] = one_by_one(llm, prompts())
    result["after_reset"] = stats_dict(llm)

    # 2. Other requests evict the prefix from the engine's small block pool; host memory serves it again.
    result["filler_tokens"], _ = generate(llm, fillers(2))
    generate(llm, fillers(6)[2:])
    result["evicted_tokens"], result["evicted_cached"] = one_by_one(llm, prompts()[:1])
    result["after_evict"] = stats_dict(llm)

    # 3. Requests that outgrow the engine's blocks while decoding: vLLM preempts (and later resumes) them.
    connector_half = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    before = connector_half.preemptions
    result["decode_tokens"], _ = generate(llm, long_decodes(), max_tokens=600)
    result["preemptions"] = connector_half.preemptions - before
    result["after_decode"] = stats_dict(llm)

    # 4. The live engine dumped as a snapshot, and the plan the connector runs with.
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    snapshot = snapshot_from_vllm(llm.llm_engine.vllm_config, scheduler.kv_cache_config)
    (out / "snapshot.json").write_bytes(msgspec.json.encode(snapshot))
    (out / "connector_config.json").write_bytes(codecs.encode(scheduler.connector.offloading_config, format="json"))

    # 5. Corrupt every host chunk (one byte each, in the float's exponent): loads must fail and recompute.
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker_connector = get_kv_transfer_group()  # the worker half lives in this process (uni executor)
    layered = worker_connector._worker.worker.layerwise
    if layered is not None:  # the engine's per-layer hooks reached the copies
        result["layerwise"] = {"waits": layered.layer_waits, "stores": layered.layer_stores}
    rows = worker_connector._worker.pool.rows
    rows[:, 3] ^= 0x40
    llm.reset_prefix_cache()
    result["corrupt_tokens"], result["corrupt_cached"] = one_by_one(llm, prompts()[:1])
    result["after_corrupt"] = stats_dict(llm)
    return result


def multiprocess(model: str, out: Path, tensor_parallel_size: int = 1) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(
        model=model, kv_transfer_config=connector_config({}), tensor_parallel_size=tensor_parallel_size, **ENGINE_KW
    )
    result: dict[str, Any] = {}
    result["first_tokens"], result["first_cached"] = one_by_one(llm, prompts())
    llm.reset_prefix_cache()
    result["reset_tokens"], result["reset_cached"] = one_by_one(llm, prompts())
    # The engine core runs in a child process that shares our stdout: stop it before exiting.
    llm.llm_engine.engine_core.shutdown()
    return result


def _until_landed(llm: Any, half: Any) -> dict[str, Any]:
    """Keep the engine stepping until every store, cascade and promotion has landed; what landed, in the first
    secondary tier's row."""
    from kvoffload.tiers import Tiering

    for _ in range(100):
        if not half.scheduler.has_pending_work():
            break
        generate(llm, ["pump"], max_tokens=1)
    tiering = half.scheduler.extension
    assert isinstance(tiering, Tiering)
    row = tiering.stats[0]
    return {
        "pending": half.scheduler.has_pending_work(),
        "stats": stats_dict(llm),
        "cascaded": row.cascaded_chunks,
        "promoted": row.promoted_chunks,
        "tier": dataclasses.asdict(row),
    }


def tiers(model: str, out: Path, phase: str) -> dict[str, Any]:
    """A disk tier under the host pool: one engine stores (and cascades), a fresh engine reloads from disk."""
    from vllm import LLM

    tier = {"type": "fs", "root_dir": str(out / "disk"), "n_read_threads": 2, "n_write_threads": 2}
    llm = LLM(
        model=model,
        distributed_executor_backend="uni",
        kv_transfer_config=connector_config({"spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier]}),
        **ENGINE_KW,
    )
    half = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    result: dict[str, Any] = {}
    result["tokens"], result["cached"] = one_by_one(llm, prompts())
    result.update(_until_landed(llm, half))
    return result


def shared_store(model: str, out: Path, role: str) -> dict[str, Any]:
    """A shared tier under the host pool: engine A fills it, engine B serves from it.

    The tier is ``KVO_TEST_TIER_JSON`` (a ``secondary_tiers`` entry: the object-store tier's), else a Valkey tier
    whose url comes from ``KVO_TEST_VALKEY_URL`` (``KVO_TEST_VALKEY_CLUSTER=1``: a cluster node's url). ``role`` is
    ``fill`` (A: waits until every store and cascade has landed) or ``serve`` (B: a new process, empty host pool).
    """
    from vllm import LLM

    cluster = os.environ.get("KVO_TEST_VALKEY_CLUSTER") == "1"
    given = os.environ.get("KVO_TEST_TIER_JSON")
    tier = (
        json.loads(given) if given else {"type": "valkey", "url": os.environ["KVO_TEST_VALKEY_URL"], "cluster": cluster}
    )
    # What B gets is checked here, not how fast: a busy 2-core machine can take longer than the default 0.1 s.
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier], "tier_lookup_timeout_s": 10.0}
    llm = LLM(model=model, distributed_executor_backend="uni", kv_transfer_config=connector_config(extra), **ENGINE_KW)
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    half = connector._scheduler
    result: dict[str, Any] = {"role": role, "engine_id": connector.offloading_config.engine_id}
    result["before"] = stats_dict(llm)
    result["tokens"], result["cached"] = one_by_one(llm, prompts())
    result.update(_until_landed(llm, half))
    return result


def serve_until_killed(model: str, out: Path) -> dict[str, Any]:
    """vLLM's default multi-process engine with a disk and a Valkey tier, kept busy until the test kills it.

    Prints ``READY`` once the first prompts were served (their stores and cascades then run while it keeps
    generating); never returns on its own.
    """
    from vllm import LLM

    tiers = [
        {"type": "fs", "root_dir": str(out / "disk"), "n_read_threads": 2, "n_write_threads": 2},
        {"type": "valkey", "url": os.environ["KVO_TEST_VALKEY_URL"]},
    ]
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": tiers}
    llm = LLM(model=model, kv_transfer_config=connector_config(extra), **ENGINE_KW)
    one_by_one(llm, prompts())
    print(f"READY {os.getpid()}", flush=True)
    i = 0
    while True:
        i += 1
        generate(llm, [f"{SYSTEM} busy {i}"], max_tokens=4)


def sliding_window(model: str, out: Path) -> dict[str, Any]:
    """A sliding-window model: the host serves the chunks of the window the request needs."""
    from vllm import LLM

    llm = LLM(model=model, distributed_executor_backend="uni", kv_transfer_config=connector_config({}), **ENGINE_KW)
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    result: dict[str, Any] = {
        "spec_types": [type(g.kv_cache_spec).__name__ for g in connector.snapshot.kv_cache_config.kv_cache_groups],
        "window_chunks": [g.sliding_window_size_in_chunks for g in connector.offloading_config.groups],
    }
    result["first_tokens"], result["first_cached"] = one_by_one(llm, prompts())
    llm.reset_prefix_cache()
    result["reset_tokens"], result["reset_cached"] = one_by_one(llm, prompts())
    result["stats"] = stats_dict(llm)
    return result


def misspelled(model: str, out: Path) -> dict[str, Any]:
    from vllm import LLM

    try:
        LLM(
            model=model,
            distributed_executor_backend="uni",
            kv_transfer_config=connector_config({"cpu_byte_to_use": 1 << 20}),
            **ENGINE_KW,
        )
    except Exception as exc:  # the test asserts on the type and message
        return {"error_type": type(exc).__name__, "error": str(exc)}
    return {"error_type": None, "error": ""}


def concurrent_prefix(model: str, out: Path, mode: str) -> dict[str, Any]:
    """Several requests sharing a long prefix that is already in the host pool arrive at once.

    ``mode``: ``baseline`` (no connector), ``async`` (the connector's default loads) or ``sync-budget``
    (``sync_load_budget_bytes``: hits load inside the step). One request computes the prefix first (the connector
    stores it), then the engine's prefix cache is emptied: the batch can only get the prefix from host memory.
    """
    from vllm import LLM

    extra: dict[str, Any] | None = {"async": {}, "sync-budget": {"sync_load_budget_bytes": 1 << 30}}.get(mode)
    kw: dict[str, Any] = {} if extra is None else {"kv_transfer_config": connector_config(extra)}
    llm = LLM(model=model, distributed_executor_backend="uni", **kw, **ENGINE_KW)
    batch = [f"{SYSTEM}question {i} about what the prefix says" for i in range(4)]
    result: dict[str, Any] = {}
    result["warm_tokens"], _ = generate(llm, [f"{SYSTEM}warm up"])
    if extra is not None:
        half = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
        for _ in range(100):  # keep the engine stepping until the prefix's stores have landed
            if not half.scheduler.has_pending_work():
                break
            generate(llm, ["pump"], max_tokens=1)
        result["before"] = stats_dict(llm)
    llm.reset_prefix_cache()
    result["tokens"], result["cached"] = generate(llm, batch)  # one generate call: all four arrive together
    if extra is not None:
        result["after"] = stats_dict(llm)
    return result


def main() -> None:
    scenario, model, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    if scenario == "baseline":
        result = baseline(model, out_dir)
    elif scenario in ("connector-async", "connector-sync", "connector-layerwise"):
        result = connector(model, out_dir, scenario.split("-")[1])
    elif scenario == "multiprocess":
        result = multiprocess(model, out_dir)
    elif scenario == "tp2":
        result = multiprocess(model, out_dir, tensor_parallel_size=2)
    elif scenario in ("tiers-store", "tiers-reload"):
        result = tiers(model, out_dir, scenario.split("-")[1])
    elif scenario == "sliding-window":
        result = sliding_window(model, out_dir)
    elif scenario == "misspelled":
        result = misspelled(model, out_dir)
    elif scenario in ("shared-fill", "shared-serve"):
        result = shared_store(model, out_dir, scenario.split("-")[1])
    elif scenario in ("concurrent-prefix-baseline", "concurrent-prefix-async", "concurrent-prefix-sync-budget"):
        result = concurrent_prefix(model, out_dir, scenario.removeprefix("concurrent-prefix-"))
    elif scenario == "serve-until-killed":
        result = serve_until_killed(model, out_dir)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    print("RESULT " + json.dumps(result), flush=True)
    # Skip vLLM's interpreter-exit teardown (it can hang on a half-closed engine); everything is flushed.
    os._exit(0)


if __name__ == "__main__":
    main()
