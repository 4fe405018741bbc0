"""The only home of PD transitions: one session table per role and the ownership-ledger table.

Theory of operation
-------------------
A session's protocol state is ordered and moves forward only::

    BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS
    (any non-terminal) -> ABORTED | FAILED          (terminal, sticky: nothing leaves them)

``SENDER_TABLE`` and ``RECEIVER_TABLE`` map ``(state, EventKind) -> next state``; a pair that is
absent is illegal and the session raises :class:`~kvplane.errors.ProtocolError` without
changing anything. Self-loops are listed explicitly, so the tables say what each state
*accepts*, not only where it goes. Events are classified into kinds by :func:`classify`
(e.g. an ``Abort`` carrying outcome FAILED is ``FAIL_NOTICE``), so every entry has exactly one
target.

Who decides: the receiver commits every outcome (it alone knows whether all slices arrived).
The sender turns terminal on the receiver's verdict (``SLICE_COMMITTED``, ``ABORT``,
``ABORT_ACK``...), or unilaterally as FAILED on its own deadline (``TIMEOUT_DEADLINE`` before
the receiver's request, ``TIMEOUT_VERDICT`` after it) or on peer loss; its own
``CANCEL``/``FAIL``/transport failures are *requests* that leave its state unchanged until the
verdict arrives. That is why the sender's ``CANCEL`` row is all self-loops.

The ownership ledger (per session and peer, one entry per unit of memory) has its own table::

    ADMITTED -> SUBMITTING -> SUBMITTED -> BACKEND_DONE      (release)
    ADMITTED -> NOT_SUBMITTED                                (release)
    SUBMITTING | SUBMITTED -> IN_DOUBT -> EXPIRED            (release at a fixed deadline)

Only NOT_SUBMITTED and BACKEND_DONE release memory on evidence; an IN_DOUBT entry is released
only when its fail-closed deadline, armed once on entry and never extended, expires (recorded as
EXPIRED so the ledger shows which path released it). Releasing states have no way out, so each
entry is released exactly once.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from kvplane.errors import ProtocolError
from kvplane.pd.events import (
    Abort,
    AbortAck,
    Cancel,
    Fail,
    Outcome,
    PeerLost,
    SliceReady,
    SliceResult,
    SliceStatus,
    StartTransfer,
    SubmitAccepted,
    SubmitSkipped,
    SubmitSlice,
    SubmitStarted,
    Timeout,
    TimerKind,
    TransferRequest,
    TransportDone,
    TransportFailed,
    TransportInDoubt,
)


class Role(enum.Enum):
    SENDER = "sender"
    """Holds the KV (prefill side) and writes it into the receiver's blocks."""
    RECEIVER = "receiver"
    """Allocates destination blocks (decode side) and commits the session's outcome."""


class SessionState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def rank(self) -> int:
        """Position in the forward-only order (all terminal states share the last rank)."""
        return _RANK[self]

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


_RANK = {
    SessionState.BOOTSTRAPPING: 0,
    SessionState.WAITING_FOR_INPUT: 1,
    SessionState.TRANSFERRING: 2,
    SessionState.SUCCESS: 3,
    SessionState.ABORTED: 3,
    SessionState.FAILED: 3,
}
TERMINAL = frozenset({SessionState.SUCCESS, SessionState.ABORTED, SessionState.FAILED})
OUTCOME_STATE = {Outcome.ABORTED: SessionState.ABORTED, Outcome.FAILED: SessionState.FAILED}
STATE_OUTCOME = {state: outcome for outcome, state in OUTCOME_STATE.items()}


