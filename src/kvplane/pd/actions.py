"""What a sans-IO session asks its driver to do: the protocol's only outputs.

A session never sends, sleeps or frees memory itself. Each call returns a list of actions, in
order: ``Transmit`` a wire event to the peer, ``DestinationKnown`` once the receiver has named
where the slices go (a hint: plans may be made from now on), ``StartSubmit`` a slice on the
transport, ``ArmTimer`` for a later ``Timeout``, ``Release`` a unit of memory (exactly once per
ledger entry) and ``Finished`` once when the session reaches its terminal state.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.ids import PeerId, SessionId, SliceId
from kvplane.pd.events import AnyWireEvent, TimerKind, TransferRequest
from kvplane.pd.states import Ownership, Role, SessionState


@dataclass(frozen=True, slots=True)
class Transmit:
    """Send ``event`` to ``peer_id`` (best effort: the protocol retransmits what matters)."""

    peer_id: PeerId
    event: AnyWireEvent


@dataclass(frozen=True, slots=True)
class DestinationKnown:
    """Sender: the receiver's ``request`` names the destination (emitted once per session, before
    any ``StartSubmit``). Nothing may move yet; a driver may plan the request's slices now, so
    that a slice whose step has not ended -- the only slice of a short prompt, say -- starts as
    soon as its ``StartSubmit`` comes. Ignoring it is always correct."""

    session_id: SessionId
    peer_id: PeerId
    request: TransferRequest


@dataclass(frozen=True, slots=True)
class StartSubmit:
    """Sender: slice ``slice_id`` may now be planned and submitted to the transport.

    ``start``/``end`` is the slice's token range clipped to what the receiver lacks
    (``[request.prefix_tokens, request.num_tokens)``); it may be empty (the final slice is sent
    even then). The driver answers with ``SubmitStarted`` then ``SubmitAccepted`` (or
    ``TransportInDoubt`` if submit raised), or with ``SubmitSkipped`` when nothing must move.
    A later action of the same batch (or any event before the driver gets to it) may cancel
    the slice: check ``Participant.submittable`` right before submitting.
    """

    session_id: SessionId
    peer_id: PeerId
    slice_id: SliceId
    is_last: bool
    start: int
    end: int
    request: TransferRequest


@dataclass(frozen=True, slots=True)
class ArmTimer:
    """Deliver ``Timeout(timer, unit)`` to this session after ``delay_s`` seconds."""

    session_id: SessionId
    timer: TimerKind
    unit: int
    delay_s: float


@dataclass(frozen=True, slots=True)
class Release:
    """The session no longer owns ``unit``'s memory (``via`` says which ledger path released it).

    On a receiver whose session succeeded, the destination blocks pass to the request for
    decoding; otherwise the caller frees them.
    """

    session_id: SessionId
    peer_id: PeerId
    role: Role
    unit: int
    via: Ownership
    state: SessionState


@dataclass(frozen=True, slots=True)
class Finished:
    """The session reached its terminal ``state`` (emitted exactly once)."""

    session_id: SessionId
    peer_id: PeerId
    role: Role
    state: SessionState
    reason: str


Action = Transmit | DestinationKnown | StartSubmit | ArmTimer | Release | Finished
