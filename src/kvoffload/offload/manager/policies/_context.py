"""A request's context as the manager and its cache policy see it (vLLM 0.33's ``ReqContext``, scheduler side).

It carries each of the request's offload keys' end-token position (the connector records ``(i + 1) x
tokens_per_chunk`` for chunk ``i`` as it derives the key) and a scratch space a policy keeps per-request state in
(keyed by the state's type). Positions let a policy recover a request's prefix order however its stores arrive:
LRU ranks a request's chunks so that its tail goes before its head, and orders the keys it refreshes when the
request finishes by position.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from kvoffload.offload.keys import OffloadKey

__all__ = ["RequestContext", "order_request_keys"]

_T = TypeVar("_T")


class RequestContext:
    """One request's offload-key positions and per-request policy state (vLLM ``ReqContext``).

    ``set_offload_key_position(key, end_token)`` records where the chunk of ``key`` ends in the request's tokens;
    ``set_state(value)`` / ``get_state(cls)`` keep one value per type for whoever needs request-scoped state
    (vLLM's LRU keeps the request's rank there).
    """

    __slots__ = ("_positions", "_state", "req_id")

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        self._positions: dict[OffloadKey, int] = {}
        self._state: dict[type, object] = {}

    def __repr__(self) -> str:
        return f"RequestContext({self.req_id!r}, {len(self._positions)} key positions)"

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        """Record that the chunk of ``key`` ends at token ``end_token`` of this request."""
        self._positions[key] = end_token

    def set_offload_key_positions(self, positions: Mapping[OffloadKey, int] | Iterable[tuple[OffloadKey, int]]) -> None:
        """Record several ``key -> end_token`` positions at once."""
        self._positions.update(positions)

    @property
    def positions(self) -> Mapping[OffloadKey, int]:
        """Every recorded ``key -> end_token`` position (read-only; for policies that read many at once)."""
        return self._positions

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        """The end-token position recorded for ``key``, or None."""
        return self._positions.get(key)

    def set_state(self, value: object) -> None:
        """Keep ``value`` as this request's state of type ``type(value)`` (replacing the previous one)."""
        self._state[type(value)] = value

    def get_state(self, cls: type[_T]) -> _T | None:
        """This request's state of type ``cls``, or None."""
        value = self._state.get(cls)
        return value if isinstance(value, cls) else None


def order_request_keys(key_groups: Sequence[Sequence[OffloadKey]], ctx: RequestContext | None) -> list[OffloadKey]:
    """One head-to-tail order across a request's key groups (vLLM ``order_request_keys``).

    The groups are flattened in order; when every key has a recorded position (and none is listed twice), the
    keys are stably sorted by it, so equal positions keep the group order.
    """
    keys = [key for group in key_groups for key in group]
    if ctx is None or not keys:
        return keys
    positions = ctx._positions
    if len(keys) == len(set(keys)) and all(map(positions.__contains__, keys)):  # vLLM: a repeat leaves the order
        keys.sort(key=positions.__getitem__)
    return keys