class EventKind(enum.Enum):
    """What a session reacts to: one kind per (event type, distinguishing field)."""

    # commands from the local application
    START_TRANSFER = "start_transfer"
    SUBMIT_SLICE = "submit_slice"
    CANCEL = "cancel"
    FAIL = "fail"
    # facts from the local transport driver (sender)
    SUBMIT_STARTED = "submit_started"
    SUBMIT_ACCEPTED = "submit_accepted"
    SUBMIT_SKIPPED = "submit_skipped"
    TRANSPORT_DONE = "transport_done"
    TRANSPORT_FAILED = "transport_failed"
    TRANSPORT_IN_DOUBT = "transport_in_doubt"
    # facts from the clock and the lease keeper
    TIMEOUT_DEADLINE = "timeout_deadline"
    TIMEOUT_VERDICT = "timeout_verdict"
    TIMEOUT_RETRANSMIT = "timeout_retransmit"
    TIMEOUT_DRAIN = "timeout_drain"
    TIMEOUT_RELEASE = "timeout_release"
    PEER_LOST = "peer_lost"
    # from the peer
    TRANSFER_REQUEST = "transfer_request"
    SLICE_READY = "slice_ready"
    SLICE_ACK = "slice_ack"
    SLICE_COMMITTED = "slice_committed"
    ABORT = "abort"
    FAIL_NOTICE = "fail_notice"
    ABORT_ACK = "abort_ack"
    FAIL_ACK = "fail_ack"
    # internal follow-up (receiver: final + all slices arrived and tile the range)
    COMMIT = "commit"


_TIMEOUT_KIND = {
    TimerKind.DEADLINE: EventKind.TIMEOUT_DEADLINE,
    TimerKind.VERDICT: EventKind.TIMEOUT_VERDICT,
    TimerKind.RETRANSMIT: EventKind.TIMEOUT_RETRANSMIT,
    TimerKind.DRAIN: EventKind.TIMEOUT_DRAIN,
    TimerKind.RELEASE: EventKind.TIMEOUT_RELEASE,
}
_BY_TYPE: dict[type, EventKind] = {
    StartTransfer: EventKind.START_TRANSFER,
    SubmitSlice: EventKind.SUBMIT_SLICE,
    Cancel: EventKind.CANCEL,
    Fail: EventKind.FAIL,
    SubmitStarted: EventKind.SUBMIT_STARTED,
    SubmitAccepted: EventKind.SUBMIT_ACCEPTED,
    SubmitSkipped: EventKind.SUBMIT_SKIPPED,
    TransportDone: EventKind.TRANSPORT_DONE,
    TransportFailed: EventKind.TRANSPORT_FAILED,
    TransportInDoubt: EventKind.TRANSPORT_IN_DOUBT,
    PeerLost: EventKind.PEER_LOST,
    TransferRequest: EventKind.TRANSFER_REQUEST,
    SliceReady: EventKind.SLICE_READY,
}


def classify(event: object) -> EventKind:
    """The kind of a session event; ``ProtocolError`` for anything that is not one."""
    if isinstance(event, Timeout):
        return _TIMEOUT_KIND[event.timer]
    if isinstance(event, SliceResult):
        committed = event.status is SliceStatus.COMMITTED
        return EventKind.SLICE_COMMITTED if committed else EventKind.SLICE_ACK
    if isinstance(event, Abort):
        return EventKind.ABORT if event.outcome is Outcome.ABORTED else EventKind.FAIL_NOTICE
    if isinstance(event, AbortAck):
        return EventKind.ABORT_ACK if event.outcome is Outcome.ABORTED else EventKind.FAIL_ACK
    kind = _BY_TYPE.get(type(event))
    if kind is None:
        raise ProtocolError(f"{type(event).__name__} is not a session event: {event!r}")
    return kind


# -- the session tables --------------------------------------------------------------------------
S = SessionState
K = EventKind
NON_TERMINAL = (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING)
ALL_STATES = tuple(S)
Table = Mapping[tuple[SessionState, EventKind], SessionState]


