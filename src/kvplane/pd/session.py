"""The sans-IO PD session: events in, actions out, transitions only through the role's table.

An illegal event raises :class:`~kvplane.errors.ProtocolError` and changes nothing; the state
is assigned nowhere else. See docs/pd.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import ClassVar, cast

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, SessionId
from kvplane.pd.actions import Action, ArmTimer, Finished, Release, Transmit
from kvplane.pd.events import (
    AnyWireEvent,
    Cancel,
    Fail,
    Outcome,
    SessionEvent,
    StartTransfer,
    SubmitSlice,
    Timeout,
    TimerKind,
)
from kvplane.pd.ledger import OwnershipLedger
from kvplane.pd.states import (
    TABLES,
    EventKind,
    LedgerStep,
    Ownership,
    Role,
    SessionState,
    Table,
    classify,
)
from kvplane.pd.timers import Timings
from kvplane.pd.tombstones import Tombstone
from kvplane.validators import require_id

COMMANDS = (StartTransfer, SubmitSlice, Cancel, Fail)
"""Event types the local application passes to :meth:`Session.send`."""


class Session:
    """Base of :class:`~kvplane.pd.sender.SenderSession` and ``ReceiverSession``.

    Subclasses define ``role`` and one ``_on_<kind>`` handler per kind in their table. The
    caller must call :meth:`open` once before any event, and must perform the returned actions
    in order. Not thread-safe: one owner drives a session.
    """

    role: ClassVar[Role]

    def __init__(
        self,
        session_id: SessionId,
        peer_id: PeerId,
        *,
        epoch: int | None,
        token: int,
        timings: Timings,
    ) -> None:
        require_id("Session.session_id", session_id)
        require_id("Session.peer_id", peer_id)
        self.session_id = session_id
        self.peer_id = peer_id
        self.epoch = epoch
        self.token = token
        self.timings = timings
        self.state = SessionState.BOOTSTRAPPING
        self.reason = ""
        self.ledger = OwnershipLedger(session_id, peer_id)
        self.stats: Counter[str] = Counter()
        self._armed: set[tuple[TimerKind, int]] = set()
        self._out: list[Action] = []
        self._released: list[tuple[int, Ownership]] = []
        self._followups: list[tuple[EventKind, object]] = []
        self._opened = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        role = cls.__dict__.get("role")
        if isinstance(role, Role):
            missing = sorted(
                {k.value for (_, k) in TABLES[role]}
                - {n[4:] for n in dir(cls) if n.startswith("_on_")}
            )
            if missing:
                raise TypeError(f"{cls.__name__} lacks handlers for {missing}")

    # -- public API ------------------------------------------------------------------------------
    @property
    def table(self) -> Table:
        return TABLES[self.role]

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def armed(self) -> frozenset[tuple[TimerKind, int]]:
        """The timers this session currently waits for."""
        return frozenset(self._armed)

    def open(self) -> list[Action]:
        """Arm the session's deadline; call exactly once, before any event."""
        if self._opened:
            raise ProtocolError(f"session {self.session_id} is already open")
        self._opened = True
        self._out = []
        self._arm(TimerKind.DEADLINE, 0, self._deadline_s())
        out, self._out = self._out, []
        return out

    def send(self, event: StartTransfer | SubmitSlice | Cancel | Fail) -> list[Action]:
        """Apply a command of the local application."""
        if not isinstance(event, COMMANDS):
            raise ProtocolError(
                f"send() takes commands {[c.__name__ for c in COMMANDS]}, got {event!r}"
            )
        return self._run(classify(event), event)

    def receive(self, event: object) -> list[Action]:
        """Apply a peer's wire event or a local fact (evidence, ``Timeout``, ``PeerLost``)."""
        if isinstance(event, COMMANDS):
            raise ProtocolError(f"{type(event).__name__} is a command: pass it to send()")
        return self._run(classify(event), event)

    def fail(self, reason: str) -> list[Action]:
        """Report a local failure (on the sender a request; the receiver commits the verdict)."""
        return self.send(Fail(reason=reason))

    @property
    def retirable(self) -> bool:
        """Terminal, every unit released, nothing owed to the peer: a tombstone may replace it."""
        return self.terminal and self.ledger.all_released() and not self._owes()

    def tombstone(self) -> Tombstone:
        """What must remain of this session once retired (to answer late frames)."""
        return Tombstone(self.role, self.peer_id, self.epoch, self.state, True)

    def _owes(self) -> bool:
        return False

    def would_accept(self, event: object) -> bool:
        """True when the table has a row for this event in the current state."""
        return (self.state, classify(event)) in self.table

    # -- the one transition path ---------------------------------------------------------------
    def _run(self, kind: EventKind, event: object) -> list[Action]:
        if not self._opened:
            raise ProtocolError(f"session {self.session_id}: call open() before any event")
        target = self.table.get((self.state, kind))
        if target is None:
            raise ProtocolError(
                f"{self.role.value} session {self.session_id} in {self.state.value} "
                f"cannot take {kind.value}"
            )
        if isinstance(event, SessionEvent):
            self._check_wire(event)
        handler: Callable[[object], None] = getattr(self, f"_on_{kind.value}")
        saved = (self._out, self._released, self._followups)
        self._out, self._released, self._followups = [], [], []
        try:
            handler(event)
            before = self.state
            self.state = target
            out = self._out
            for unit, via in self._released:
                out.append(Release(self.session_id, self.peer_id, self.role, unit, via, target))
            if target.terminal and not before.terminal:
                self._armed.discard((TimerKind.DEADLINE, 0))
                self._armed.discard((TimerKind.VERDICT, 0))
                out.append(Finished(self.session_id, self.peer_id, self.role, target, self.reason))
            followups = self._followups
        finally:
            self._out, self._released, self._followups = saved
        for fkind, fevent in followups:
            out.extend(self._run(fkind, fevent))
        return out

    def _check_wire(self, event: SessionEvent) -> None:
        if event.session_id != self.session_id:
            raise ProtocolError(
                f"event for session {event.session_id!r} sent to {self.session_id!r}"
            )
        if self.epoch is not None and event.epoch != self.epoch:
            raise ProtocolError(
                f"session {self.session_id}: epoch {event.epoch} is not this incarnation's "
                f"{self.epoch} (stale work)"
            )

    # -- helpers for handlers --------------------------------------------------------------------
    def _deadline_s(self) -> float:
        raise NotImplementedError

    def _emit(self, action: Action) -> None:
        self._out.append(action)

    def _transmit(self, event: AnyWireEvent) -> None:
        self._out.append(Transmit(self.peer_id, event))

    def _followup(self, kind: EventKind, event: object) -> None:
        self._followups.append((kind, event))

    def _arm(self, timer: TimerKind, unit: int, delay_s: float) -> None:
        """Arm once; an armed timer is never re-armed (so never extended)."""
        if (timer, unit) not in self._armed:
            self._armed.add((timer, unit))
            self._out.append(ArmTimer(self.session_id, timer, unit, delay_s))

    def _disarm(self, timer: TimerKind, unit: int = 0) -> None:
        self._armed.discard((timer, unit))

    def _take(self, event: object) -> bool:
        """Consume an expired timer; False (and counted) when it was not armed."""
        timeout = cast(Timeout, event)  # classify() maps only Timeout to TIMEOUT_* kinds
        key = (timeout.timer, timeout.unit)
        if key in self._armed:
            self._armed.discard(key)
            return True
        self.stats["stale_timeouts"] += 1
        return False

    def _step(self, unit: int, step: LedgerStep) -> None:
        """Ledger step that records a release; DOUBT also arms the unit's release deadline."""
        if self.ledger.step(unit, step):
            self._released.append((unit, self.ledger.state(unit)))
        if step is LedgerStep.DOUBT:
            self._arm(TimerKind.RELEASE, unit, self.timings.in_doubt_s)

    def _doubt_in_flight(self) -> None:
        for unit in self.ledger.units((Ownership.SUBMITTING, Ownership.SUBMITTED)):
            self._step(unit, LedgerStep.DOUBT)

    def _on_cancel(self, event: object) -> None:
        if not self.terminal:
            self._end_by_command(Outcome.ABORTED, cast(Cancel, event).reason)

    def _on_fail(self, event: object) -> None:
        if not self.terminal:
            self._end_by_command(Outcome.FAILED, cast(Fail, event).reason)

    def _end_by_command(self, outcome: Outcome, reason: str) -> None:
        """End the session as ``outcome`` on the application's Cancel or Fail, the role's way
        (a sender requests it, a receiver commits it); never called once terminal."""
        raise NotImplementedError

    def _on_timeout_release(self, event: object) -> None:
        unit = cast(Timeout, event).unit
        if self._take(event) and self.ledger.can(unit, LedgerStep.EXPIRE):
            self._step(unit, LedgerStep.EXPIRE)
