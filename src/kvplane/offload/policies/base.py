"""The eviction policy plug-in point: which READY chunks of a tier to give up first.

:meth:`EvictionPolicy.select_victims` changes nothing, so eviction is all or nothing. How the
manager calls a policy: docs/offload.md.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import Protocol, runtime_checkable

from kvplane.ids import ChunkKey


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders the resident chunks of one tier for eviction (see the module docstring)."""

    name: str

    def insert(self, key: ChunkKey) -> None:
        """``key`` became resident (its store completed)."""
        ...

    def access(self, key: ChunkKey) -> None:
        """``key`` was hit; ignored when it is not resident."""
        ...

    def select_victims(
        self, n: int, evictable: Callable[[ChunkKey], bool]
    ) -> list[ChunkKey] | None:
        """``n`` resident keys to evict, first victim first, or ``None``; changes nothing."""
        ...

    def evict(self, key: ChunkKey) -> None:
        """``key`` was evicted (history-keeping policies remember it)."""
        ...

    def remove(self, key: ChunkKey) -> None:
        """``key`` left the tier for another reason; forget it entirely."""
        ...

    def order(self) -> list[ChunkKey]:
        """Resident keys in the order :meth:`select_victims` would take them if all evictable."""
        ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def check_integrity(self, resident: Set[ChunkKey]) -> None:
        """Raise ``IllegalTransitionError`` unless the policy's residents equal ``resident``."""
        ...
