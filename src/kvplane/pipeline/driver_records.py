"""The records the slice driver keeps (:mod:`kvplane.pipeline.driver`): what a request's memory
and a decode peer look like to the planner, a session's plans made ahead, a begun slice, and a
worker's command on its way to the PD loop. Plain mutable records, owned by the driver thread
(a :class:`WorkerCommand` is filled in on the PD loop while that thread waits on it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvplane.ids import SessionId, TokenRange
from kvplane.pd.actions import StartSubmit
from kvplane.pd.events import (
    SubmitSlice,
    TransferRequest,
    TransportDone,
    TransportFailed,
    TransportInDoubt,
)
from kvplane.pipeline.advert import RemotePool
from kvplane.pipeline.shares import Share
from kvplane.pipeline.slicing import LocalPool, PlannedSlice
from kvplane.transfer import PlanRun
from kvplane.transports.base import Peer

Evidence = TransportDone | TransportFailed | TransportInDoubt


@dataclass(frozen=True, slots=True)
class SliceSource:
    """The prefill memory of one request: its pools with block ids (KV, state, tail order), and
    the slice schedule (``(range, is_last)`` per slice id) the prefill will follow, so slices
    can be planned before they are computed; ``share``: this rank's share when it is one of
    several senders of the request (None: the one sender)."""

    request_id: str
    pools: tuple[LocalPool, ...]
    schedule: tuple[tuple[TokenRange, bool], ...] = ()
    share: Share | None = None


@dataclass(frozen=True, slots=True)
class PeerLink:
    """A decode peer as the planner sees it: transport peer and advertised pools."""

    incarnation: int
    peer: Peer
    pools: tuple[RemotePool, ...]


@dataclass(slots=True)
class PlannedSession:
    """What the driver knows of one session: its peer link, the receiver's request (the
    destination) and the plans made ahead, by slice id."""

    link: PeerLink
    request: TransferRequest
    plans: dict[int, PlannedSlice]
    next_plan: int = 0
    begun: int = 0


@dataclass(slots=True)
class SliceJob:
    """One begun slice: its runs (none when it failed before any could start)."""

    act: StartSubmit
    source: SliceSource
    planned: PlannedSlice
    runs: list[PlanRun]
    started: float
    failure: str = ""

    @property
    def done(self) -> bool:
        return all(run.done for run in self.runs)


@dataclass(slots=True)
class WorkerCommand:
    """A worker's ``SubmitSlice``, to send on the PD loop; ``on_result(accepted)`` after."""

    session_id: SessionId
    command: SubmitSlice
    on_result: Callable[[bool], None]
    accepted: bool = False


@dataclass(slots=True)
class SliceBegin:
    """A slice ready to begin: planned, waiting for the PD loop's go-ahead."""

    act: StartSubmit
    source: SliceSource
    planned: PlannedSlice
    allowed: bool = False
