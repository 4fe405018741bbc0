"""The receiver (decode) side of a PD session: it allocates, waits, and commits the outcome.

The receiver decides every outcome. See docs/pd.md.
"""

from __future__ import annotations

from typing import cast

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, SessionId
from kvplane.pd.events import (
    Abort,
    AbortAck,
    Fail,
    Outcome,
    SliceReady,
    SliceResult,
    SliceStatus,
    StartTransfer,
    TimerKind,
    TransferRequest,
    wire_text,
)
from kvplane.pd.ledger import DESTINATION
from kvplane.pd.session import Session
from kvplane.pd.states import STATE_OUTCOME, EventKind, LedgerStep, Ownership, Role, SessionState
from kvplane.pd.timers import Timings
from kvplane.pd.tombstones import Tombstone


class ReceiverSession(Session):
    """One session on the decode side; ``epoch`` names this incarnation of ``session_id``."""

    role = Role.RECEIVER

    def __init__(
        self, session_id: SessionId, peer_id: PeerId, *, epoch: int, token: int, timings: Timings
    ) -> None:
        super().__init__(session_id, peer_id, epoch=epoch, token=token, timings=timings)
        self.ledger.admit(DESTINATION)
        self.request: TransferRequest | None = None
        self.slices: dict[int, SliceReady] = {}
        self.abort_sent: Abort | None = None
        self.abort_settled = False

    @property
    def _epoch(self) -> int:
        if self.epoch is None:  # pragma: no cover - a receiver is always built with one
            raise ProtocolError("receiver session without an epoch")
        return self.epoch

    def _deadline_s(self) -> float:
        return self.timings.deadline_s

    def _owes(self) -> bool:
        return self.abort_sent is not None and not self.abort_settled

    def tombstone(self) -> Tombstone:
        verdict = self._committed() if self.state is SessionState.SUCCESS else None
        return Tombstone(
            self.role, self.peer_id, self.epoch, self.state, True, verdict, self.abort_sent
        )

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def last_slice(self) -> int | None:
        last = [s.slice_id for s in self.slices.values() if s.is_last]
        return last[0] if last else None

    def _result(self, ev: SliceReady, status: SliceStatus) -> SliceResult:
        return SliceResult(
            session_id=self.session_id,
            epoch=self._epoch,
            slice_id=ev.slice_id,
            is_last=ev.is_last,
            start=ev.start,
            end=ev.end,
            status=status,
        )

    def _committed(self) -> SliceResult:
        last = self.last_slice
        if last is None:  # pragma: no cover - SUCCESS implies a final slice
            raise ProtocolError(f"session {self.session_id}: committed without a final slice")
        return self._result(self.slices[last], SliceStatus.COMMITTED)

    def _tiling_problem(self) -> str | None:
        """None when the slices tile ``[prefix_tokens, num_tokens)`` exactly, else why not."""
        req = self.request
        if req is None:  # pragma: no cover - slices arrive only after the request
            return "no request"
        cursor = req.prefix_tokens
        for sid in sorted(self.slices):
            s = self.slices[sid]
            if s.start == s.end:
                if not req.prefix_tokens <= s.start <= req.num_tokens:
                    return f"empty slice {sid} at {s.start} is outside the transfer"
                continue
            if s.start != cursor:
                return f"slice {sid} starts at {s.start}, expected {cursor}"
            cursor = s.end
        if cursor != req.num_tokens:
            return f"slices end at {cursor}, the request needs {req.num_tokens}"
        return None

    def _abandon(self, outcome: Outcome, reason: str) -> None:
        """Commit ``outcome`` now; the destination waits for the sender's drained ack."""
        self.reason = reason
        if self.ledger.state(DESTINATION) is Ownership.ADMITTED:
            self._step(DESTINATION, LedgerStep.CANCEL)
        self.abort_sent = Abort(
            session_id=self.session_id,
            epoch=self._epoch,
            token=self.token,
            outcome=outcome,
            reason=wire_text(reason),
        )
        self._transmit(self.abort_sent)
        self._disarm(TimerKind.RETRANSMIT)
        self._arm(TimerKind.RETRANSMIT, 0, self.timings.retransmit_s)
        self._arm(TimerKind.DRAIN, 0, 2 * self.timings.drain_s)

    def _sender_quiesced(self, drained: bool) -> None:
        """The sender has nothing in flight: release (clean) or hold until the deadline."""
        self.abort_settled = True
        self._disarm(TimerKind.RETRANSMIT)
        self._disarm(TimerKind.DRAIN)
        state = self.ledger.state(DESTINATION)
        if state not in (Ownership.SUBMITTING, Ownership.SUBMITTED):
            return
        if state is Ownership.SUBMITTING:
            self._step(DESTINATION, LedgerStep.ACCEPT)
        self._step(DESTINATION, LedgerStep.QUIESCE if drained else LedgerStep.DOUBT)

    # -- commands --------------------------------------------------------------------------------
    def _on_start_transfer(self, event: object) -> None:
        ev = cast(StartTransfer, event)
        self.request = TransferRequest(
            session_id=self.session_id,
            epoch=self._epoch,
            request_id=ev.request_id,
            dst_block_ids=ev.dst_block_ids,
            prefix_tokens=ev.prefix_tokens,
            num_tokens=ev.num_tokens,
        )
        self._step(DESTINATION, LedgerStep.BEGIN)
        self._transmit(self.request)
        self._arm(TimerKind.RETRANSMIT, 0, self.timings.retransmit_s)

    _end_by_command = _abandon

    # -- from the sender -------------------------------------------------------------------------
    def _on_slice_ready(self, event: object) -> None:
        ev = cast(SliceReady, event)
        if self.state is SessionState.SUCCESS:
            self.stats["duplicate_slices"] += 1
            self._transmit(self._committed())
            return
        if self.terminal:
            self.stats["late_slices"] += 1
            if self.abort_sent is not None and not self.abort_settled:
                self._transmit(self.abort_sent)
            return
        known = self.slices.get(int(ev.slice_id))
        if known is not None:
            if known != ev:
                self._followup(
                    EventKind.FAIL, Fail(reason=f"slice {ev.slice_id} resent differently")
                )
                return
            self.stats["duplicate_slices"] += 1
            self._transmit(self._result(ev, SliceStatus.DUPLICATE))
            return
        req = self.request
        if req is None:  # pragma: no cover - SLICE_READY is legal only after START_TRANSFER
            raise ProtocolError(f"session {self.session_id}: slice before the request")
        last = self.last_slice
        problem = None
        if ev.end > req.num_tokens or ev.start < req.prefix_tokens:
            problem = f"slice {ev.slice_id} [{ev.start}, {ev.end}) is outside the transfer"
        elif last is not None and (ev.is_last or ev.slice_id > last):
            problem = f"slice {ev.slice_id} (last={ev.is_last}) conflicts with final slice {last}"
        elif ev.is_last and any(sid > ev.slice_id for sid in self.slices):
            problem = f"final slice {ev.slice_id} but higher slice ids arrived"
        if problem is not None:
            self._followup(EventKind.FAIL, Fail(reason=problem))
            return
        if not self.slices:
            self._step(DESTINATION, LedgerStep.ACCEPT)  # the sender has the request
            self._disarm(TimerKind.RETRANSMIT)
        self.slices[int(ev.slice_id)] = ev
        last = self.last_slice
        if last is not None and len(self.slices) == last + 1:
            problem = self._tiling_problem()
            if problem is None:
                self._followup(EventKind.COMMIT, None)
            else:
                self._followup(EventKind.FAIL, Fail(reason=problem))
            return
        self._transmit(self._result(ev, SliceStatus.ACCEPTED))

    def _on_commit(self, event: object) -> None:
        self._step(DESTINATION, LedgerStep.QUIESCE)
        self._disarm(TimerKind.RETRANSMIT)
        self.reason = "all slices arrived"
        self._transmit(self._committed())

    def _on_abort(self, event: object) -> None:
        ev = cast(Abort, event)
        if self.state is SessionState.SUCCESS:
            self.stats["late_abort_requests"] += 1
            self._transmit(self._committed())
            return
        outcome = STATE_OUTCOME.get(self.state, ev.outcome)
        if not self.terminal:
            self.reason = ev.reason or f"{ev.outcome.value} by the sender"
        self._sender_quiesced(ev.drained)
        self._transmit(
            AbortAck(session_id=self.session_id, epoch=self._epoch, token=ev.token, outcome=outcome)
        )

    _on_fail_notice = _on_abort

    def _on_abort_ack(self, event: object) -> None:
        ev = cast(AbortAck, event)
        if self.abort_sent is None or ev.token != self.token:
            raise ProtocolError(
                f"session {self.session_id}: ack for an abort we did not send ({ev.token})"
            )
        if self.abort_settled:
            self.stats["duplicate_acks"] += 1
            return
        self._sender_quiesced(ev.drained)

    _on_fail_ack = _on_abort_ack

    # -- clock and lease -------------------------------------------------------------------------
    def _on_timeout_deadline(self, event: object) -> None:
        if self._take(event) and not self.terminal:
            self._abandon(Outcome.FAILED, "deadline")

    def _on_timeout_retransmit(self, event: object) -> None:
        if not self._take(event):
            return
        if self.state is SessionState.WAITING_FOR_INPUT and self.request is not None:
            self._transmit(self.request)
            self._arm(TimerKind.RETRANSMIT, 0, self.timings.retransmit_s)
        elif self.abort_sent is not None and not self.abort_settled:
            self._transmit(self.abort_sent)
            self._arm(TimerKind.RETRANSMIT, 0, self.timings.retransmit_s)

    def _on_timeout_drain(self, event: object) -> None:
        if self._take(event) and self.abort_sent is not None and not self.abort_settled:
            self.abort_settled = True
            self._disarm(TimerKind.RETRANSMIT)
            self._doubt_in_flight()

    def _on_peer_lost(self, event: object) -> None:
        if not self.terminal:
            self.reason = "peer lost"
        if self.ledger.state(DESTINATION) is Ownership.ADMITTED:
            self._step(DESTINATION, LedgerStep.CANCEL)
        self._doubt_in_flight()
        self.abort_settled = True
        self._disarm(TimerKind.RETRANSMIT)
        self._disarm(TimerKind.DRAIN)
