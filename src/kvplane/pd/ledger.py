"""The ownership ledger of one session with one peer: who may touch each unit of memory.

Entries move only along ``states.LEDGER_TABLE``, and each is released exactly once. Holds no
memory, reads no clock. See docs/pd.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, SessionId
from kvplane.pd.states import IN_FLIGHT, LEDGER_TABLE, RELEASING, LedgerStep, Ownership

DESTINATION = 0
"""The receiver's single unit: the destination blocks of its request."""


@dataclass(frozen=True, slots=True)
class LedgerRecord:
    """One unit's history: its current state and every state it went through, in order."""

    unit: int
    state: Ownership
    history: tuple[Ownership, ...]

    @property
    def released(self) -> bool:
        return self.state in RELEASING


class OwnershipLedger:
    """Entries per unit for one ``(session, peer)``; transitions only through the ledger table."""

    def __init__(self, session_id: SessionId, peer_id: PeerId) -> None:
        self.session_id = session_id
        self.peer_id = peer_id
        self._entries: dict[int, LedgerRecord] = {}
        self.releases = 0

    def __contains__(self, unit: int) -> bool:
        return unit in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def admit(self, unit: int) -> None:
        """Create ``unit`` as ADMITTED; a unit is admitted at most once per session."""
        if unit in self._entries:
            raise ProtocolError(
                f"session {self.session_id}: unit {unit} already in the ledger "
                f"({self._entries[unit].state.value})"
            )
        self._entries[unit] = LedgerRecord(unit, Ownership.ADMITTED, (Ownership.ADMITTED,))

    def state(self, unit: int) -> Ownership:
        rec = self._entries.get(unit)
        if rec is None:
            raise ProtocolError(f"session {self.session_id}: unit {unit} is not in the ledger")
        return rec.state

    def can(self, unit: int, step: LedgerStep) -> bool:
        rec = self._entries.get(unit)
        return rec is not None and (rec.state, step) in LEDGER_TABLE

    def step(self, unit: int, step: LedgerStep) -> bool:
        """Apply ``step`` to ``unit``; True when this step released the unit's memory.

        Raises ``ProtocolError`` (ledger unchanged) when the table has no such transition.
        """
        state = self.state(unit)
        target = LEDGER_TABLE.get((state, step))
        if target is None:
            raise ProtocolError(
                f"session {self.session_id} (peer {self.peer_id}): unit {unit} in "
                f"{state.value} cannot take ledger step {step.value}"
            )
        rec = self._entries[unit]
        self._entries[unit] = LedgerRecord(unit, target, (*rec.history, target))
        released = target in RELEASING
        if released:
            self.releases += 1
        return released

    def units(self, states: Iterable[Ownership]) -> list[int]:
        """Units currently in any of ``states``, in unit order."""
        wanted = frozenset(states)
        return sorted(u for u, rec in self._entries.items() if rec.state in wanted)

    def in_flight(self) -> bool:
        """True while some unit is SUBMITTING or SUBMITTED (evidence still expected)."""
        return any(rec.state in IN_FLIGHT for rec in self._entries.values())

    def in_doubt(self) -> bool:
        return any(rec.state is Ownership.IN_DOUBT for rec in self._entries.values())

    def all_released(self) -> bool:
        return all(rec.released for rec in self._entries.values())

    def records(self) -> list[LedgerRecord]:
        return [self._entries[u] for u in sorted(self._entries)]

    def check_integrity(self) -> None:
        """Every history follows the table and ``releases`` counts the released entries."""
        released = 0
        for rec in self._entries.values():
            if rec.history[0] is not Ownership.ADMITTED or rec.history[-1] is not rec.state:
                raise ProtocolError(f"ledger unit {rec.unit}: bad history {rec.history}")
            for a, b in zip(rec.history, rec.history[1:], strict=False):
                if b not in {LEDGER_TABLE.get((a, s)) for s in LedgerStep}:
                    raise ProtocolError(f"ledger unit {rec.unit}: illegal step {a} -> {b}")
            if sum(h in RELEASING for h in rec.history) > 1:
                raise ProtocolError(f"ledger unit {rec.unit}: released twice {rec.history}")
            released += rec.released
        if released != self.releases:
            raise ProtocolError(f"ledger counted {self.releases} releases, entries show {released}")
