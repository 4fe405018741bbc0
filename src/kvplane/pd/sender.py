"""The sender (prefill) side of a PD session.

Slices are admitted in order, submitted once the destination is known and announced after
transport DONE; its own cancel or failure is a request to the receiver. See docs/pd.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, SessionId, SliceId
from kvplane.pd.actions import DestinationKnown, StartSubmit
from kvplane.pd.events import (
    Abort,
    AbortAck,
    Outcome,
    SliceFact,
    SliceReady,
    SliceResult,
    SubmitSlice,
    TimerKind,
    TransferRequest,
    TransportFailed,
    TransportInDoubt,
    wire_text,
)
from kvplane.pd.session import Session
from kvplane.pd.states import STATE_OUTCOME, LedgerStep, Ownership, Role
from kvplane.pd.timers import Timings
from kvplane.pd.tombstones import Tombstone

_DOUBTED = (Ownership.IN_DOUBT, Ownership.EXPIRED)


@dataclass(slots=True)
class SliceRecord:
    """A submitted slice: its full token range and how far its announcement got."""

    slice_id: int
    is_last: bool
    start: int
    end: int
    announced: bool = False
    acked: bool = False


class SenderSession(Session):
    """One session on the prefill side; the epoch is learnt from the receiver's first frame."""

    role = Role.SENDER

    def __init__(
        self,
        session_id: SessionId,
        peer_id: PeerId,
        *,
        token: int,
        timings: Timings,
        epoch: int | None = None,
    ) -> None:
        super().__init__(session_id, peer_id, epoch=epoch, token=token, timings=timings)
        self._gave_up = False
        self.request: TransferRequest | None = None
        self.slices: dict[int, SliceRecord] = {}
        self.requested: tuple[Outcome, str] | None = None
        self._abort_sent = False
        self._owed_acks: dict[int, Outcome] = {}
        self._notice: Abort | None = None

    def _deadline_s(self) -> float:
        return self.timings.sender_deadline_s

    def _owes(self) -> bool:
        return bool(self._owed_acks)

    def tombstone(self) -> Tombstone:
        return Tombstone(
            self.role, self.peer_id, self.epoch, self.state, self._clean(), notice=self._notice
        )

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def last_slice(self) -> int | None:
        last = [s.slice_id for s in self.slices.values() if s.is_last]
        return last[0] if last else None

    def _clip(self, rec: SliceRecord) -> tuple[TransferRequest, int, int]:
        """The request and the slice's range clipped to ``[prefix_tokens, num_tokens)``."""
        req = self.request
        if req is None:  # pragma: no cover - callers act only once the request is known
            raise ProtocolError(f"session {self.session_id}: no destination yet")
        lo = min(max(rec.start, req.prefix_tokens), req.num_tokens)
        return req, lo, max(lo, min(rec.end, req.num_tokens))

    def _slice_ready(self, rec: SliceRecord) -> SliceReady:
        req, lo, hi = self._clip(rec)
        return SliceReady(
            session_id=self.session_id,
            epoch=req.epoch,
            slice_id=rec.slice_id,
            is_last=rec.is_last,
            start=lo,
            end=hi,
        )

    def _start_submit(self, rec: SliceRecord) -> None:
        req, lo, hi = self._clip(rec)
        slice_id = SliceId(rec.slice_id)
        self._emit(StartSubmit(self.session_id, self.peer_id, slice_id, rec.is_last, lo, hi, req))

    def _announce(self, rec: SliceRecord) -> None:
        rec.announced = True
        self._transmit(self._slice_ready(rec))
        self._arm(TimerKind.RETRANSMIT, 0, self.timings.retransmit_s)

    def _cancel_admitted(self) -> None:
        for unit in self.ledger.units((Ownership.ADMITTED,)):
            self._step(unit, LedgerStep.CANCEL)

    def _clean(self) -> bool:
        """No unit ever ended in doubt: the receiver may release its destination at once."""
        return not self.ledger.units(_DOUBTED)

    def _request(self, outcome: Outcome, reason: str) -> None:
        """Ask the receiver to end the session (once); drain first."""
        if self.requested is None:
            self.requested = (outcome, reason)
            self._cancel_admitted()
            if self.ledger.in_flight():
                self._arm(TimerKind.DRAIN, 0, self.timings.drain_s)
        self._after_progress()

    def _after_progress(self) -> None:
        """Send what was waiting for the drain: our Abort request, owed acks, a final notice."""
        if self.ledger.in_flight() or self.epoch is None:
            return
        if self.requested and not self._abort_sent and not self.terminal and not self._gave_up:
            self._abort_sent = True
            self._send_abort_request()
            self._arm(TimerKind.RETRANSMIT, 0, self.timings.retransmit_s)
        for token, outcome in sorted(self._owed_acks.items()):
            self._transmit(
                AbortAck(
                    session_id=self.session_id,
                    epoch=self.epoch,
                    token=token,
                    outcome=outcome,
                    drained=self._clean(),
                )
            )
        self._owed_acks.clear()
        if self._gave_up and self._notice is None:
            self._notice = Abort(
                session_id=self.session_id,
                epoch=self.epoch,
                token=self.token,
                outcome=Outcome.FAILED,
                reason="sender deadline",
                drained=self._clean(),
            )
            self._transmit(self._notice)

    def _send_abort_request(self) -> None:
        if self.requested is None or self.epoch is None:  # pragma: no cover - callers check both
            raise ProtocolError(f"session {self.session_id}: no request to send")
        outcome, reason = self.requested
        self._transmit(
            Abort(
                session_id=self.session_id,
                epoch=self.epoch,
                token=self.token,
                outcome=outcome,
                reason=wire_text(reason),
                drained=self._clean(),
            )
        )

    def _unit(self, event: object) -> int:
        unit = int(cast(SliceFact, event).slice_id)
        if unit not in self.slices:
            raise ProtocolError(f"session {self.session_id}: no slice {unit} was submitted")
        return unit

    # -- commands --------------------------------------------------------------------------------
    def _on_submit_slice(self, event: object) -> None:
        ev = cast(SubmitSlice, event)
        expected = len(self.slices)
        if ev.slice_id != expected:
            raise ProtocolError(
                f"session {self.session_id}: slice {ev.slice_id} submitted, expected {expected}"
            )
        if self.last_slice is not None:
            raise ProtocolError(
                f"session {self.session_id}: slice {ev.slice_id} after the last one"
            )
        prev_end = self.slices[expected - 1].end if expected else 0
        if ev.start != prev_end:
            raise ProtocolError(
                f"session {self.session_id}: slice {ev.slice_id} starts at {ev.start}, "
                f"expected {prev_end} (slices tile [0, num_tokens))"
            )
        req = self.request
        if req is not None and (
            ev.end > req.num_tokens or (ev.is_last and ev.end != req.num_tokens)
        ):
            raise ProtocolError(
                f"session {self.session_id}: slice [{ev.start}, {ev.end}) (last={ev.is_last}) "
                f"does not fit the request's {req.num_tokens} tokens"
            )
        rec = SliceRecord(int(ev.slice_id), ev.is_last, ev.start, ev.end)
        self.slices[rec.slice_id] = rec
        self.ledger.admit(rec.slice_id)
        if self.requested is not None or self.terminal:
            self._step(rec.slice_id, LedgerStep.CANCEL)
        elif req is not None:
            self._start_submit(rec)

    _end_by_command = _request

    # -- driver evidence -------------------------------------------------------------------------
    def _on_submit_started(self, event: object) -> None:
        unit = self._unit(event)
        self.ledger.step(unit, LedgerStep.BEGIN)  # raises (unchanged) unless ADMITTED

    def _on_submit_skipped(self, event: object) -> None:
        unit = self._unit(event)
        if not self.ledger.can(unit, LedgerStep.CANCEL):
            raise ProtocolError(
                f"session {self.session_id}: slice {unit} is {self.ledger.state(unit).value}"
            )
        self._step(unit, LedgerStep.CANCEL)
        self._announce(self.slices[unit])

    def _on_submit_accepted(self, event: object) -> None:
        unit = self._unit(event)
        state = self.ledger.state(unit)
        if state is Ownership.SUBMITTING:
            self._step(unit, LedgerStep.ACCEPT)
        elif state in _DOUBTED:
            self.stats["late_evidence"] += 1
        else:
            raise ProtocolError(
                f"session {self.session_id}: slice {unit} accepted while {state.value}"
            )

    def _settle(self, unit: int) -> bool:
        """Apply evidence that the backend stopped; False when it came too late to matter."""
        state = self.ledger.state(unit)
        if state is Ownership.ADMITTED:
            raise ProtocolError(f"session {self.session_id}: evidence for unsubmitted slice {unit}")
        if state not in (Ownership.SUBMITTING, Ownership.SUBMITTED):
            self.stats["late_evidence"] += 1
            return False
        if state is Ownership.SUBMITTING:
            self._step(unit, LedgerStep.ACCEPT)
        self._step(unit, LedgerStep.QUIESCE)
        return True

    def _on_transport_done(self, event: object) -> None:
        unit = self._unit(event)
        if self._settle(unit) and not self.terminal and self.requested is None:
            self._announce(self.slices[unit])
        self._after_progress()

    def _on_transport_failed(self, event: object) -> None:
        unit = self._unit(event)
        if self._settle(unit) and not self.terminal:
            self._request(Outcome.FAILED, f"slice {unit}: {cast(TransportFailed, event).reason}")
        self._after_progress()

    def _on_transport_in_doubt(self, event: object) -> None:
        unit = self._unit(event)
        state = self.ledger.state(unit)
        if state is Ownership.ADMITTED:
            raise ProtocolError(f"session {self.session_id}: evidence for unsubmitted slice {unit}")
        if state in (Ownership.SUBMITTING, Ownership.SUBMITTED):
            self._step(unit, LedgerStep.DOUBT)
            if not self.terminal:
                self._request(
                    Outcome.FAILED, f"slice {unit}: {cast(TransportInDoubt, event).reason}"
                )
        else:
            self.stats["late_evidence"] += 1
        self._after_progress()

    # -- clock and lease -------------------------------------------------------------------------
    def _on_timeout_deadline(self, event: object) -> None:
        self._give_up(event, "deadline")

    def _on_timeout_verdict(self, event: object) -> None:
        self._give_up(event, "deadline: no verdict from the receiver")

    def _give_up(self, event: object, reason: str) -> None:
        if self._take(event) and not self.terminal:
            self.reason = reason
            self._gave_up = True
            self._cancel_admitted()
            if self.ledger.in_flight():
                self._arm(TimerKind.DRAIN, 0, self.timings.drain_s)
            self._after_progress()

    def _on_timeout_drain(self, event: object) -> None:
        if self._take(event):
            self._doubt_in_flight()
            self._after_progress()

    def _on_timeout_retransmit(self, event: object) -> None:
        if not self._take(event) or self.terminal or self.epoch is None:
            return
        pending = False
        if self.requested is not None:
            if self._abort_sent:
                self._send_abort_request()
                pending = True
        else:
            for rec in self.slices.values():
                if rec.announced and not rec.acked:
                    self._transmit(self._slice_ready(rec))
                    pending = True
            last = self.last_slice
            if not pending and last is not None and all(r.announced for r in self.slices.values()):
                self._transmit(self._slice_ready(self.slices[last]))  # poke for the verdict
                pending = True
        if pending:
            self._arm(TimerKind.RETRANSMIT, 0, self.timings.retransmit_s)

    def _on_peer_lost(self, event: object) -> None:
        if not self.terminal:
            self.reason = "peer lost"
        self._cancel_admitted()
        self._doubt_in_flight()
        self._owed_acks.clear()
        self._disarm(TimerKind.RETRANSMIT)
        self._disarm(TimerKind.DRAIN)

    # -- from the receiver -----------------------------------------------------------------------
    def _on_transfer_request(self, event: object) -> None:
        ev = cast(TransferRequest, event)
        if self.request is not None:
            if ev != self.request:
                raise ProtocolError(
                    f"session {self.session_id}: a different request for the same epoch"
                )
            self.stats["duplicate_requests"] += 1
            if self._notice is not None:
                self._transmit(self._notice)
            return
        if self.terminal:  # ended (the receiver's abort, our deadline) before its request
            self.stats["late_requests"] += 1
            if self._gave_up and self.epoch is None:  # tell the waiting receiver at once
                self.epoch = ev.epoch
                self._after_progress()
            return
        self.epoch = ev.epoch
        self.request = ev
        # The receiver's deadline runs from its open, before it sent this request: counted from
        # now, ours can no longer fire before its verdict (or its own deadline) reaches us.
        self._disarm(TimerKind.DEADLINE)
        self._arm(TimerKind.VERDICT, 0, self._deadline_s())
        mismatch = [
            s.slice_id for s in self.slices.values()
            if s.end > ev.num_tokens or (s.is_last and s.end != ev.num_tokens)
        ]  # fmt: skip
        if mismatch and self.requested is None:
            self._request(Outcome.FAILED, f"slices {mismatch} do not fit {ev.num_tokens} tokens")
            return
        if self.requested is None:  # a hint: the driver may plan slices not yet computed
            self._emit(DestinationKnown(self.session_id, self.peer_id, ev))
        for unit in self.ledger.units((Ownership.ADMITTED,)):
            self._start_submit(self.slices[unit])
        self._after_progress()

    def _on_slice_ack(self, event: object) -> None:
        ev = cast(SliceResult, event)
        rec = self.slices.get(int(ev.slice_id))
        if rec is None or not rec.announced:
            raise ProtocolError(
                f"session {self.session_id}: ack for unannounced slice {ev.slice_id}"
            )
        rec.acked = True

    def _on_slice_committed(self, event: object) -> None:
        ev = cast(SliceResult, event)
        if self.terminal:
            self.stats["late_verdicts"] += 1
            return
        last = self.last_slice
        if (
            last is None
            or ev.slice_id != last
            or not all(r.announced for r in self.slices.values())
        ):
            raise ProtocolError(
                f"session {self.session_id}: COMMITTED before every slice was announced"
            )
        for rec in self.slices.values():
            rec.acked = True
        self._disarm(TimerKind.RETRANSMIT)
        self._disarm(TimerKind.DRAIN)
        self.reason = "committed by the receiver"

    def _on_abort(self, event: object) -> None:
        ev = cast(Abort, event)
        if not self.terminal:
            if self.epoch is None:
                self.epoch = ev.epoch
            self.reason = ev.reason or "aborted by the receiver"
            self._cancel_admitted()
            self._disarm(TimerKind.RETRANSMIT)
            if self.ledger.in_flight():
                self._arm(TimerKind.DRAIN, 0, self.timings.drain_s)
            self._owed_acks[ev.token] = ev.outcome
        else:
            self.stats["duplicate_aborts"] += 1
            self._owed_acks[ev.token] = STATE_OUTCOME.get(self.state, ev.outcome)
        self._after_progress()

    _on_fail_notice = _on_abort

    def _on_abort_ack(self, event: object) -> None:
        ev = cast(AbortAck, event)
        if self.terminal:
            self.stats["duplicate_acks"] += 1
            return
        if not self._abort_sent or ev.token != self.token:
            raise ProtocolError(
                f"session {self.session_id}: ack for an abort we did not send ({ev.token})"
            )
        self._disarm(TimerKind.RETRANSMIT)
        self.reason = self.requested[1] if self.requested else "aborted"

    _on_fail_ack = _on_abort_ack
