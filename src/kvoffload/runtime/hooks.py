"""Worker hooks: application code a worker process runs at defined points of every step.

The runtime only moves KV between the engine memory and the host pool; an application that plays the engine
inside the worker (the demo's simulated forward pass, a test probe) plugs in a :class:`WorkerHook`. The
scheduler names the hook's factory by an importable dotted path (``"package.module:Factory"`` or
``"package.module.Factory"``) and gives it JSON options; both travel in the JSON ``WorkerSpec``, so nothing
crosses processes as pickle. In the worker process the factory is imported and called once with a
:class:`WorkerContext` (rank, the worker's KV memory and its layout, the offloading config, the options, its
tier IO); the hook it returns is then called:

* ``before_step(plan, attachments)`` when a StepPlan arrives, before the worker submits its transfers;
  ``attachments`` are the extra frames the scheduler sent with the plan (``WorkerCluster.step(plan, ...)``).
* ``after_step(plan, report)`` once the step's loads are done and its report is built, before the step's
  stores are queued: the engine's forward pass happens here (loaded KV is in place). The bytes it returns
  travel back as the report's attachments (``ClusterStep.attachments[rank]``).
* ``finish(report)`` on Shutdown, after the drain; its bytes travel with the final report.
* ``close()`` when the worker ends, whatever the reason.

An exception from a hook ends the worker like any other failure: the scheduler gets a ``WorkerFailure`` naming
the exception and marks the rank dead.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec
import torch

from kvoffload._generated import OffloadingConfig, StepPlan, WorkerReport
from kvoffload.errors import ConfigError
from kvoffload.offload.worker.copy import TransferLayout

if TYPE_CHECKING:
    from kvoffload.tiers import TierWorker

__all__ = [
    "HookOptions",
    "WorkerContext",
    "WorkerHook",
    "WorkerHookFactory",
    "decode_hook_options",
    "encode_hook_options",
    "load_hook",
    "make_hook",
]

HookOptions = Mapping[str, object]
"""JSON-safe options of a hook (numbers, strings, booleans, None, lists and string-keyed objects of them)."""


@dataclass(frozen=True)
class WorkerContext:
    """What a hook factory gets in the worker process: the worker's identity, memory and plan."""

    rank: int
    world_size: int
    kv: torch.Tensor
    """The worker's engine KV memory: one flat ``uint8`` tensor of ``layout.engine_bytes``."""
    layout: TransferLayout
    """Where each offloaded group's pages sit in ``kv`` (per layer: engine offset, block stride, page bytes)."""
    config: OffloadingConfig
    options: HookOptions
    tiers: TierWorker | None = None
    """The worker's tier IO (None without secondary tiers): a hook may read its figures, never submit jobs."""


@runtime_checkable
class WorkerHook(Protocol):
    """Application code called by the worker process at defined points of every step (module docstring)."""

    def before_step(self, plan: StepPlan, attachments: Sequence[memoryview]) -> None:
        """A plan arrived with these extra frames; the worker has not started its transfers yet."""

    def after_step(self, plan: StepPlan, report: WorkerReport) -> Sequence[bytes]:
        """The step's loads are done and reported (the forward pass); returns extra reply payloads."""

    def finish(self, report: WorkerReport) -> Sequence[bytes]:
        """The worker drained on Shutdown; returns extra payloads sent with the final report."""

    def close(self) -> None:
        """The worker is ending: release what the hook holds."""


class WorkerHookFactory(Protocol):
    """Builds the hook of one worker process (a class whose ``__init__`` takes the context qualifies)."""

    def __call__(self, context: WorkerContext, /) -> WorkerHook: ...


def load_hook(path: str) -> WorkerHookFactory:
    """Import the factory named by ``path`` (``"pkg.mod:Name"`` or ``"pkg.mod.Name"``); ConfigError if it cannot.

    Raises ConfigError naming ``hook=path`` when the module cannot be imported, has no such attribute, or the
    attribute is not callable.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"hook={path!r} must be an importable dotted path such as 'package.module:Factory'")
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"hook={path!r} must name a module and an attribute ('package.module:Factory')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"hook={path!r}: cannot import module {module_name!r} ({exc})") from exc
    factory: object = module
    for part in attr.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            raise ConfigError(f"hook={path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(factory):
        raise ConfigError(f"hook={path!r} names a {type(factory).__name__}, not a callable factory")
    return factory  # a callable of the documented shape; what it builds is checked by make_hook


def encode_hook_options(options: HookOptions | None) -> str | None:
    """The options as JSON text for the WorkerSpec; ConfigError when they are not JSON-safe."""
    if options is None:
        return None
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(f"hook_options={options!r} must be a mapping with string keys")
    try:
        return msgspec.json.encode(dict(options)).decode()
    except (TypeError, msgspec.EncodeError) as exc:
        raise ConfigError(f"hook_options={options!r} are not JSON-safe ({exc})") from exc


def make_hook(path: str, context: WorkerContext) -> WorkerHook:
    """Import the factory at ``path``, build the hook and check it has every hook method (ConfigError if not)."""
    hook = load_hook(path)(context)
    methods = ("before_step", "after_step", "finish", "close")
    missing = [name for name in methods if not callable(getattr(hook, name, None))]
    if missing:
        raise ConfigError(f"hook={path!r} built a {type(hook).__name__} without {', '.join(missing)}")
    return hook


def decode_hook_options(text: str | None) -> dict[str, object]:
    """The options a WorkerSpec carries (``{}`` when there are none)."""
    if text is None:
        return {}
    return msgspec.json.decode(text, type=dict[str, object])
