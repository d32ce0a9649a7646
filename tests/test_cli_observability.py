"""`kvoffload demo` with metrics, miss explanations and KV events: a real HTTP scrape and a real ZMQ subscriber.

The demo runs as its own process (it spawns two worker processes). While it runs, /metrics is scraped over
HTTP; once the table is printed (the server lingers), the final scrape must agree with the table.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload._events import KVEventSubscriber
from tests.helpers import with_default_sigint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def _table_value(out: str, row: str) -> str:
    match = re.search(rf"│ {re.escape(row)}\s*│\s*(.+?)\s*│", out)
    assert match, f"row {row!r} not in the table:\n{out}"
    return match.group(1)


@pytest.mark.slow
def test_demo_serves_metrics_explains_misses_and_publishes_events() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sub = KVEventSubscriber(endpoint)  # ZMQ connects as soon as the demo binds
    code = "import sys; from kvoffload._cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["demo", "--requests", "8", "--conversations", "2", "--no-progress", "--metrics-port", "0"]
    args += ["--metrics-linger", "120", "--explain-misses", "--kv-events", endpoint]
    proc = subprocess.Popen(
        with_default_sigint([sys.executable, "-c", code, *args]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    batches = []
    try:
        assert proc.stderr is not None and proc.stdout is not None
        first = proc.stderr.readline()
        match = re.search(r"serving metrics at (\S+)", first)
        assert match, first
        url = match.group(1)

        scrapes: list[dict[tuple[str, tuple[tuple[str, str], ...]], float]] = []
        stop = threading.Event()

        def scrape_while_running() -> None:
            while not stop.is_set():
                scrapes.append(_scrape(url))
                time.sleep(0.2)

        scraper = threading.Thread(target=scrape_while_running)
        scraper.start()
        out_lines = []
        for line in proc.stdout:
            out_lines.append(line)
            if line.startswith("kv events:"):
                break
        stop.set()
        scraper.join()
        out = "".join(out_lines)
        final = _scrape(url)  # the demo is done and lingering: these are the final values
        while (got := sub.recv(timeout_s=2.0)) is not None:
            batches.append(got)
    finally:
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
        sub.close()
    assert proc.returncode == 0, err
    assert "ok:" in rest

    # scraped during the run: the endpoint answered with our series before the table was printed
    assert scrapes and any(("kvoffload_lookups_total", ()) in s for s in scrapes)

    def value(name: str, **labels: str) -> float:
        return final[(name, tuple(sorted(labels.items())))]

    assert value("kvoffload_load_tokens_total", tier="host") == int(_table_value(out, "prompt tokens loaded from host"))
    stored, loaded = (int(x) for x in _table_value(out, "bytes stored / loaded").split(" / "))
    assert value("kvoffload_load_bytes_total", tier="host") == loaded > 0  # summed over both worker processes
    assert value("kvoffload_store_bytes_total", tier="host") == stored > 0
    assert value("kvoffload_pool_chunks", tier="host", state="capacity") == int(
        _table_value(out, "host pool chunks filled at end").split(" of ")[1]
    )
    # the miss breakdown printed by --explain-misses is what the metrics counted
    for match in re.finditer(r"│ (\w+)\s*│\s*(\d+) │\s*(\d+) │", out):
        reason, lookups, chunks = match.group(1), int(match.group(2)), int(match.group(3))
        if reason == "total":
            continue
        assert value("kvoffload_lookup_misses_total", reason=reason) == lookups, reason
        assert value("kvoffload_chunk_misses_total", reason=reason) == chunks, reason
    assert value("kvoffload_lookup_misses_total", reason="never_stored") > 0

    # every published batch arrived, in order, without gaps
    published = int(re.search(r"kv events: (\d+) batches published, 0 dropped", out).group(1))  # type: ignore[union-attr]
    assert [b.batch.seq for b in batches] == list(range(published)) and published > 0
    assert sub.gaps == []
    assert value("kvoffload_kv_event_batches_total", outcome="sent") == published


def test_observability_option_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from kvoffload._cli import main

    assert main(["demo", "--no-progress", "--metrics-port", "0", "--metrics-linger", "-1"]) == 2
    assert "--metrics-linger=-1" in capsys.readouterr().err
    assert main(["demo", "--no-progress", "--metrics-port", "70000"]) == 2
    assert "metrics port must be an int in [0, 65535], got 70000" in capsys.readouterr().err
    assert main(["demo", "--no-progress", "--kv-events", "nowhere"]) == 2
    assert "'nowhere'" in capsys.readouterr().err