def _build(rows: Iterable[tuple[EventKind, Iterable[SessionState], SessionState | None]]) -> Table:
    """Rows of ``(kind, from-states, target)``; a ``None`` target means a self-loop."""
    table: dict[tuple[SessionState, EventKind], SessionState] = {}
    for kind, sources, target in rows:
        for src in sources:
            if (src, kind) in table:
                raise AssertionError(f"duplicate table row ({src}, {kind})")
            table[(src, kind)] = src if target is None else target
    return MappingProxyType(table)


_SELF = None
_TIMER_ROWS = [
    (K.TIMEOUT_RETRANSMIT, ALL_STATES, _SELF),
    (K.TIMEOUT_DRAIN, ALL_STATES, _SELF),
    (K.TIMEOUT_RELEASE, ALL_STATES, _SELF),
    (K.PEER_LOST, NON_TERMINAL, S.FAILED),
    (K.PEER_LOST, TERMINAL, _SELF),
    (K.FAIL, TERMINAL, _SELF),
]
_LIVE = (S.TRANSFERRING, S.ABORTED, S.FAILED)
"""Sender states in which transfers can be in flight (evidence may arrive)."""

SENDER_TABLE: Table = _build(
    [
        (K.SUBMIT_SLICE, (*NON_TERMINAL, S.ABORTED, S.FAILED), _SELF),
        (K.CANCEL, ALL_STATES, _SELF),
        (K.FAIL, NON_TERMINAL, _SELF),
        (K.SUBMIT_STARTED, (S.WAITING_FOR_INPUT,), S.TRANSFERRING),
        (K.SUBMIT_STARTED, (S.TRANSFERRING,), _SELF),
        (K.SUBMIT_SKIPPED, (S.WAITING_FOR_INPUT,), S.TRANSFERRING),
        (K.SUBMIT_SKIPPED, (S.TRANSFERRING,), _SELF),
        (K.SUBMIT_ACCEPTED, _LIVE, _SELF),
        (K.TRANSPORT_DONE, _LIVE, _SELF),
        (K.TRANSPORT_FAILED, _LIVE, _SELF),
        (K.TRANSPORT_IN_DOUBT, _LIVE, _SELF),
        (K.TRANSFER_REQUEST, (S.BOOTSTRAPPING,), S.WAITING_FOR_INPUT),
        (K.TRANSFER_REQUEST, (S.WAITING_FOR_INPUT, S.TRANSFERRING, *TERMINAL), _SELF),
        (K.SLICE_ACK, (S.TRANSFERRING, *TERMINAL), _SELF),
        (K.SLICE_COMMITTED, (S.TRANSFERRING,), S.SUCCESS),
        (K.SLICE_COMMITTED, TERMINAL, _SELF),
        (K.ABORT, NON_TERMINAL, S.ABORTED),
        (K.ABORT, (S.ABORTED, S.FAILED), _SELF),
        (K.FAIL_NOTICE, NON_TERMINAL, S.FAILED),
        (K.FAIL_NOTICE, (S.ABORTED, S.FAILED), _SELF),
        (K.ABORT_ACK, (S.WAITING_FOR_INPUT, S.TRANSFERRING), S.ABORTED),
        (K.ABORT_ACK, (S.ABORTED, S.FAILED), _SELF),
        (K.FAIL_ACK, (S.WAITING_FOR_INPUT, S.TRANSFERRING), S.FAILED),
        (K.FAIL_ACK, (S.ABORTED, S.FAILED), _SELF),
        # DEADLINE runs until the request (which leaves BOOTSTRAPPING), VERDICT from it on
        (K.TIMEOUT_DEADLINE, (S.BOOTSTRAPPING,), S.FAILED),
        (K.TIMEOUT_DEADLINE, (S.WAITING_FOR_INPUT, S.TRANSFERRING, *TERMINAL), _SELF),
        (K.TIMEOUT_VERDICT, (S.WAITING_FOR_INPUT, S.TRANSFERRING), S.FAILED),
        (K.TIMEOUT_VERDICT, TERMINAL, _SELF),
        *_TIMER_ROWS,
    ]
)

