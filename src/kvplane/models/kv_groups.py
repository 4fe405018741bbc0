"""KV cache groups: a model's layers partitioned by sliding window, one paged pool per group.

Owns the partition value (:class:`KVGroups`) and each group's layout (the model's layout over
the group's layers only). Owns no tensors and no blocks: ``PagedKVCache``/``GroupedKVCache``
hold the pools, a ``BlockPool`` and ``BlockTable`` per group hold the blocks. See
docs/attention.md, "KV cache groups".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvplane.errors import InvalidArgumentError
from kvplane.layout import KVLayout, check_layer_ids
from kvplane.validators import require_int


@dataclass(frozen=True, slots=True)
class KVGroup:
    """The layers (ascending ids) that share one sliding ``window`` (``None``: full attention);
    ``InvalidArgumentError`` for a bad window or bad, duplicate or unordered layer ids."""

    window: int | None
    layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.window is not None:
            require_int("KVGroup.window", self.window, min=1)
        ids = check_layer_ids("KVGroup.layer_ids", self.layer_ids, error=InvalidArgumentError)
        if list(ids) != sorted(ids):
            raise InvalidArgumentError(f"KVGroup.layer_ids must ascend: {ids}")
        object.__setattr__(self, "layer_ids", ids)


@dataclass(frozen=True, slots=True)
class KVGroups:
    """A partition of a model's layers by window: groups ordered by first layer, distinct
    windows, every layer in exactly one group (``InvalidArgumentError`` otherwise). One group
    when every layer has the same window: then a model runs one pool, as always."""

    groups: tuple[KVGroup, ...]
    _group_of: dict[int, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        groups = self.groups
        if not isinstance(groups, tuple) or not groups:
            raise InvalidArgumentError(f"KVGroups needs a non-empty tuple of groups: {groups!r}")
        if not all(isinstance(g, KVGroup) for g in groups):
            raise InvalidArgumentError(f"KVGroups holds KVGroup values: {groups!r}")
        windows = [g.window for g in groups]
        if len(set(windows)) != len(windows):
            raise InvalidArgumentError(f"two KV cache groups share a window: {windows}")
        firsts = [g.layer_ids[0] for g in groups]
        if firsts != sorted(firsts):
            raise InvalidArgumentError(f"KV cache groups must be ordered by first layer: {groups}")
        index = {layer: i for i, g in enumerate(groups) for layer in g.layer_ids}
        if len(index) != sum(len(g.layer_ids) for g in groups):
            raise InvalidArgumentError(f"a layer is in two KV cache groups: {groups}")
        object.__setattr__(self, "_group_of", index)

    @classmethod
    def from_windows(cls, windows: Sequence[int | None] | Mapping[int, int | None]) -> KVGroups:
        """Group layers by window: ``windows[i]`` is layer ``i``'s (a sequence), or a map from
        layer id to window (a pipeline stage's subset); groups in ascending layer order."""
        items = sorted(windows.items() if isinstance(windows, Mapping) else enumerate(windows))
        if not items:
            raise InvalidArgumentError("a model has at least one layer")
        by_window: dict[int | None, list[int]] = {}
        for layer, window in items:
            by_window.setdefault(window, []).append(layer)
        return cls(tuple(KVGroup(w, tuple(ids)) for w, ids in by_window.items()))

    @classmethod
    def of_layout(cls, layout: KVLayout) -> KVGroups:
        """The groups of ``layout``'s layers by :meth:`KVLayout.window_of`."""
        return cls.from_windows({i: layout.window_of(i) for i in layout.layer_ids})

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[KVGroup]:
        return iter(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def single(self) -> bool:
        """One group: every layer has the same window (the model runs one pool)."""
        return len(self.groups) == 1

    def group_of(self, layer_id: int) -> int:
        """Index of the group holding ``layer_id`` (``InvalidArgumentError`` for none)."""
        try:
            return self._group_of[layer_id]
        except KeyError:
            raise InvalidArgumentError(f"layer {layer_id} is in no KV cache group") from None

    def layouts(
        self, layout: KVLayout, num_blocks: Sequence[int] | None = None
    ) -> tuple[KVLayout, ...]:
        """``layout`` over each group's layers (the model's window map kept, so each group's
        ``window_start`` is its window's), of ``num_blocks[g]`` blocks (default: ``layout``'s).
        ``InvalidArgumentError`` unless the groups are ``layout``'s (:meth:`of_layout`)."""
        if KVGroups.of_layout(layout) != self:
            raise InvalidArgumentError(
                f"KV cache groups {self.groups} are not those of layout {layout.describe()}"
            )
        sizes = [layout.num_blocks] * len(self) if num_blocks is None else list(num_blocks)
        if len(sizes) != len(self):
            raise InvalidArgumentError(f"{len(self)} groups but {len(sizes)} block counts")
        return tuple(
            dataclasses.replace(
                layout, layer_ids=g.layer_ids, num_blocks=require_int(f"group {i} blocks", n, min=1)
            )
            for i, (g, n) in enumerate(zip(self.groups, sizes, strict=True))
        )
