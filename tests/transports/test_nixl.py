"""nixl adapter specifics (skipped without NIXL): address arithmetic, tagging, empty batches."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvplane.ids import PeerId, RegionId
from kvplane.transports.base import DescriptorList, XferKind, XferState
from kvplane.transports.nixl import addresses, probe

pytestmark = pytest.mark.skipif(probe() is not None, reason=str(probe()))


def test_addresses_are_base_plus_offset():
    descs = DescriptorList.of([(2, 5, 10), (1, 0, 3), (2, 0, 1)])
    rows = addresses({RegionId(1): 1000, RegionId(2): 5000}, descs)
    assert rows.dtype == np.uint64
    assert rows.tolist() == [[5005, 10, 0], [1000, 3, 0], [5000, 1, 0]]


def test_loopback_write_and_notify_only_batch(kit):
    from kvplane.transports.nixl import NixlTransport

    t = NixlTransport(agent="nixl-loop")
    try:
        src = t.register(torch.arange(64, dtype=torch.uint8)).region_id
        dst_buf = torch.zeros(64, dtype=torch.uint8)
        dst = t.register(dst_buf).region_id
        peer = t.connect(t.metadata())
        h = t.submit(XferKind.WRITE, kit.one(src, 0, 32), kit.one(dst, 32, 32), peer, notify=b"")
        assert kit.wait(t, h).state is XferState.DONE
        assert dst_buf[32:].tolist() == list(range(32)) and int(dst_buf[:32].sum()) == 0
        h = t.submit(XferKind.WRITE, DescriptorList.empty(), DescriptorList.empty(), peer,
                     notify=b"only")  # fmt: skip
        assert kit.wait(t, h).state is XferState.DONE
        notes: list[tuple[PeerId, bytes]] = []
        end = time.monotonic() + 10
        while len(notes) < 2 and time.monotonic() < end:
            notes += t.notifications()
            time.sleep(1e-3)
        assert sorted(notes) == [(PeerId("nixl-loop"), b""), (PeerId("nixl-loop"), b"only")]
        assert t.pinned_regions() == 0 and t.live_batches() == 0
    finally:
        t.close()
