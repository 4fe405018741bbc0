"""TransportCore.close: batches still live at close end IN_DOUBT once started (an engine call
or thread that did not stop may still move their bytes), FAILED if they never started."""

from __future__ import annotations

import torch

from kvplane.ids import PeerId
from kvplane.transports.base import DescriptorList, FailureKind, Peer, XferKind, XferState
from kvplane.transports.batches import Job
from kvplane.transports.core import TransportCore


class _StuckEngine(TransportCore):
    """Starts the first batch it is given (``begin``) and never finishes any: the engine call
    that ``_close`` could not stop."""

    name = "stuck"

    def _connect(self, peer_metadata: bytes) -> Peer:
        return Peer(PeerId(self.agent), self._regions.lengths())

    def _start(self, job: Job) -> None:
        if not self.live_started():
            self._batches.begin(job.batch)

    def live_started(self) -> bool:
        return any(b.started for b in self._batches.live())


def test_close_reports_a_started_batch_in_doubt_and_a_queued_one_failed() -> None:
    t = _StuckEngine(agent="stuck-close")
    src = t.register(torch.ones(64, dtype=torch.uint8)).region_id
    dst = t.register(torch.zeros(64, dtype=torch.uint8)).region_id
    peer = t.connect(b"")
    started = t.submit(XferKind.WRITE, DescriptorList.of([(src, 0, 32)]),
                       DescriptorList.of([(dst, 0, 32)]), peer)  # fmt: skip
    queued = t.submit(XferKind.WRITE, DescriptorList.of([(src, 32, 32)]),
                      DescriptorList.of([(dst, 32, 32)]), peer)  # fmt: skip
    t.close()
    got = t.poll(started)
    assert (got.state, got.failure) == (XferState.IN_DOUBT, FailureKind.LOCAL_ERROR)
    got = t.poll(queued)
    assert (got.state, got.failure) == (XferState.FAILED, FailureKind.LOCAL_ERROR)
    assert t.live_batches() == 0 and t.pinned_regions() == 0
