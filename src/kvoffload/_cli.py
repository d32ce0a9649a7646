"""The ``kvoffload`` command: translate engine snapshots and print the schema.

Subcommands (one ``_add_<name>`` parser builder and one ``_run_<name>`` handler each, wired in
:func:`_build_parser`, so a new subcommand is two functions and one line there):

* ``kvoffload translate FILE.json|FILE.toml [--explain] [--format json|toml] [--max-bytes SIZE]`` prints the config
  with vLLM 0.33's field names (pretty JSON by default); a snapshot vLLM translates but kvoffload cannot run
  (:func:`~kvoffload.translate.validate_runnable`) is refused.
* ``kvoffload schema [--json-schema | --version]`` prints the JSON Schema of an engine snapshot, or the schema
  version and fingerprint.
* ``kvoffload demo [--workers N] [--requests N] [--cpu-bytes SIZE] [--policy lru|arc] [--snapshot FILE [--shrink]]
  [--worker-timeout SECONDS] [--start-timeout SECONDS]`` runs the verified multi-process offloading demo (the
  main job); it exits 1 when any reloaded block mismatches or a worker dies (with the worker's own error).
  ``--shrink`` reduces a real-size snapshot's engine blocks and host pool to fit this machine and prints what
  it changed.
  ``--metrics-port N`` serves Prometheus ``/metrics`` while it runs, ``--explain-misses`` prints why lookups
  missed, ``--kv-events tcp://HOST:PORT`` publishes the pool's KV events (``tcp://HOST:*``: any free port; the
  bound endpoint is printed).

Invalid input (usage errors and out-of-range flags included: every numeric flag has a bound, checked before
anything runs), unrunnable snapshots and translator rejections exit with status 2 and one ``error: …`` line on
stderr (no traceback); Ctrl-C exits with 130 and SIGTERM with 143, each with one line, after the same orderly
stop (the demo's workers and embedded servers stopped, its files removed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import msgspec

from kvoffload._flags import MAX_TRANSLATE_BYTES, check_seconds, events_endpoint, parse_size, size_flag
from kvoffload._generated import SCHEMA_FINGERPRINT, SCHEMA_VERSION, codecs
from kvoffload._generated.types import EngineSnapshot, OffloadingConfig
from kvoffload._ints import check_int
from kvoffload._toml import dumps_toml
from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.translate import (
    DEFAULT_MAX_SNAPSHOT_BYTES,
    describe_error,
    explain_snapshot,
    load_snapshot,
    validate_runnable,
)

__all__ = ["main", "parse_size"]  # parse_size: the sizes --cpu-bytes and --max-bytes take

EXIT_OK = 0
EXIT_INVALID = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvoffload`` command line; returns the process exit status (0 ok, 2 invalid input)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        with _sigterm_unwinds():
            return handler(args)
    except ConfigError as err:
        _error(describe_error(err))
        return EXIT_INVALID
    except KVOffloadError as err:
        _error(f"{type(err).__name__}: {err}")
        return EXIT_FAILED
    except _Terminated:
        _error("stopped by SIGTERM")  # the same orderly stop as Ctrl-C; 128 + SIGTERM
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        # Ctrl-C: the handlers' own cleanup (workers, shared memory) has run on the way out; one line, 128 + SIGINT.
        _error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


class _Terminated(KeyboardInterrupt):
    """SIGTERM (how a service manager stops a program), raised in the main thread: it unwinds like Ctrl-C."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While the command runs, the first SIGTERM raises :class:`_Terminated` (later ones do not interrupt the
    stop it started); the previous handler is restored after. Signal handlers belong to the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Parser(argparse.ArgumentParser):
    """A parser whose usage errors are one ``error: …`` line and exit status 2, like every other invalid input
    (its sub-parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        _error(f"{self.prog}: {message} (see {self.prog} --help)")
        self.exit(EXIT_INVALID)


def _build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per subcommand."""
    parser = _Parser(
        prog="kvoffload",
        description="Offload LLM KV caches to host memory: translate engine snapshots, inspect the schema.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_translate(subparsers)
    _add_schema(subparsers)
    _add_demo(subparsers)
    return parser


def _error(message: str) -> None:
    """Print one ``error: …`` line to stderr (newlines in the message are folded)."""
    print("error: " + " ".join(message.split()), file=sys.stderr)


# ------------------------------------------------------------------------------------------------------------
# demo
# ------------------------------------------------------------------------------------------------------------


def _add_demo(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    """``kvoffload demo [options]``."""
    p = subparsers.add_parser(
        "demo",
        help="run a verified multi-process offloading demo (scheduler + N worker processes)",
        description=(
            "Drive a synthetic multi-turn chat through the scheduler and N worker processes with a small "
            "engine block pool, so KV is evicted and reloaded from host memory; every reloaded block is "
            "verified byte for byte. Exits 1 on any mismatch, failed job or dead worker."
        ),
    )
    p.add_argument("--workers", type=int, default=None, help="worker processes (default 2; the snapshot's world size)")
    p.add_argument("--requests", type=int, default=48, help="requests to run (default 48)")
    p.add_argument("--conversations", type=int, default=8, help="concurrent conversations (default 8)")
    p.add_argument(
        "--cpu-bytes", type=size_flag(1), default=None, help="host budget across all workers (default 128MiB)"
    )
    p.add_argument("--policy", choices=("lru", "arc"), default=None, help="host eviction policy (default lru)")
    p.add_argument("--snapshot", default=None, help="engine snapshot JSON/TOML instead of the embedded Llama-style one")
    p.add_argument(
        "--shrink",
        action="store_true",
        help="reduce a real-size --snapshot to fit this machine (fewer engine blocks, smaller host pool; ranks, "
        "groups and layout kept) and print what changed",
    )
    p.add_argument("--shared-pool", action="store_true", help="map one shared-memory host pool for all ranks")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up a worker that sends no heartbeat for this long: stopped or frozen (default 10)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up workers that have not completed their start-up by then (default 120; a worker stopped "
        "while starting is given up after --worker-timeout)",
    )
    p.add_argument(
        "--tier",
        action="append",
        default=[],
        help="secondary tier below the host pool, repeatable: disk:PATH, valkey (embedded server), valkey://host:port",
    )
    p.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    p.add_argument(
        "--contend",
        type=int,
        default=0,
        metavar="N",
        help="run beside N busy processes (a loaded host, reproducible on any machine; default 0)",
    )
    # -- observability (issue 13)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on 127.0.0.1:PORT")
    p.add_argument(
        "--metrics-linger",
        type=float,
        default=0.0,
        help="keep serving /metrics this many seconds after the run (so a scraper sees the final values)",
    )
    p.add_argument("--explain-misses", action="store_true", help="print why lookups missed, per reason")
    p.add_argument(
        "--kv-events", default=None, metavar="ENDPOINT", help="publish KV events on a ZMQ endpoint (tcp://HOST:PORT)"
    )
    p.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    """Build the snapshot, run the demo, print the table; 1 when anything failed verification."""
    from kvoffload.demo import DemoOptions, default_snapshot, render_result, run_demo, snapshot_with_overrides
    from kvoffload.demo.workload import MAX_CONVERSATIONS, MAX_REQUESTS

    check_int("--requests", args.requests, 1, MAX_REQUESTS, value_first=True)
    check_int("--conversations", args.conversations, 1, MAX_CONVERSATIONS, value_first=True)
    if args.worker_timeout is not None:
        check_seconds("--worker-timeout", args.worker_timeout, zero=False)
    if args.start_timeout is not None:
        check_seconds("--start-timeout", args.start_timeout, zero=False)
    check_seconds("--metrics-linger", args.metrics_linger, zero=True)
    check_int("--contend", args.contend, 0, 1024, value_first=True)
    endpoint = None if args.kv_events is None else events_endpoint(args.kv_events)
    if args.snapshot is None:
        snapshot = default_snapshot(workers=2 if args.workers is None else args.workers)
    else:
        snapshot = load_snapshot(args.snapshot)
        world = snapshot.engine_config.parallel_config.world_size
        if args.workers is not None and args.workers != world:
            raise ConfigError(f"--workers={args.workers} differs from the snapshot's world_size={world}")
    tiering = None
    if args.tier:
        from kvoffload._generated import TieringConfig
        from kvoffload.tiers import tier_from_cli

        tiering = TieringConfig(secondary_tiers=tuple(tier_from_cli(t) for t in args.tier))
    options = DemoOptions(
        requests=args.requests,
        conversations=args.conversations,
        seed=args.seed,
        shared_pool=args.shared_pool,
        tiering=tiering,
    )
    if args.worker_timeout is not None:
        options = dataclasses.replace(options, worker_timeout_s=args.worker_timeout)
    if args.shrink:
        from kvoffload.demo import shrink_snapshot

        shrunk = shrink_snapshot(snapshot, options)
        print(f"shrunk {args.snapshot or 'the demo snapshot'} to fit this machine: {shrunk.describe()}", flush=True)
        snapshot = shrunk.snapshot
    snapshot = snapshot_with_overrides(snapshot, cpu_bytes=args.cpu_bytes, policy=args.policy)
    with contextlib.ExitStack() as stack:
        kwargs = _demo_observability(args, endpoint, stack)
        if args.contend:
            from kvoffload.demo.contend import contended

            stack.enter_context(contended(args.contend))
        result = run_demo(
            snapshot, options, progress=not args.no_progress, start_timeout_s=args.start_timeout, **kwargs
        )
        print(render_result(result), end="")
        if args.explain_misses:
            from kvoffload.demo import render_misses

            print(render_misses(result), end="")
        if "events" in kwargs:
            print(f"kv events: {result.events_published} batches published, {result.events_dropped} dropped")
        if args.metrics_port is not None and args.metrics_linger > 0:
            sys.stdout.flush()
            try:
                time.sleep(args.metrics_linger)
            except _Terminated:
                raise
            except KeyboardInterrupt:
                pass  # Ctrl-C ends the lingering, not the run
    if not result.ok:
        _error(
            f"verification failed: {len(result.mismatched_blocks)} mismatched blocks, {result.failed_jobs} "
            f"failed jobs, dead workers {result.dead_workers}"
            + "".join(f"; {reason}" for reason in result.worker_errors.values())
        )
        return 1
    print(f"ok: {result.blocks_verified} reloaded blocks verified byte for byte")
    return EXIT_OK


def _demo_observability(args: argparse.Namespace, endpoint: str | None, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Metrics registry + server, worker metrics directory and KV event publisher the demo flags ask for."""
    kwargs: dict[str, Any] = {}
    if args.metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from kvoffload.metrics import SchedulerMetrics, add_worker_collector, serve_metrics

        metrics_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvoffload-metrics-"))
        registry = CollectorRegistry()
        kwargs["metrics"] = SchedulerMetrics(registry)
        kwargs["metrics_dir"] = metrics_dir
        add_worker_collector(registry, metrics_dir)
        server = stack.enter_context(serve_metrics(registry, args.metrics_port))
        print(f"serving metrics at {server.url}", file=sys.stderr)
    if endpoint is not None:
        from kvoffload._events import KVEventPublisher

        publisher = stack.enter_context(KVEventPublisher(endpoint, engine_id="kvoffload-demo"))
        kwargs["events"] = publisher
        print(f"publishing KV events at {publisher.endpoint}", file=sys.stderr)
    return kwargs


# ------------------------------------------------------------------------------------------------------------
# translate
# ------------------------------------------------------------------------------------------------------------


def _add_translate(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    """``kvoffload translate FILE [--explain] [--format json|toml]``."""
    p = subparsers.add_parser(
        "translate",
        help="translate an engine snapshot into the offloading config (vLLM 0.33 rules)",
        description=(
            "Read an engine snapshot ({engine_config, kv_cache_config}) from a JSON or TOML file and print "
            "the OffloadingConfig vLLM 0.33 would build, with vLLM's field names. Invalid input or a "
            "translator rejection prints one 'error: ...' line and exits with status 2."
        ),
    )
    p.add_argument("file", metavar="FILE", help="engine snapshot, FILE.json or FILE.toml")
    p.add_argument(
        "--max-bytes",
        type=size_flag(1, MAX_TRANSLATE_BYTES),
        default=DEFAULT_MAX_SNAPSHOT_BYTES,
        help="refuse a FILE larger than this (default 16MiB, at most 1GiB; e.g. 64MiB)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help=(
            "print every decision first (selected groups, tokens_per_hash, blocks_per_chunk, worker bytes, "
            "each replicated_layout / is_parallelism_agnostic / canonical gate), one per line as "
            "'topic = value  # reason', then a blank line and the config"
        ),
    )
    p.add_argument(
        "--format",
        choices=("json", "toml"),
        default="json",
        help=("output format: json (default, pretty-printed) or toml (None values are omitted: TOML has no null)"),
    )
    p.set_defaults(handler=_run_translate)


def _run_translate(args: argparse.Namespace) -> int:
    """Load, translate (with the decision trail when ``--explain``) and print the config."""
    snapshot: EngineSnapshot = load_snapshot(args.file, max_bytes=args.max_bytes)
    explanation = explain_snapshot(snapshot)
    if args.explain:
        for decision in explanation.decisions:
            print(decision.render())
    if explanation.error is not None:
        raise explanation.error
    config = explanation.config
    if config is None:  # pragma: no cover - an Explanation holds a config or an error
        raise ConfigError("translation produced no config")
    validate_runnable(snapshot, config)  # vLLM's translator lets some unrunnable values through
    if args.explain:
        print()
    print(_format_config(config, args.format), end="")
    return EXIT_OK


def _format_config(config: OffloadingConfig, fmt: str) -> str:
    """The config as pretty JSON or as TOML (None values omitted), ending with a newline."""
    if fmt == "toml":
        data = msgspec.to_builtins(config)
        if not isinstance(data, dict):  # pragma: no cover - a Struct always becomes a dict
            raise ConfigError("cannot render the config as TOML")
        return dumps_toml(data)
    return msgspec.json.format(codecs.encode(config, format="json"), indent=2).decode() + "\n"


# ------------------------------------------------------------------------------------------------------------
# schema
# ------------------------------------------------------------------------------------------------------------


def _add_schema(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    """``kvoffload schema [--json-schema | --version]``."""
    p = subparsers.add_parser(
        "schema",
        help="print the engine snapshot JSON Schema or the schema version",
        description="Print the JSON Schema of an engine snapshot (default), or the schema version.",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema",
        action="store_true",
        help="print the JSON Schema (draft 2020-12) of EngineSnapshot (the default)",
    )
    group.add_argument("--version", action="store_true", help="print the schema version and fingerprint")
    p.set_defaults(handler=_run_schema)


def _run_schema(args: argparse.Namespace) -> int:
    """Print the schema version line, or the JSON Schema of :class:`EngineSnapshot`."""
    if args.version:
        print(f"kvoffload schema {SCHEMA_VERSION} (fingerprint {SCHEMA_FINGERPRINT})")
        return EXIT_OK
    print(json.dumps(codecs.json_schema(EngineSnapshot), indent=2, sort_keys=True))
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
