"""A real vLLM engine publishing self-describing KV events of the connector over vLLM's ZMQ publisher.

Run: ``python vllm_events_scenario.py MODEL_DIR OUT_DIR``; prints one ``RESULT {...}`` line: every KV event batch
the subscriber received (vLLM's own GPU-side events and the connector's CPU ones) and the prompts' token ids.
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); a small host pool makes later prompts
evict the first one's chunks, so removals are published too.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from tests.integrations.vllm_scenarios import ENGINE_KW, SYSTEM, connector_config, fillers

HOST_BYTES = 2 << 20  # a few chunks of the tiny model: the fillers evict the first prompt's chunks


def _plain(event: Any) -> dict[str, Any]:
    """A vLLM event as a JSON dict (vLLM's structs are positional): its class and fields, hashes in hex."""

    def value(v: Any) -> Any:
        if isinstance(v, bytes):
            return v.hex()
        if isinstance(v, list | tuple):
            return [value(x) for x in v]
        return v

    return {"type": type(event).__name__, **{f: value(getattr(event, f)) for f in event.__struct_fields__}}


def _subscribe(endpoint: str, stop: threading.Event, batches: list[dict[str, Any]]) -> threading.Thread:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)

    def run() -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(50):
                continue
            _topic, _seq, payload = sock.recv_multipart()
            batch = decoder.decode(payload)
            batches.append({"events": [_plain(event) for event in batch.events]})
        sock.close(linger=0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    model, out = sys.argv[1], Path(sys.argv[2])
    endpoint = f"ipc://{out / 'kv-events.sock'}"
    llm = LLM(
        model=model,
        distributed_executor_backend="uni",
        kv_transfer_config=connector_config(
            {"cpu_bytes_to_use": HOST_BYTES, "block_size": 64, "self_describing_kv_events": True}
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint),
        **ENGINE_KW,
    )
    batches: list[dict[str, Any]] = []
    stop = threading.Event()
    thread = _subscribe(endpoint.replace("ipc://*", "ipc://"), stop, batches)
    time.sleep(1.0)  # ZMQ's slow joiner: the subscription reaches the publisher before the first batch
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt_ids: list[list[int]] = []
    for batch in ([f"{SYSTEM}question one"], fillers(2), ["pump"]):
        for output in llm.generate(batch, params, use_tqdm=False):
            prompt_ids.append(list(output.prompt_token_ids or []))
    time.sleep(1.0)  # the publisher's thread sends the last batches
    stop.set()
    thread.join(5)
    half = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    tracker = half._payloads.tracker
    result = {
        "batches": batches,
        "prompt_ids": prompt_ids,
        "tokens_per_block": half.scheduler.groups[0].tokens_per_block,
        "kept_payloads": len(tracker),
        "in_pool": tracker.in_pool,
        "pool_keys": len(half.scheduler.manager),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
