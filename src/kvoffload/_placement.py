"""Where pages live: the engine's ``KVCacheTensor`` placements turned into a transfer layout of copy segments.

:func:`build_transfer_layout` turns the engine's ``KVCacheTensor`` entries (layer ``l`` of an entry has its page
for block ``b`` at ``offset + l*layer_stride + b*block_stride`` of ONE flat backing allocation) plus the
offloaded groups' layers into a :class:`TransferLayout`: where each page is in engine memory and where it goes
inside the host per-block slot (``worker_kv_bytes_per_block`` bytes). "Transfer layout" names only this
page map; the engine's own page order (NHD/HND) is its ``kv_cache_layout``.

Pure integer math, importable without torch (numpy loads only for :attr:`GroupLayout.segment_table`): the
workers build their layout here, and :func:`kvoffload.translate.validate_runnable` runs the same checks on the
scheduler side before any worker starts. ``kvoffload.offload.worker.copy`` re-exports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

from kvoffload._ints import check_int
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from kvoffload._generated import KVCacheConfig, OffloadingConfig

__all__ = [
    "CopySegment",
    "GroupLayout",
    "KVCacheTensorLike",
    "LayerPlacement",
    "TransferLayout",
    "build_transfer_layout",
    "transfer_layout_from_config",
]


class KVCacheTensorLike(Protocol):
    """The fields of a ``KVCacheTensor`` that :func:`build_transfer_layout` reads (the schema type has them all)."""

    @property
    def size(self) -> int: ...

    @property
    def layers(self) -> Sequence[str]: ...

    @property
    def layer_stride(self) -> int: ...

    @property
    def block_stride(self) -> int: ...

    @property
    def offset(self) -> int: ...


@dataclass(frozen=True)
class LayerPlacement:
    """One offloaded layer: engine bytes of block ``b`` start at ``engine_offset + b*block_stride``;
    its page sits at ``host_offset`` inside the host per-block slot."""

    name: str
    page_bytes: int
    engine_offset: int
    block_stride: int
    host_offset: int


@dataclass(frozen=True)
class CopySegment:
    """Consecutive layers whose pages are adjacent both in engine memory and in the host slot: one copy."""

    engine_offset: int
    block_stride: int
    length: int
    host_offset: int


@dataclass(frozen=True)
class GroupLayout:
    """Placement of one offloaded group: its layers (given order) and the segments copied per block."""

    layers: tuple[LayerPlacement, ...]
    segments: tuple[CopySegment, ...]
    bytes_per_block: int

    @cached_property
    def segment_table(self) -> np.ndarray:
        """The segments as an int64 ``(n, 4)`` array of ``(engine_offset, block_stride, length, host_offset)``
        (built once: job planning does array math on it)."""
        import numpy as np

        rows = [(s.engine_offset, s.block_stride, s.length, s.host_offset) for s in self.segments]
        return np.array(rows, dtype=np.int64).reshape(-1, 4)


@dataclass(frozen=True)
class TransferLayout:
    """Per-group page placement for a worker whose KV memory is one flat allocation of ``engine_bytes``."""

    groups: tuple[GroupLayout, ...]
    num_blocks: int
    worker_kv_bytes_per_block: int
    engine_bytes: int


def build_transfer_layout(
    placements: Sequence[KVCacheTensorLike],
    groups: Sequence[Sequence[tuple[str, int]]],
    *,
    num_blocks: int,
    worker_kv_bytes_per_block: int,
) -> TransferLayout:
    """Place every offloaded layer's page in engine memory and in the host per-block slot.

    ``groups[g]`` lists ``(layer_name, page_bytes)`` of offloaded group ``g`` (``page_bytes`` unpadded).
    Host placement packs a group's pages in engine-address order, so pages adjacent in engine memory stay
    adjacent in the slot and copy as one run (a block-major block is one copy). Raises :class:`ConfigError`
    naming the layer and the numbers when a layer is unknown, pages overlap, a page leaves the allocation
    or the group does not fit in ``worker_kv_bytes_per_block``.
    """
    check_int("num_blocks", num_blocks, value_first=True)
    check_int("worker_kv_bytes_per_block", worker_kv_bytes_per_block, value_first=True)
    where: dict[str, tuple[int, int, int, int]] = {}  # name -> (engine offset, block stride, size, tensor)
    for t, p in enumerate(placements):
        for field in ("size", "layer_stride", "block_stride", "offset"):
            check_int(f"kv_cache_tensors[{t}].{field}", getattr(p, field), value_first=True)
        for index, name in enumerate(p.layers):
            if name in where:
                first = where[name][3]
                raise ConfigError(f"layer {name!r} is placed by kv_cache_tensors[{first}] and [{t}]")
            where[name] = (p.offset + index * p.layer_stride, p.block_stride, p.size, t)
    engine_bytes = max((p.size for p in placements), default=0)
    return TransferLayout(
        groups=tuple(
            _place_group(g, layers, where, num_blocks, worker_kv_bytes_per_block) for g, layers in enumerate(groups)
        ),
        num_blocks=num_blocks,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        engine_bytes=engine_bytes,
    )


def transfer_layout_from_config(kv_cache_config: KVCacheConfig, config: OffloadingConfig) -> TransferLayout:
    """:func:`build_transfer_layout` for a worker's ``KVCacheConfig`` and its offloading plan.

    Placements are the engine-resident ``kv_cache_tensors``; each offloaded layer copies its unpadded page
    (``translate.real_page_size_bytes`` of its own spec, a ``uniform_type`` wrapper's entry for that layer).
    """
    from kvoffload._generated import UniformTypeKVCacheSpecs
    from kvoffload.translate import real_page_size_bytes

    groups: list[list[tuple[str, int]]] = []
    for group in config.groups:
        if not 0 <= group.group_id < len(kv_cache_config.kv_cache_groups):
            raise ConfigError(
                f"offloading group_id={group.group_id} is not one of the "
                f"{len(kv_cache_config.kv_cache_groups)} kv_cache_groups"
            )
        spec = kv_cache_config.kv_cache_groups[group.group_id].kv_cache_spec
        layers: list[tuple[str, int]] = []
        for name in group.layer_names:
            layer_spec = spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                if name not in spec.kv_cache_specs:
                    raise ConfigError(f"group {group.group_id} layer {name!r} has no entry in kv_cache_specs")
                layer_spec = spec.kv_cache_specs[name]
            layers.append((name, real_page_size_bytes(layer_spec)))
        groups.append(layers)
    return build_transfer_layout(
        [t for t in kv_cache_config.kv_cache_tensors if not t.host_resident],
        groups,
        num_blocks=kv_cache_config.num_blocks,
        worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
    )


def _place_group(
    g: int,
    layers: Sequence[tuple[str, int]],
    where: dict[str, tuple[int, int, int, int]],
    num_blocks: int,
    wkb: int,
) -> GroupLayout:
    seen: set[str] = set()
    items: list[tuple[int, int, int, str, int]] = []  # (block stride, engine offset, index, name, page)
    for i, (name, page) in enumerate(layers):
        if name in seen:
            raise ConfigError(f"group {g} lists layer {name!r} twice")
        seen.add(name)
        if name not in where:
            raise ConfigError(f"group {g} layer {name!r} is in no kv_cache_tensors placement")
        if page <= 0:
            raise ConfigError(f"group {g} layer {name!r}: page_bytes={page} must be > 0")
        engine_offset, stride, size, t = where[name]
        if num_blocks > 1 and stride < page:
            raise ConfigError(
                f"layer {name!r}: block_stride={stride} of kv_cache_tensors[{t}] is smaller than its "
                f"page_bytes={page}, so the pages of consecutive blocks overlap"
            )
        end = engine_offset + max(num_blocks - 1, 0) * stride + page
        if num_blocks > 0 and end > size:
            raise ConfigError(
                f"layer {name!r}: the page of block {num_blocks - 1} ends at byte {end}, beyond "
                f"kv_cache_tensors[{t}].size={size} (num_blocks={num_blocks})"
            )
        items.append((stride, engine_offset, i, name, page))
    total = sum(item[4] for item in items)
    if total > wkb:
        raise ConfigError(
            f"group {g}: its pages take {total} bytes per block, more than the host slot of "
            f"worker_kv_bytes_per_block={wkb}"
        )
    placed: dict[int, LayerPlacement] = {}
    segments: list[CopySegment] = []
    host = 0
    for stride, engine_offset, i, name, page in sorted(items):
        last = segments[-1] if segments else None
        if last is not None and last.block_stride == stride:
            last_end = last.engine_offset + last.length
            if last_end > engine_offset:
                raise ConfigError(f"group {g} layer {name!r}: its page overlaps the previous layer's page")
            if last_end == engine_offset:
                segments[-1] = CopySegment(last.engine_offset, stride, last.length + page, last.host_offset)
            else:
                segments.append(CopySegment(engine_offset, stride, page, host))
        else:
            segments.append(CopySegment(engine_offset, stride, page, host))
        placed[i] = LayerPlacement(name, page, engine_offset, stride, host)
        host += page
    return GroupLayout(
        layers=tuple(placed[i] for i in range(len(items))),
        segments=tuple(segments),
        bytes_per_block=total,
    )
