"""HostTier: aligned slots addressed by its SlotBuffer, Tier protocol round trip, bad input."""

from __future__ import annotations

import pytest
import torch
from offload_testlib import keys

from kvplane.errors import InvalidArgumentError
from kvplane.ids import SlotId
from kvplane.offload.tiers import ALIGN, HostTier, ReadOutcome, Tier


def test_slots_are_aligned_views_at_their_slot_buffer_runs() -> None:
    host = HostTier(4, 8192)
    assert isinstance(host, Tier)
    assert host.buffer.data_ptr() % ALIGN == 0 and not host.slots.padded
    assert host.pinned == torch.cuda.is_available()
    host.buffer.zero_()
    host.buffer[8192 : 3 * 8192].fill_(7)  # slots 1 and 2 follow on
    sums = [int(host.slot(SlotId(i)).sum()) for i in range(4)]
    assert sums == [0, 7 * 8192, 7 * 8192, 0]
    with pytest.raises(InvalidArgumentError, match="a slot must be an int in"):
        host.slot(SlotId(4))


def test_padded_slots_start_on_alignment() -> None:
    host = HostTier(3, 1000)
    assert host.slot_stride == ALIGN and host.slots.padded
    assert host.slots.run(2) == (2 * ALIGN, 1000)
    assert host.slot(SlotId(2)).data_ptr() - host.slot(SlotId(0)).data_ptr() == 2 * ALIGN
    assert host.slot(SlotId(2)).numel() == 1000


def test_write_read_round_trip_and_bad_input() -> None:
    host = HostTier(2, 64)
    src = [torch.arange(64, dtype=torch.uint8), torch.arange(64, 128, dtype=torch.uint8)]
    host.write([SlotId(1), SlotId(0)], keys(0, 1), src)
    outs = [torch.empty(64, dtype=torch.uint8) for _ in range(2)]
    assert host.read([SlotId(1), SlotId(0)], keys(0, 1), outs) == [ReadOutcome.OK] * 2
    assert torch.equal(outs[0], src[0]) and torch.equal(outs[1], src[1])
    assert host.scan() == {}
    with pytest.raises(InvalidArgumentError):
        host.write([SlotId(2)], keys(0), src[:1])
    with pytest.raises(InvalidArgumentError):
        host.write([SlotId(0)], keys(0), [torch.zeros(63, dtype=torch.uint8)])
    with pytest.raises(InvalidArgumentError):
        host.write([SlotId(0)], keys(0), [torch.zeros(64, dtype=torch.float32)])
    with pytest.raises(InvalidArgumentError):
        host.write([SlotId(0), SlotId(1)], keys(0), src)
    with pytest.raises(InvalidArgumentError):
        HostTier(0, 64)
