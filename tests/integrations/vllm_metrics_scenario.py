"""A real vLLM engine with the connector, read back through ``LLM.get_metrics()`` (test_vllm_metrics.py runs it).

One in-process engine on the tiny model at ``MODEL_DIR``, vLLM's own prefix cache off so every prompt asks the
connector. Request ``a`` is prefilled; one step later, while its prompt's stores are still in flight, request ``b``
with the same prompt arrives: its lookup is deferred until the stores land, then it loads the prompt from the host
pool. The figures vLLM's Prometheus registry then holds are printed as one JSON line ``RESULT {...}``.
Run: ``python vllm_metrics_scenario.py MODEL_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests/ and testing/

from tests.integrations.vllm_scenarios import ENGINE_KW, SYSTEM, connector_config


def run(model: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram

    llm = LLM(
        model=model,
        distributed_executor_backend="uni",
        kv_transfer_config=connector_config({"block_size": 64}),
        disable_log_stats=False,  # LLM turns stats off by default; get_metrics needs them
        **{**ENGINE_KW, "enable_prefix_caching": False},
    )
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = f"{SYSTEM}question one about the first answer"
    engine.add_request("a", prompt, params)
    engine.step()  # a's prefill: its prompt chunks are stored from the next step on
    engine.add_request("b", prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps > 200:
            raise SystemExit("the requests did not finish")
    stats = engine.engine_core.engine_core.scheduler.connector.scheduler_stats
    figures: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Histogram):
            figures[metric.name] = {"count": metric.count, "sum": metric.sum}
        elif isinstance(metric, Counter | Gauge):
            figures[metric.name] = metric.value
    return {
        "figures": {name: value for name, value in figures.items() if "kv_offload" in name},
        "bytes_loaded": stats.bytes_loaded,
        "bytes_stored": stats.bytes_stored,
        "lookups_deferred": stats.lookups_deferred,
    }


def main() -> None:
    result = run(sys.argv[1])
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # skip vLLM's interpreter-exit teardown (it can hang on a half-closed engine)


if __name__ == "__main__":
    main()
