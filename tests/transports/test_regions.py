"""RegionTable: overlap refusal, pins, never-reused ids (stateful model check)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvplane.errors import InvalidArgumentError, TransportError
from kvplane.ids import RegionId
from kvplane.transports.regions import RegionTable, byte_view

ARENA = torch.zeros(4096, dtype=torch.uint8)


def test_byte_view_is_a_flat_uint8_alias():
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    v = byte_view(t)
    assert v.dtype == torch.uint8 and v.numel() == 24 and v.data_ptr() == t.data_ptr()
    v[0] = 9
    assert int(t[0, 0]) == 9


@pytest.mark.parametrize("bad", [torch.zeros(0), torch.zeros(4, 4).t(), "tensor"])
def test_register_refuses_bad_buffers(bad):
    with pytest.raises(InvalidArgumentError):
        RegionTable().add(bad)


def test_overlap_refused_and_table_unchanged():
    table = RegionTable()
    r = table.add(ARENA[0:100])
    with pytest.raises(TransportError, match="overlaps region 1"):
        table.add(ARENA[99:200])
    assert len(table) == 1 and table.lengths() == {r.region_id: 100}
    r2 = table.add(ARENA[100:200])  # adjacent is fine
    assert r2.region_id == 2 and r2.base == r.base + 100


def test_pinned_region_cannot_be_removed_until_unpinned():
    table = RegionTable()
    r = table.add(ARENA[0:64])
    pins = table.pin([r.region_id, r.region_id])
    assert pins == (r.region_id,) and table.total_pins() == 1
    with pytest.raises(TransportError, match="in use by 1"):
        table.remove(r.region_id)
    table.unpin(pins)
    table.remove(r.region_id)
    assert len(table) == 0 and table.total_pins() == 0


def test_a_region_being_removed_takes_no_new_pin_until_the_removal_is_undone():
    """Deregistering is check, engine deregistration, removal: between the first and the
    last a concurrent submit must not pin the region (it would outlive its registration)."""
    table = RegionTable()
    r = table.add(ARENA[:64]).region_id
    table.begin_removal(r)
    with pytest.raises(TransportError, match="being deregistered"):
        table.pin([r])
    with pytest.raises(TransportError, match="already being deregistered"):
        table.begin_removal(r)
    table.cancel_removal(r)  # the engine refused: usable again
    assert table.pin([r]) == (r,)
    with pytest.raises(TransportError, match="in use"):
        table.begin_removal(r)
    table.unpin([r])
    table.begin_removal(r)
    table.remove(r)
    assert len(table) == 0 and table.total_pins() == 0


def test_pin_is_all_or_nothing():
    table = RegionTable()
    r = table.add(ARENA[0:64])
    with pytest.raises(TransportError, match="region 7 is not registered"):
        table.pin([r.region_id, 7])
    assert table.total_pins() == 0
    local = table.add(ARENA[64:128], exported=False)
    with pytest.raises(TransportError, match="not exported"):
        table.pin([r.region_id, local.region_id], exported_only=True)
    assert table.total_pins() == 0


class RegionModel(RuleBasedStateMachine):
    """Random register/pin/unpin/remove over 16 slots of a shared arena vs a dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.table = RegionTable()
        self.model: dict[RegionId, tuple[int, int, int]] = {}  # id -> (start, end, pins)
        self.seen: set[int] = set()

    @rule(start=st.integers(0, 15), size=st.integers(1, 4))
    def register(self, start, size):
        lo, hi = start * 256, min(16, start + size) * 256
        clash = any(a < hi and lo < b for a, b, _ in self.model.values())
        if clash:
            with pytest.raises(TransportError):
                self.table.add(ARENA[lo:hi])
        else:
            r = self.table.add(ARENA[lo:hi])
            assert r.region_id not in self.seen
            self.seen.add(r.region_id)
            self.model[r.region_id] = (lo, hi, 0)

    @rule(data=st.data())
    def pin(self, data):
        if self.model:
            rid = data.draw(st.sampled_from(sorted(self.model)))
            self.table.pin([rid])
            lo, hi, p = self.model[rid]
            self.model[rid] = (lo, hi, p + 1)

    @rule(data=st.data())
    def unpin(self, data):
        pinned = sorted(r for r, v in self.model.items() if v[2])
        if pinned:
            rid = data.draw(st.sampled_from(pinned))
            self.table.unpin([rid])
            lo, hi, p = self.model[rid]
            self.model[rid] = (lo, hi, p - 1)

    @rule(data=st.data())
    def remove(self, data):
        if self.model:
            rid = data.draw(st.sampled_from(sorted(self.model)))
            if self.model[rid][2]:
                with pytest.raises(TransportError, match="in use"):
                    self.table.remove(rid)
            else:
                self.table.remove(rid)
                del self.model[rid]

    @invariant()
    def matches_model(self):
        assert self.table.lengths() == {r: hi - lo for r, (lo, hi, _) in self.model.items()}
        assert self.table.total_pins() == sum(p for _, _, p in self.model.values())


TestRegionModel = RegionModel.TestCase
TestRegionModel.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
