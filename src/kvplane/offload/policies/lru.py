"""LRU eviction: the least recently inserted-or-hit resident chunk goes first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Set

from kvplane.errors import IllegalTransitionError, InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.validators import require_int


class LRUPolicy:
    """An ordered map from least to most recently used; O(1) insert/access/evict."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = require_int("LRUPolicy.capacity", capacity, min=1)
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey) -> None:
        if key in self._order:
            raise InvalidArgumentError(f"lru: chunk {key.hex()} is already resident")
        self._order[key] = None

    def access(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def select_victims(
        self, n: int, evictable: Callable[[ChunkKey], bool]
    ) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        out: list[ChunkKey] = []
        for key in self._order:
            if evictable(key):
                out.append(key)
                if len(out) == n:
                    return out
        return None

    def evict(self, key: ChunkKey) -> None:
        self.remove(key)

    def remove(self, key: ChunkKey) -> None:
        if key not in self._order:
            raise InvalidArgumentError(f"lru: chunk {key.hex()} is not resident")
        del self._order[key]

    def order(self) -> list[ChunkKey]:
        return list(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def check_integrity(self, resident: Set[ChunkKey]) -> None:
        if set(self._order) != set(resident):
            extra = set(self._order) - set(resident)
            missing = set(resident) - set(self._order)
            raise IllegalTransitionError(
                f"lru: {len(extra)} tracked but not resident, {len(missing)} resident but untracked"
            )
