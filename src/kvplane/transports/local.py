"""``local``: byte moves inside one process (torch/NumPy copies, vectorised by ``copier``).

A :class:`LocalTransport` reaches itself (loopback: both pools registered on one transport) and
any other local transport that joined the same :class:`LocalFabric`, an explicit object passed
to each constructor (no module-level registry). ``submit`` copies synchronously in the calling
thread, so every handle is terminal when ``submit`` returns: DONE, or FAILED if the peer left
the fabric or a peer region vanished. While copying, the regions of both sides are pinned, so a
concurrent ``deregister`` on either transport is refused rather than racing the copy. ``notify``
is queued on the peer after the last byte is copied. A move between a GPU tensor and host
memory goes through device staging of up to ``stage_bytes`` per step; the transport's copy
threads (``stop_copy_threads``) share its large CPU copies with the calling thread.
"""

from __future__ import annotations

import threading
import weakref

from kvplane.errors import TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.metrics import MetricsRegistry
from kvplane.transports.base import FailureKind, Peer, XferKind, XferState
from kvplane.transports.batches import Job
from kvplane.transports.copier import STAGE_BYTES, copy_pairs
from kvplane.transports.core import TransportCore
from kvplane.transports.wire import WIRE_VERSION, Metadata, RegionInfo, decode_metadata, encode
from kvplane.validators import require_int


class LocalFabric:
    """The same-process transports that can address one another by agent name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[PeerId, weakref.ref[LocalTransport]] = {}

    def join(self, transport: LocalTransport) -> None:
        with self._lock:
            current = self._members.get(transport.agent)
            if current is not None and current() is not None:
                raise TransportError(f"agent {transport.agent!r} already joined this fabric")
            self._members[transport.agent] = weakref.ref(transport)

    def leave(self, transport: LocalTransport) -> None:
        with self._lock:
            current = self._members.get(transport.agent)
            if current is not None and current() is transport:
                del self._members[transport.agent]

    def get(self, agent: PeerId) -> LocalTransport | None:
        with self._lock:
            ref = self._members.get(agent)
        return None if ref is None else ref()


class LocalTransport(TransportCore):
    """Same-process transport; ``fabric`` shared with the local transports it should reach."""

    name = "local"

    def __init__(
        self,
        *,
        fabric: LocalFabric | None = None,
        agent: str | None = None,
        metrics: MetricsRegistry | None = None,
        history: int = 100_000,
        copy_threads: int | None = None,
        stage_bytes: int = STAGE_BYTES,
    ) -> None:
        stage = require_int("stage_bytes", stage_bytes, min=1)
        super().__init__(agent=agent, metrics=metrics, history=history, copy_threads=copy_threads)
        self._stage_bytes = stage
        self._fabric = fabric if fabric is not None else LocalFabric()
        self._fabric.join(self)

    def stop_copy_threads(self) -> None:
        """Stop the copy helper threads once the copies in progress end; the transport stays
        open and later copies run on the submitting thread alone."""
        self._copy_workers.close()

    def metadata(self) -> bytes:
        self._check_open()
        regions = [RegionInfo(int(e.region.region_id), e.region.length)
                   for e in self._regions.entries()]  # fmt: skip
        return encode(Metadata(WIRE_VERSION, self.name, self.agent, regions=regions))

    def _connect(self, peer_metadata: bytes) -> Peer:
        meta = decode_metadata(peer_metadata, self.name)
        target = self._fabric.get(PeerId(meta.agent))
        if target is None or target.closed:
            raise TransportError(f"no open local transport {meta.agent!r} in this fabric")
        return Peer(target.agent, target._regions.lengths())

    def _start(self, job: Job) -> None:
        batch, src, dst, peer, notify = job.batch, job.src, job.dst, job.peer, job.notify
        target = self if peer.peer_id == self.agent else self._fabric.get(peer.peer_id)
        if target is None or target.closed:
            self._batches.finish(batch, XferState.FAILED, FailureKind.REMOTE_DISCONNECT,
                                 f"local peer {peer.peer_id!r} is gone")  # fmt: skip
            self._batches.quiesce(batch)
            return
        local, remote = (src, dst) if batch.kind is XferKind.WRITE else (dst, src)
        remote_pins: tuple[RegionId, ...] = ()
        if target is not self:  # loopback: submit already pinned and checked both sides
            remote.check_bounds(target._regions.lengths(), f"peer {peer.peer_id!r} (live)")
            remote_pins = target._regions.pin(remote.facts.region_ids.tolist())
        try:
            local_views = self._regions.views(local.facts.region_ids.tolist())
            remote_views = target._regions.views(remote.facts.region_ids.tolist())
            batch.started = True
            views = (local_views, remote_views)
            if batch.kind is XferKind.READ:
                views = (remote_views, local_views)
            copy_pairs(*views, src, dst, self._copy_workers, torch_pool=True,
                       stage_bytes=self._stage_bytes)  # fmt: skip
        finally:
            target._regions.unpin(remote_pins)
        batch.committed = True
        if notify is not None:
            target._deliver(self.agent, notify)
        self._batches.finish(batch, XferState.DONE, quiescent=True)  # unpinned before DONE shows

    def _close(self) -> None:
        self._fabric.leave(self)
