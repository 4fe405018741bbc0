"""ARC eviction (Megiddo & Modha): recency and frequency lists that tune their own balance.

T1/T2 with B1/B2 ghost lists and an adaptive target ``p``. See docs/offload.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Set

from kvplane.errors import IllegalTransitionError, InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.validators import require_int


class ARCPolicy:
    """Adaptive Replacement Cache over the resident chunks of one tier of ``capacity`` slots."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = require_int("ARCPolicy.capacity", capacity, min=1)
        self.p = 0.0
        self._t1: OrderedDict[ChunkKey, None] = OrderedDict()
        self._t2: OrderedDict[ChunkKey, None] = OrderedDict()
        self._b1: OrderedDict[ChunkKey, None] = OrderedDict()
        self._b2: OrderedDict[ChunkKey, None] = OrderedDict()

    # -- inspection (LRU first) --------------------------------------------------------------
    @property
    def t1(self) -> list[ChunkKey]:
        return list(self._t1)

    @property
    def t2(self) -> list[ChunkKey]:
        return list(self._t2)

    @property
    def b1(self) -> list[ChunkKey]:
        return list(self._b1)

    @property
    def b2(self) -> list[ChunkKey]:
        return list(self._b2)

    # -- events --------------------------------------------------------------------------------
    def insert(self, key: ChunkKey) -> None:
        if key in self._t1 or key in self._t2:
            raise InvalidArgumentError(f"arc: chunk {key.hex()} is already resident")
        if key in self._b1:
            self.p = min(float(self.capacity), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def access(self, key: ChunkKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def select_victims(
        self, n: int, evictable: Callable[[ChunkKey], bool]
    ) -> list[ChunkKey] | None:
        out: list[ChunkKey] = []
        if n <= 0:
            return out
        t1_len = len(self._t1)
        it1: Iterator[ChunkKey] = (k for k in self._t1 if evictable(k))
        it2: Iterator[ChunkKey] = (k for k in self._t2 if evictable(k))
        c1, c2 = next(it1, None), next(it2, None)
        while len(out) < n:
            if c1 is not None and (t1_len > self.p or c2 is None):
                out.append(c1)
                t1_len -= 1
                c1 = next(it1, None)
            elif c2 is not None:
                out.append(c2)
                c2 = next(it2, None)
            else:
                return None
        return out

    def evict(self, key: ChunkKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            raise InvalidArgumentError(f"arc: chunk {key.hex()} is not resident")
        self._trim_ghosts()

    def remove(self, key: ChunkKey) -> None:
        if key in self._t1:
            del self._t1[key]
        elif key in self._t2:
            del self._t2[key]
        else:
            raise InvalidArgumentError(f"arc: chunk {key.hex()} is not resident")

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        total = len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2)
        while self._b2 and total > 2 * self.capacity:
            self._b2.popitem(last=False)
            total -= 1

    # -- views ---------------------------------------------------------------------------------
    def order(self) -> list[ChunkKey]:
        return self.select_victims(len(self), lambda _k: True) or []

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def check_integrity(self, resident: Set[ChunkKey]) -> None:
        t1, t2, b1, b2 = set(self._t1), set(self._t2), set(self._b1), set(self._b2)
        if t1 & t2 or (t1 | t2) & (b1 | b2) or b1 & b2:
            raise IllegalTransitionError("arc: a key is in two lists")
        if t1 | t2 != set(resident):
            raise IllegalTransitionError("arc: T1 + T2 differ from the tier's resident chunks")
        if not 0.0 <= self.p <= self.capacity:
            raise IllegalTransitionError(f"arc: p={self.p} outside [0, {self.capacity}]")
        if len(t1) + len(b1) > self.capacity and b1:
            raise IllegalTransitionError("arc: |T1| + |B1| exceeds capacity")
        if len(t1) + len(t2) + len(b1) + len(b2) > 2 * self.capacity and b2:
            raise IllegalTransitionError("arc: the four lists exceed 2 * capacity")
