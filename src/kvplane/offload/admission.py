"""Admission filter: store a chunk only after it was looked up ``min_lookups`` times.

A one-hit-wonder chunk (looked up once, never again) costs a store and evicts something useful;
counting lookups and admitting a chunk to a tier only from its N-th lookup keeps them out. The
counts live in a bounded LRU map (``capacity`` keys), so memory does not grow with traffic: a key
that falls out simply starts counting again. ``min_lookups == 0`` admits everything; the default
1 admits every chunk the scheduler asked about (which is what a prefix-cache lookup does before a
store), so it filters only stores of chunks nobody looked up.

Not thread-safe; owned by one :class:`~kvplane.offload.manager.OffloadManager`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey


class AdmissionFilter:
    """Counts lookups per chunk key; :meth:`admits` is true from the ``min_lookups``-th one."""

    def __init__(self, min_lookups: int = 1, capacity: int = 1 << 16) -> None:
        if isinstance(min_lookups, bool) or not isinstance(min_lookups, int) or min_lookups < 0:
            raise InvalidArgumentError(
                f"AdmissionFilter.min_lookups must be a non-negative int, got {min_lookups!r}"
            )
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise InvalidArgumentError(
                f"AdmissionFilter.capacity must be a positive int, got {capacity!r}"
            )
        self.min_lookups = min_lookups
        self.capacity = capacity
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
