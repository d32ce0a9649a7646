"""A finished request's keys as vLLM 0.33's ``CPUOffloadingManager`` hands them to the cache policy."""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload.offload.keys import OffloadKey
from kvoffload.offload.manager.policies import RequestContext

__all__ = ["request_key_groups"]


def request_key_groups(keys: Iterable[OffloadKey], ctx: RequestContext) -> tuple[tuple[OffloadKey, ...], ...]:
    """A finished request's keys as vLLM's manager hands them to the policy: one tuple per KV-cache group
    (ascending group id, the id in each key's last 4 bytes), each in the given order (a repeat dropped), sorted
    by recorded position when every key of the group has one."""
    unique = list(dict.fromkeys(keys))
    positions = ctx.positions
    suffixes = {key[-4:] for key in unique}
    if len(suffixes) <= 1:  # one KV-cache group: the common case, in bulk
        if all(map(positions.__contains__, unique)):
            unique.sort(key=positions.__getitem__)
        return (tuple(unique),) if unique else ()
    groups: dict[int, list[OffloadKey]] = {}
    for key in unique:
        groups.setdefault(int.from_bytes(key[-4:], "big"), []).append(key)
    out: list[tuple[OffloadKey, ...]] = []
    for group_id in sorted(groups):
        group = groups[group_id]
        if all(map(positions.__contains__, group)):
            group.sort(key=positions.__getitem__)
        out.append(tuple(group))
    return tuple(out)
