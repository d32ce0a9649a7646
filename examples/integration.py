"""How an engine wires kvoffload in, end to end in one process (a real engine puts workers in other processes).

Run: python examples/integration.py
"""

from __future__ import annotations

import torch

import kvoffload
from kvoffload import wire
from kvoffload.demo import default_snapshot
from kvoffload.offload.pool import HostPool, plan_host_pool_from_config
from kvoffload.offload.worker import OffloadWorker
from kvoffload.offload.worker.copy import CopyEngine, transfer_layout_from_config


def main() -> None:
    # 1. Translate the engine's KV cache metadata (here a 1-worker Llama-style snapshot) into a plan.
    snapshot = default_snapshot(workers=1, num_blocks=64, cpu_bytes=32 << 20)
    config = kvoffload.translate_snapshot(snapshot)

    # 2. Scheduler side: a host block manager sized like the host pool, and the scheduler.
    pool_plan = plan_host_pool_from_config(config)
    manager = kvoffload.HostBlockManager(pool_plan.num_chunks, "lru")
    scheduler = kvoffload.OffloadScheduler(config, manager)

    # 3. Worker side: the engine's KV memory, the host pool and the copy engine.
    kv_memory = torch.randint(0, 256, (snapshot.kv_cache_config.kv_cache_tensors[0].size,), dtype=torch.uint8)
    layout = transfer_layout_from_config(snapshot.kv_cache_config, config)
    with HostPool(pool_plan) as pool:
        worker = OffloadWorker(CopyEngine(kv_memory, layout, pool), rank=0)

        def step() -> kvoffload.ReportOutcome:
            plan = scheduler.build_step_plan()
            plan = wire.decode(wire.encode(plan)).expect(kvoffload.StepPlan)  # what crosses the process boundary
            worker.start_step(plan)
            worker.wait_for_loads(plan)
            worker.end_step(plan)
            return scheduler.on_worker_reports([worker.drain(plan.step)])

        tokens = list(range(1, 129))  # 128 prompt tokens = 8 blocks of 16
        hashes = kvoffload.hash_token_blocks(tokens, config.cache.tokens_per_hash)

        # Request A computes its prompt; its blocks are stored to the host.
        scheduler.add_request("A", hashes, len(tokens))
        assert scheduler.lookup("A", num_computed_tokens=0) == 0
        scheduler.on_blocks_allocated("A", [list(range(8))])
        scheduler.on_tokens_computed("A", len(tokens))
        step()
        scheduler.finish_request("A")
        original = kv_memory.clone()

        # Request B has the same prefix: it loads 112 tokens (7 blocks) into other engine blocks.
        scheduler.add_request("B", hashes, len(tokens))
        hit = scheduler.lookup("B", num_computed_tokens=0)
        scheduler.on_blocks_allocated("B", [list(range(20, 28))], num_external_tokens=hit or 0)
        outcome = step()
        print(f"B loaded {hit} tokens; finished loads: {outcome.finished_loads}")
        page = layout.groups[0].layers[0].page_bytes  # layer 0: 8 heads x 16 tokens x (128 + 128) x 2 bytes
        for block in range(7):  # layer 0 of each loaded block equals what A computed
            assert torch.equal(kv_memory[(20 + block) * page :][:page], original[block * page :][:page])
        print("stats:", scheduler.stats())
        worker.close()


if __name__ == "__main__":
    main()
