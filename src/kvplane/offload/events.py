"""The events of a :class:`~kvplane.offload.cascade.TierCascade`: a submitted load's ticket and
what :meth:`~kvplane.offload.cascade.TierCascade.poll` turns finished jobs into. Plain frozen
data."""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.ids import ChunkKey, JobId


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
