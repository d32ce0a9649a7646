"""Damaged tier records and load faults in a real vLLM engine: the outputs must stay token-identical to a cold
engine's (tests/integrations/test_vllm_faults.py runs it; the chaos run is ``serve ... chaos`` with many rounds).

``python vllm_faults_scenario.py PHASE MODEL_DIR OUT_DIR TIER [ROUNDS]`` with TIER ``fs`` (records under
``OUT_DIR/../disk``), ``valkey`` (``KVO_TEST_VALKEY_URL``) or ``obj`` (the tier entry in ``KVO_TEST_TIER_JSON``);
``KVO_TEST_SERVER_PID`` names the server process for the kill and freeze rounds:

* ``cold``: the prompts on an engine without the connector (writes ``cold.json`` beside ``OUT_DIR``);
* ``fill``: engine A serves the prompts with the tier and waits until every record landed;
* ``serve``: engine B (a new process: an empty host pool) runs ``ROUNDS`` (comma-separated), each: empty the
  engine's and the connector's caches, damage the tier (or arm a fault plan through ``KVOFFLOAD_FAULTS=@FILE``),
  serve every prompt, compare with the cold tokens, then let B store the recomputed chunks back into the tier.

Rounds: ``overwrite`` (64 bytes in the middle of every third record, same length), ``truncate`` (every third
record cut to half), ``swap`` (pairs of records exchange their bytes), ``delete`` (each tier read deletes half its
records just before reading: mid-promotion), ``freeze``/``kill`` (the Valkey or S3 server is SIGSTOPped / SIGKILLed at
the first tier read of the round), ``chaos`` (random damaged reads and failed host-to-engine loads).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for testing/ (not shipped)

from testing.tiny_model import WORDS

SYSTEM = "the system cache memory block offload host device layer head attention value key page " * 12


def _text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + j * 3 + j // 5) % len(WORDS)] for j in range(n))


PROMPTS = [
    SYSTEM + _text(1, 200) + " question one",
    SYSTEM + _text(1, 200) + " question two about it",
    SYSTEM + _text(2, 500) + " question three",
    _text(3, 700) + " a fourth question about the prefix",
]
_ENGINES: list[Any] = []
ENGINE_KW: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 1024,
    "enforce_eager": True,
    "block_size": 32,
    "kv_cache_memory_bytes": 4 << 20,
    "enable_prefix_caching": True,
    "seed": 0,
    "max_num_seqs": 4,
}


def _tier(out: Path, kind: str) -> dict[str, Any]:
    if kind == "fs":
        return {"type": "fs", "root_dir": str(out.parent / "disk"), "n_read_threads": 2, "n_write_threads": 2}
    if kind == "obj":
        entry: dict[str, Any] = json.loads(os.environ["KVO_TEST_TIER_JSON"])
        return entry
    return {"type": "valkey", "url": os.environ["KVO_TEST_VALKEY_URL"]}


def _engine(model: str, out: Path, kind: str | None) -> Any:
    from vllm import LLM

    kw = dict(ENGINE_KW)
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        kw["distributed_executor_backend"] = "uni"
    if kind is not None:
        extra = {
            "cpu_bytes_to_use": 64 << 20,
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [_tier(out, kind)],
            # What B serves is checked here, not how fast: a busy 2-core machine can take longer than 0.1 s.
            "tier_lookup_timeout_s": 10.0,
        }
        kw["kv_transfer_config"] = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    llm = LLM(model=model, **kw)
    _ENGINES.append(llm)
    return llm


def _generate(llm: Any, prompt: str, max_tokens: int = 16) -> tuple[list[int], int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


class _Medium:
    """The tier's records as the test sees them: list, damage, count."""

    def __init__(self, out: Path, kind: str) -> None:
        self.kind = kind
        self.root = out.parent / "disk"
        self.client: Any = None
        if kind == "valkey":
            import valkey

            self.client = valkey.Valkey.from_url(os.environ["KVO_TEST_VALKEY_URL"], socket_timeout=10)
        elif kind == "obj":
            from obstore.store import S3Store

            entry = _tier(out, kind)
            store = entry["store_config"]
            self.prefix = f"{entry['prefix']}/"
            self.client = S3Store(
                store["bucket"],
                config={
                    "endpoint": store["endpoint_override"],
                    "access_key_id": store["access_key"],
                    "secret_access_key": store["secret_key"],
                    "region": store["region"],
                },
                client_options={"allow_http": True},
            )

    def records(self) -> list[Any]:
        if self.kind == "fs":
            return sorted(p for p in self.root.rglob("*.bin") if not p.name.startswith("."))
        if self.kind == "obj":
            import obstore

            pages = obstore.list(self.client, prefix=self.prefix)
            return sorted(m["path"] for page in pages for m in page if m["path"].endswith(".bin"))
        return sorted(self.client.scan_iter(match=b"kvo:*", count=1000))

    def read(self, record: Any) -> bytes:
        if self.kind == "obj":
            import obstore

            return bytes(obstore.get(self.client, record).bytes())
        return bytes(record.read_bytes() if self.kind == "fs" else self.client.get(record))

    def write(self, record: Any, data: bytes) -> None:
        if self.kind == "fs":
            with open(record, "r+b") as f:  # in place, as a failing disk or a stray writer would
                f.write(data)
                f.truncate(len(data))
        elif self.kind == "obj":
            import obstore

            obstore.put(self.client, record, data)  # a stray writer replaces the whole object
        else:
            self.client.set(record, data)

    def damage(self, how: str) -> dict[Any, bytes]:
        """Damage records as ``how`` says; what each damaged record holds now."""
        records = self.records()
        damaged: list[Any] = []
        if how == "swap":
            for a, b in zip(records[0::3], records[1::3], strict=False):
                data_a, data_b = self.read(a), self.read(b)
                self.write(a, data_b)
                self.write(b, data_a)
                damaged += [a, b]
            return {r: self.read(r) for r in damaged}
        for record in records[::3]:
            data = self.read(record)
            if how == "overwrite":
                mid = len(data) // 2
                self.write(record, data[:mid] + os.urandom(64) + data[mid + 64 :])
            elif how == "truncate":
                self.write(record, data[: len(data) // 2])
            damaged.append(record)
        return {r: self.read(r) for r in damaged}

    def caught(self, damaged: dict[Any, bytes]) -> int:
        """How many ``damaged`` records no longer hold their damage: a tier that catches a damaged record deletes it
        (and the engine, recomputing, may store a good one under the same name)."""
        present = set(self.records())
        return sum(r not in present or self.read(r) != data for r, data in damaged.items())


def _plan(out: Path, round_kind: str, seed: int) -> dict[str, Any] | None:
    log = str(out / "faults.log")
    if round_kind == "delete":
        return {"tier_delete": 1.0, "log": log, "seed": seed}
    if round_kind in ("freeze", "kill"):
        name = "SIGSTOP" if round_kind == "freeze" else "SIGKILL"
        return {"signal_pid": int(os.environ["KVO_TEST_SERVER_PID"]), "signal_name": name, "log": log, "seed": seed}
    if round_kind == "chaos":
        return {"tier_record": 0.3, "host_load": 0.25, "log": log, "seed": seed}
    return None


def _settle(llm: Any, medium: _Medium, target: int, rounds: int = 60) -> int:
    """Keep the engine stepping until the tier holds ``target`` records again (B stores what it recomputed)."""
    n = len(medium.records())
    for i in range(rounds):
        if n >= target:
            break
        _generate(llm, f"pump {i}", max_tokens=1)
        time.sleep(0.05)
        n = len(medium.records())
    return n


def cold(model: str, out: Path) -> dict[str, Any]:
    llm = _engine(model, out, None)
    tokens = [_generate(llm, p)[0] for p in PROMPTS]
    (out.parent / "cold.json").write_text(json.dumps(tokens))
    return {"tokens": tokens}


def fill(model: str, out: Path, kind: str) -> dict[str, Any]:
    llm = _engine(model, out, kind)
    medium = _Medium(out, kind)
    tokens = [_generate(llm, p)[0] for p in PROMPTS]
    stable, last = 0, -1
    for i in range(200):  # until the record count stops growing (every store and cascade landed)
        _generate(llm, f"pump {i}", max_tokens=1)
        n = len(medium.records())
        stable, last = (stable + 1 if n == last else 0), n
        if stable >= 10:
            break
        time.sleep(0.05)
    return {"tokens": tokens, "records": len(medium.records())}


def serve(model: str, out: Path, kind: str, rounds: list[str]) -> dict[str, Any]:
    from kvoffload.faults import FAULTS_ENV

    plan_file = Path(os.environ[FAULTS_ENV].removeprefix("@"))
    expected = json.loads((out.parent / "cold.json").read_text())
    medium = _Medium(out, kind)
    full = len(medium.records())
    llm = _engine(model, out, kind)
    results: list[dict[str, Any]] = []
    for n, round_kind in enumerate(rounds):
        llm.reset_prefix_cache(reset_connector=True)  # every hit of the round comes from the tier
        damaged = medium.damage(round_kind) if round_kind in ("overwrite", "truncate", "swap") else {}
        plan = _plan(out, round_kind, n)
        if plan is not None:
            plan_file.write_text(json.dumps(plan))
        served = [_generate(llm, p) for p in PROMPTS]
        plan_file.unlink(missing_ok=True)
        if round_kind == "freeze":
            os.kill(int(os.environ["KVO_TEST_SERVER_PID"]), signal.SIGCONT)
        row = {
            "round": round_kind,
            "same": [tokens == want for (tokens, _), want in zip(served, expected, strict=True)],
            "cached": [cached for _, cached in served],
            "damaged": len(damaged),
            "caught": medium.caught(damaged) if round_kind != "kill" else 0,
        }
        if round_kind != "kill":
            row["records_after"] = _settle(llm, medium, full)
        results.append(row)
    return {"records": full, "rounds": results}


def main() -> None:
    phase, model, out, kind = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    out.mkdir(parents=True, exist_ok=True)
    if phase == "cold":
        result = cold(model, out)
    elif phase == "fill":
        result = fill(model, out, kind)
    else:
        result = serve(model, out, kind, sys.argv[5].split(","))
    print("RESULT " + json.dumps(result), flush=True)
    for llm in _ENGINES:  # the multi-process engine's core runs in a child process that shares our stdout
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
