"""The events of a :class:`~kvplane.offload.cascade.TierCascade`: a submitted load's ticket and
what :meth:`~kvplane.offload.cascade.TierCascade.poll` turns finished jobs into; and the one
home of "a chunk was stored in / removed from a tier": :class:`TierChange`, reported by
:class:`WatchedPolicy` from the manager's own calls to its eviction policy. Plain frozen data
and one forwarding wrapper; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass

from kvplane.ids import ChunkKey, JobId
from kvplane.offload.policies.base import EvictionPolicy


@dataclass(frozen=True, slots=True)
class LoadTicket:
    """A submitted load: ``keys`` (the loadable prefix of the request) and where each is from."""

    ticket_id: int
    keys: tuple[ChunkKey, ...]
    sources: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StoreDone:
    """A ``device_to_host`` job finished; its device blocks are no longer fenced."""

    job_id: JobId
    keys: tuple[ChunkKey, ...]
    ok: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class CascadeDone:
    """A ``host_to_<tier>`` job finished."""

    job_id: JobId
    tier: str
    keys: tuple[ChunkKey, ...]
    ok: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class LoadDone:
    """Every chunk of a :class:`LoadTicket` is in its device blocks (``ok``) or failed."""

    ticket_id: int
    keys: tuple[ChunkKey, ...]
    ok: tuple[bool, ...]

    @property
    def usable(self) -> int:
        """Leading chunks whose KV is in place: a prefix is usable only up to its first gap."""
        return next((i for i, f in enumerate(self.ok) if not f), len(self.ok))


Event = StoreDone | CascadeDone | LoadDone


@dataclass(frozen=True, slots=True)
class TierChange:
    """Chunk ``key`` became readable in tier ``tier`` (``stored``: its store completed, or a
    restart adopted it) or left it (evicted, or dropped after a bad read)."""

    tier: str
    key: ChunkKey
    stored: bool


class WatchedPolicy:
    """An :class:`EvictionPolicy` that forwards every call to ``inner`` and reports residency
    changes to ``sink`` (on the manager's thread, after ``inner`` took them). The manager tells
    its policy exactly when a chunk becomes resident (``insert``) or leaves (``evict``,
    ``remove``): the policy's residents are the tier's READY and LOADING chunks, which its
    ``check_integrity`` proves, so these calls are the tier bookkeeping's own hooks."""

    def __init__(self, inner: EvictionPolicy, tier: str, sink: Callable[[TierChange], None]):
        self.inner = inner
        self.name = inner.name
        self.tier = tier
        self._sink = sink

    def insert(self, key: ChunkKey) -> None:
        self.inner.insert(key)
        self._sink(TierChange(self.tier, key, True))

    def access(self, key: ChunkKey) -> None:
        self.inner.access(key)

    def select_victims(
        self, n: int, evictable: Callable[[ChunkKey], bool]
    ) -> list[ChunkKey] | None:
        return self.inner.select_victims(n, evictable)

    def evict(self, key: ChunkKey) -> None:
        self.inner.evict(key)
        self._sink(TierChange(self.tier, key, False))

    def remove(self, key: ChunkKey) -> None:
        self.inner.remove(key)
        self._sink(TierChange(self.tier, key, False))

    def order(self) -> list[ChunkKey]:
        return self.inner.order()

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def check_integrity(self, resident: Set[ChunkKey]) -> None:
        self.inner.check_integrity(resident)
