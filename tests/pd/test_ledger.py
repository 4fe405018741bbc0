"""The ownership ledger: table-only moves, one release per unit (stateful property test)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, SessionId
from kvplane.pd.ledger import OwnershipLedger
from kvplane.pd.states import IN_FLIGHT, LEDGER_TABLE, RELEASING, LedgerStep, Ownership

O, L = Ownership, LedgerStep  # noqa: E741


def ledger() -> OwnershipLedger:
    return OwnershipLedger(SessionId("s"), PeerId("p"))


def test_the_normal_path_releases_once_and_keeps_history() -> None:
    led = ledger()
    led.admit(0)
    assert led.in_flight() is False
    assert led.step(0, L.BEGIN) is False and led.in_flight()
    assert led.step(0, L.ACCEPT) is False
    assert led.step(0, L.QUIESCE) is True
    assert led.records()[0].history == (O.ADMITTED, O.SUBMITTING, O.SUBMITTED, O.BACKEND_DONE)
    assert led.all_released() and led.releases == 1
    with pytest.raises(ProtocolError, match="backend_done cannot take ledger step quiesce"):
        led.step(0, L.QUIESCE)
    led.check_integrity()


def test_in_doubt_leaves_only_by_its_deadline() -> None:
    led = ledger()
    led.admit(3)
    led.step(3, L.BEGIN)
    assert led.step(3, L.DOUBT) is False and led.in_doubt()
    for step in (L.QUIESCE, L.ACCEPT, L.CANCEL, L.BEGIN, L.DOUBT):
        with pytest.raises(ProtocolError):
            led.step(3, step)
    assert led.step(3, L.EXPIRE) is True and led.state(3) is O.EXPIRED
    assert led.units((O.EXPIRED,)) == [3]


def test_admission_is_once_per_unit_and_unknown_units_are_errors() -> None:
    led = ledger()
    led.admit(1)
    with pytest.raises(ProtocolError, match="already in the ledger"):
        led.admit(1)
    with pytest.raises(ProtocolError, match="not in the ledger"):
        led.step(2, L.BEGIN)
    assert led.can(2, L.BEGIN) is False and 1 in led and len(led) == 1


class LedgerMachine(RuleBasedStateMachine):
    """Random admits and steps (legal or not) against a model of the table."""

    def __init__(self) -> None:
        super().__init__()
        self.led = ledger()
        self.model: dict[int, Ownership] = {}
        self.released: dict[int, int] = {}

    @rule(unit=st.integers(0, 7))
    def admit(self, unit: int) -> None:
        if unit in self.model:
            with pytest.raises(ProtocolError):
                self.led.admit(unit)
        else:
            self.led.admit(unit)
            self.model[unit] = O.ADMITTED
            self.released[unit] = 0

    @rule(unit=st.integers(0, 7), step=st.sampled_from(list(LedgerStep)))
    def step(self, unit: int, step: LedgerStep) -> None:
        target = LEDGER_TABLE.get((self.model[unit], step)) if unit in self.model else None
        if target is None:
            before = self.led.records()
            with pytest.raises(ProtocolError):
                self.led.step(unit, step)
            assert self.led.records() == before
            return
        released = self.led.step(unit, step)
        assert released == (target in RELEASING)
        self.model[unit] = target
        self.released[unit] += released

    @invariant()
    def matches_model(self) -> None:
        assert {r.unit: r.state for r in self.led.records()} == self.model
        assert all(n <= 1 for n in self.released.values())
        assert self.led.releases == sum(self.released.values())
        assert self.led.in_flight() == any(s in IN_FLIGHT for s in self.model.values())
        self.led.check_integrity()


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
