"""Admission filter: store a chunk only from its ``min_lookups``-th lookup.

Counts live in a bounded LRU map. Owned by one :class:`~kvplane.offload.manager.OffloadManager`;
not thread-safe. See docs/offload.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvplane.ids import ChunkKey
from kvplane.validators import require_int


class AdmissionFilter:
    """Counts lookups per chunk key; :meth:`admits` is true from the ``min_lookups``-th one."""

    def __init__(self, min_lookups: int = 1, capacity: int = 1 << 16) -> None:
        self.min_lookups = require_int("AdmissionFilter.min_lookups", min_lookups, min=0)
        self.capacity = require_int("AdmissionFilter.capacity", capacity, min=1)
        self._counts: OrderedDict[ChunkKey, int] = OrderedDict()

    def record(self, keys: Iterable[ChunkKey]) -> None:
        """Count one lookup of each key (the most recent keys are kept when over capacity)."""
        if self.min_lookups == 0:
            return
        counts = self._counts
        for key in keys:
            counts[key] = counts.pop(key, 0) + 1
        while len(counts) > self.capacity:
            counts.popitem(last=False)

    def lookups(self, key: ChunkKey) -> int:
        return self._counts.get(key, 0)

    def admits(self, key: ChunkKey) -> bool:
        return self.min_lookups == 0 or self._counts.get(key, 0) >= self.min_lookups

    def __len__(self) -> int:
        return len(self._counts)