RECEIVER_TABLE: Table = _build(
    [
        (K.START_TRANSFER, (S.BOOTSTRAPPING,), S.WAITING_FOR_INPUT),
        (K.CANCEL, NON_TERMINAL, S.ABORTED),
        (K.CANCEL, TERMINAL, _SELF),
        (K.FAIL, NON_TERMINAL, S.FAILED),
        (K.SLICE_READY, (S.WAITING_FOR_INPUT,), S.TRANSFERRING),
        (K.SLICE_READY, (S.TRANSFERRING, *TERMINAL), _SELF),
        (K.COMMIT, (S.TRANSFERRING,), S.SUCCESS),
        (K.ABORT, (S.WAITING_FOR_INPUT, S.TRANSFERRING), S.ABORTED),
        (K.ABORT, TERMINAL, _SELF),
        (K.FAIL_NOTICE, (S.WAITING_FOR_INPUT, S.TRANSFERRING), S.FAILED),
        (K.FAIL_NOTICE, TERMINAL, _SELF),
        (K.ABORT_ACK, (S.ABORTED, S.FAILED), _SELF),
        (K.FAIL_ACK, (S.ABORTED, S.FAILED), _SELF),
        (K.TIMEOUT_DEADLINE, NON_TERMINAL, S.FAILED),
        (K.TIMEOUT_DEADLINE, TERMINAL, _SELF),
        *_TIMER_ROWS,
    ]
)

TABLES: Mapping[Role, Table] = MappingProxyType(
    {Role.SENDER: SENDER_TABLE, Role.RECEIVER: RECEIVER_TABLE}
)


# -- the ownership ledger table ------------------------------------------------------------------
class Ownership(enum.Enum):
    """Who may touch one unit of a session's memory."""

    ADMITTED = "admitted"
    SUBMITTING = "submitting"
    SUBMITTED = "submitted"
    BACKEND_DONE = "backend_done"
    NOT_SUBMITTED = "not_submitted"
    IN_DOUBT = "in_doubt"
    EXPIRED = "expired"
    """IN_DOUBT past its fail-closed deadline."""


class LedgerStep(enum.Enum):
    BEGIN = "begin"
    """The unit is being handed to the backend (submit call / request on the wire)."""
    ACCEPT = "accept"
    """The backend (or the peer) took it."""
    QUIESCE = "quiesce"
    """Evidence that the backend no longer touches the memory."""
    CANCEL = "cancel"
    """Never handed over."""
    DOUBT = "doubt"
    """Handed over, and no evidence will tell when the backend stops."""
    EXPIRE = "expire"
    """The IN_DOUBT deadline passed."""


_O = Ownership
_L = LedgerStep
LEDGER_TABLE: Mapping[tuple[Ownership, LedgerStep], Ownership] = MappingProxyType(
    {
        (_O.ADMITTED, _L.BEGIN): _O.SUBMITTING,
        (_O.ADMITTED, _L.CANCEL): _O.NOT_SUBMITTED,
        (_O.SUBMITTING, _L.ACCEPT): _O.SUBMITTED,
        (_O.SUBMITTING, _L.DOUBT): _O.IN_DOUBT,
        (_O.SUBMITTED, _L.QUIESCE): _O.BACKEND_DONE,
        (_O.SUBMITTED, _L.DOUBT): _O.IN_DOUBT,
        (_O.IN_DOUBT, _L.EXPIRE): _O.EXPIRED,
    }
)
RELEASING = frozenset({_O.NOT_SUBMITTED, _O.BACKEND_DONE, _O.EXPIRED})
"""Entering one of these releases the unit's memory (exactly once: they have no way out)."""
IN_FLIGHT = frozenset({_O.SUBMITTING, _O.SUBMITTED})
"""The backend may be touching the memory and evidence is still expected."""
