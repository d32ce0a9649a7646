"""Why the translator decided what it did: the decision sink, its recorder, and the :class:`Explanation`.

Every rule of the translator reports each value it settles on to a :class:`DecisionSink` as
``(topic, value, reason)``. ``build_offloading_config`` passes :func:`discard`, so the plain path keeps nothing;
``explain_offloading_config`` passes a :class:`Recorder` and returns the ordered decisions with the outcome, so
"why is ``replicated_layout`` False?" is answered by the same code that computed it, never by a second copy of
the rules. :func:`record_gates` reports a conjunction of named conditions gate by gate.

vLLM fails some rules with a bare ``assert`` (an AssertionError without a message); :func:`bare_assertion`
builds our equivalent (an empty message like vLLM's, the detail in a PEP 678 note) and :func:`describe_error`
prints the note where the message is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from kvoffload._generated.types import OffloadingConfig
from kvoffload.errors import ConfigError, OffloadingConfigError

__all__ = [
    "Decision",
    "DecisionSink",
    "DecisionValue",
    "Explanation",
    "Recorder",
    "bare_assertion",
    "describe_error",
    "discard",
    "record_gates",
]

DecisionValue: TypeAlias = str | int | bool | tuple[int, ...] | tuple[str, ...] | None
"""The value a recorded decision settled on: a number, flag, name, or a tuple of ids or names."""


class DecisionSink(Protocol):
    """Receives ``(topic, value, reason)`` for each decision the translator takes (see ``explain``)."""

    def __call__(self, topic: str, value: DecisionValue, reason: str, /) -> None: ...


def discard(topic: str, value: DecisionValue, reason: str, /) -> None:
    """The default sink: decisions are computed on the same path but not kept."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One step of the translation: what ``topic`` settled on (``value``) and why (``reason``)."""

    topic: str
    value: DecisionValue
    reason: str

    def render(self) -> str:
        """One line ``topic = value  # reason`` for people."""
        return f"{self.topic} = {_render_value(self.value)}  # {self.reason}"


@dataclass(frozen=True, slots=True)
class Explanation:
    """The outcome of a translation plus the ordered decisions that produced it.

    Exactly one of ``config`` and ``error`` is set. ``decisions`` stops at the failing rule when ``error`` is
    set, so the last decisions explain the failure.
    """

    config: OffloadingConfig | None
    error: ConfigError | None
    decisions: tuple[Decision, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Whether the translation succeeded."""
        return self.config is not None

    def find(self, topic: str) -> Decision:
        """The (last) decision recorded under ``topic``; KeyError when there is none."""
        for decision in reversed(self.decisions):
            if decision.topic == topic:
                return decision
        raise KeyError(topic)

    def topics(self, prefix: str) -> tuple[Decision, ...]:
        """Every decision whose topic starts with ``prefix`` (e.g. ``"replicated_layout."`` for its gates)."""
        return tuple(d for d in self.decisions if d.topic.startswith(prefix))

    def failing(self, prefix: str) -> tuple[Decision, ...]:
        """The gates under ``prefix`` that evaluated to False: the answer to "why is X False?"."""
        return tuple(d for d in self.topics(prefix) if d.value is False)

    def render(self) -> str:
        """A multi-line, human-readable report: one decision per line, then the outcome."""
        lines = [d.render() for d in self.decisions]
        if self.error is not None:
            lines.append(f"error ({self.error_type}): {describe_error(self.error)}")
        return "\n".join(lines)

    @property
    def error_type(self) -> str | None:
        """The exception vLLM raises for the same input, or ``ConfigError`` for other invalid input."""
        if self.error is None:
            return None
        if isinstance(self.error, OffloadingConfigError):
            return self.error.vllm_exception
        return type(self.error).__name__


class Recorder:
    """Collects decisions in order; passed as the translator's :class:`DecisionSink` by explain."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    def __call__(self, topic: str, value: DecisionValue, reason: str, /) -> None:
        self.decisions.append(Decision(topic, value, reason))


def record_gates(note: DecisionSink, prefix: str, gates: list[tuple[str, bool, str]], *, topic: str, what: str) -> bool:
    """Record each named gate as ``prefix.name``, then ``topic`` with their conjunction and the names of the
    gates that failed; every gate is evaluated (none has side effects), so all failures are reported."""
    for name, passed, reason in gates:
        note(f"{prefix}.{name}", passed, reason)
    failed = [name for name, passed, _ in gates if not passed]
    verdict = "all gates pass" if not failed else "failed gates: " + ", ".join(failed)
    note(topic, not failed, f"{what}: {verdict}")
    return not failed


def bare_assertion(detail: str) -> OffloadingConfigError:
    """vLLM's bare ``assert``: AssertionError with an empty message; our detail travels as a PEP 678 note."""
    err = OffloadingConfigError("", vllm_exception="AssertionError")
    err.add_note(detail)
    return err


def describe_error(err: BaseException) -> str:
    """The error's message, or its PEP 678 notes when the message is empty (vLLM's bare asserts)."""
    message = str(err)
    notes = getattr(err, "__notes__", None)
    if not message and isinstance(notes, list) and notes:
        name = err.vllm_exception if isinstance(err, OffloadingConfigError) else type(err).__name__
        return f"{'; '.join(str(n) for n in notes)} (vLLM: bare {name}, no message)"
    return message


def _render_value(value: DecisionValue) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else str(value)
