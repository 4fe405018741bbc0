"""The eviction policy plug-in point: which READY chunks of a tier to give up first.

A policy tracks the *resident* chunks of one tier (READY or LOADING in its slot table) and
orders them for eviction. The :class:`~kvplane.offload.manager.OffloadManager` calls it as
follows, and never otherwise:

- :meth:`EvictionPolicy.insert` when a store completes (the chunk became READY);
- :meth:`EvictionPolicy.access` on a hit (lookup, load or touch of a resident chunk);
- :meth:`EvictionPolicy.select_victims` to *choose* ``n`` victims among resident chunks that
  ``evictable`` accepts (not pinned, not an input of the store asking). It must not change
  anything, so a store that cannot find enough victims leaves the policy as it was;
- :meth:`EvictionPolicy.evict` for each chosen victim (a policy with history, like ARC, keeps
  a ghost entry), and :meth:`EvictionPolicy.remove` when a chunk leaves for another reason
  (failed or corrupt), which forgets it.

Unknown keys in ``access`` are ignored (a hit on a chunk of another tier); ``insert`` of a
resident key, ``evict``/``remove`` of a non-resident key raise ``InvalidArgumentError``.
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
