"""What every kvplane transport shares: validation, the region and batch tables, poll semantics.

:class:`TransportCore` implements the :class:`~kvplane.transports.base.Transport` protocol's
bookkeeping once: submit checks before any state changes, pins, deadlines, cancel, a fail-closed
``close`` and a blocking ``wait``. An implementation fills in only hooks (``_connect``,
``_start`` and, where needed, ``_progress``, ``_abort``, ``_close``, ``_on_register``,
``_on_deregister``); the core moves no byte itself. See docs/transports.md ("Shared bookkeeping").
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable

import torch

from kvplane.errors import InvalidArgumentError, PlanError, TransportError, UnknownPeerError
from kvplane.ids import PeerId, RegionId
from kvplane.metrics import MetricsRegistry
from kvplane.transports.base import (
    DescriptorList,
    FailureKind,
    Handle,
    Peer,
    Poll,
    Region,
    XferKind,
    XferState,
)
from kvplane.transports.batches import Batch, BatchTable, Job
from kvplane.transports.checks import check_batch, vouched
from kvplane.transports.copier import check_no_cross_overlap
from kvplane.transports.regions import RegionEntry, RegionTable, byte_view
from kvplane.transports.wire import MAX_NOTIFY_BYTES
from kvplane.transports.workers import CopyWorkers
from kvplane.validators import require_finite_positive, require_index


def check_agent(agent: str | None, name: str) -> PeerId:
    """A valid agent name (given, or ``<transport>-<pid>-<random>``)."""
    if agent is None:
        return PeerId(f"{name}-{os.getpid()}-{secrets.token_hex(4)}")
    if not isinstance(agent, str) or not agent or len(agent) > 200 or not agent.isprintable():
        raise InvalidArgumentError(f"agent must be a printable name of 1..200 chars, got {agent!r}")
    return PeerId(agent)


def as_region_id(value: object) -> RegionId:
    """``value`` as a RegionId: an int or NumPy integer (not a bool) in ``[0, 2**63)``, the
    range of a descriptor's int64 region column; ``InvalidArgumentError`` otherwise."""
    return RegionId(require_index("region_id", value, 2**63))


class TransportCore:
    """Shared implementation of the Transport protocol; subclasses set ``name`` and hooks."""

    name: str = "core"
    _spin_wait = False
    """``wait`` re-polls without sleeping (engines that progress only when polled)."""
    _cpu_only = False
    """``register`` refuses a tensor not in CPU memory (engines that address host memory only)."""

    def __init__(
        self,
        *,
        agent: str | None = None,
        metrics: MetricsRegistry | None = None,
        history: int = 100_000,
        copy_threads: int | None = None,
    ) -> None:
        copy_workers = CopyWorkers(copy_threads, name=f"kvplane-{self.name}-copy")  # checks it
        self.agent = check_agent(agent, self.name)
        self.metrics = metrics if metrics is not None else MetricsRegistry()
        self._regions = RegionTable()
        self._batches = BatchTable(self.name, self._regions.unpin, self.metrics, history)
        self._peers: dict[PeerId, Peer] = {}
        self._notes: collections.deque[tuple[PeerId, bytes]] = collections.deque()
        self._lock = threading.RLock()
        self._closed = False
        self._copy_workers = copy_workers
        """Threads for large CPU copies (``copy_threads``, default torch's thread count; the
        helpers start on first use and stop at ``close``)."""

    # -- hooks ---------------------------------------------------------------------------------
    def _on_register(self, entry: RegionEntry) -> None:
        """Engine-side registration of a new region (raise ``TransportError`` to refuse)."""

    def _on_deregister(self, entry: RegionEntry) -> None:
        """Engine-side deregistration (the region is unpinned)."""

    def _exported(self, view: torch.Tensor) -> tuple[bool, object]:
        """Whether peers may address a new region, and implementation data to keep with it
        (the default: exported, nothing kept; a ``TransportError`` off-CPU if ``_cpu_only``)."""
        if self._cpu_only and view.device.type != "cpu":
            raise TransportError(f"the {self.name} adapter registers CPU memory, got {view.device}")
        return True, None

    def _connect(self, peer_metadata: bytes) -> Peer:
        raise NotImplementedError

    def _start(self, job: Job) -> None:
        raise NotImplementedError

    def _progress(self, batch: Batch) -> None:
        """Advance an engine-polled batch (called by ``poll`` while it is PENDING)."""

    def _abort(self, batch: Batch) -> None:
        """Stop working on a batch that ended by deadline or cancel (best effort)."""

    def _close(self) -> None:
        """Stop threads and connections; afterwards no batch memory is touched."""

    # -- the Transport protocol ----------------------------------------------------------------
    def register(self, buffer: torch.Tensor) -> Region:
        self._check_open()
        exported, extra = self._exported(byte_view(buffer))
        region = self._regions.add(buffer, exported=exported, extra=extra)
        try:
            self._on_register(self._regions.entry(region.region_id))
        except BaseException:
            self._regions.remove(region.region_id)
            raise
        return region

    def deregister(self, region_id: RegionId) -> None:
        self._check_open()
        rid = as_region_id(region_id)
        entry = self._regions.begin_removal(rid)  # no submit can pin it from here on
        try:
            self._on_deregister(entry)
        except BaseException:
            self._regions.cancel_removal(rid)
            raise
        self._regions.remove(rid)

    def connect(self, peer_metadata: bytes) -> Peer:
        self._check_open()
        peer = self._connect(peer_metadata)
        with self._lock:
            self._peers[peer.peer_id] = peer
        return peer

    def submit(
        self,
        kind: XferKind,
        src: DescriptorList,
        dst: DescriptorList,
        peer: Peer,
        *,
        notify: bytes | None = None,
        deadline_s: float = 30.0,
    ) -> Handle:
        self._check_open()
        known = self._check_submit(kind, src, dst, peer, notify=notify, deadline_s=deadline_s)
        local = src if kind is XferKind.WRITE else dst
        ids = local.facts.region_ids.tolist()
        if known.peer_id == self.agent:  # loopback: the far side is our own memory too
            ids += (dst if kind is XferKind.WRITE else src).facts.region_ids.tolist()
        with self._lock:  # a batch exists only while open: close fails every one it lists
            self._check_open()
            pins = self._regions.pin(ids)
            batch = self._batches.new(known.peer_id, kind, src.total_bytes, float(deadline_s),
                                      pins)  # fmt: skip
        try:
            self._start(Job(batch, src, dst, known, notify))
        except PlanError:
            self._batches.finish(batch, XferState.FAILED, FailureKind.LOCAL_ERROR, "refused")
            self._batches.quiesce(batch)
            raise
        except Exception as exc:  # an engine error is a FAILED result, not an exception
            # ... or IN_DOUBT once started: some of its bytes may have landed
            self._batches.finish(batch, XferState.FAILED, FailureKind.BACKEND_ERROR, repr(exc),
                                 doubt_if_started=True)  # fmt: skip
            self._batches.quiesce(batch)
        return batch.handle

    def poll(self, handle: Handle) -> Poll:
        found = self._batches.lookup(handle)
        if isinstance(found, Poll):
            return found
        if not found.terminal:
            self._progress(found)
        if not found.terminal and time.monotonic() > found.deadline:
            self._end_early(found, FailureKind.TIMEOUT, "deadline passed")
        return found.poll()

    def wait(self, handle: Handle, timeout_s: float | None = None) -> Poll:
        """Block until the batch is terminal, or ``timeout_s`` passes (then the last poll).
        Not part of the Transport protocol: a convenience that wakes as soon as the batch ends
        instead of sleeping between polls (and lets I/O threads have the GIL meanwhile)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            got = self.poll(handle)
            now = time.monotonic()
            if got.state.terminal or (end is not None and now >= end):
                return got
            found = self._batches.lookup(handle)
            if isinstance(found, Batch) and not self._spin_wait:
                event = self._batches.done_event(found)
                event.wait(0.005 if end is None else min(0.005, end - now))

    def on_done(self, handle: Handle, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once when the batch ends, on the thread that ends it (at once if it
        already has). Not part of the Transport protocol: a completion hook for drivers that
        would otherwise park a thread in :meth:`wait`. ``fn`` must be cheap and not raise; the
        state still comes from ``poll``. Note a batch also ends by deadline only when polled."""
        self._batches.on_done(handle, fn)

    def cancel(self, handle: Handle) -> None:
        found = self._batches.lookup(handle)
        if isinstance(found, Batch) and not found.terminal:
            found.cancel_requested = True
            self._end_early(found, FailureKind.CANCELLED, "cancelled")

    def notifications(self) -> list[tuple[PeerId, bytes]]:
        out: list[tuple[PeerId, bytes]] = []
        while self._notes:
            out.append(self._notes.popleft())
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # first, before _close takes links down (whose own rule would say REMOTE_DISCONNECT):
        # a started batch may still be moving bytes (a thread or engine call that does not stop
        # at once): IN_DOUBT, as for cancel, so no caller reuses memory it may still touch
        self._batches.fail_all(self._batches.live(), FailureKind.LOCAL_ERROR, "transport closed",
                               doubt_if_started=True)  # fmt: skip
        self._close()
        self._copy_workers.close()
        live = self._batches.live()  # whatever _close left unreleased is released now
        self._batches.fail_all(live, FailureKind.LOCAL_ERROR, "transport closed",
                               doubt_if_started=True)  # fmt: skip
        for batch in live:
            self._batches.quiesce(batch)
        for entry in self._regions.clear():
            with contextlib.suppress(Exception):  # closing: an engine that already let go is fine
                self._on_deregister(entry)
        with self._lock:
            self._peers.clear()

    # -- helpers for implementations and tests -------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def pinned_regions(self) -> int:
        """Total pins held (0 when no batch, ours or a peer's, may touch our memory)."""
        return self._regions.total_pins()

    def live_batches(self) -> int:
        """Batches not yet both terminal and quiescent."""
        return len(self._batches.live())

    def regions(self) -> list[Region]:
        return [e.region for e in self._regions.entries()]

    def _deliver(self, peer_id: PeerId, payload: bytes) -> None:
        self._notes.append((peer_id, payload))

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.name} transport {self.agent!r} is closed")

    def _end_early(self, batch: Batch, failure: FailureKind, reason: str) -> None:
        """End a batch now by cancel or deadline: FAILED if it never started, else IN_DOUBT.
        A started batch's bytes may still land after this (tcp: already in the socket; shm,
        NIXL, Mooncake: a copy or engine call that cannot be interrupted), so FAILED, which
        lets the caller reuse the memory, is only said of a batch that never moved a byte."""
        if self._batches.finish(batch, XferState.FAILED, failure, reason, doubt_if_started=True):
            self._abort(batch)

    def _check_submit(
        self, kind: XferKind, src: DescriptorList, dst: DescriptorList, peer: Peer, *,
        notify: bytes | None, deadline_s: float,
    ) -> Peer:  # fmt: skip
        """The connected peer, once the arguments are sane and the batch is safe: lists vouched
        by :mod:`~kvplane.transports.checks` (a validated plan's ops, or lists checked before)
        pay only for their regions still being registered and long enough, O(regions); raw
        lists go through :func:`~kvplane.transports.checks.check_batch`. Loopback also refuses
        a destination byte inside a source range (one memory: not a fact of the lists)."""
        if not isinstance(kind, XferKind):
            raise InvalidArgumentError(f"kind must be an XferKind, got {kind!r}")
        if not isinstance(src, DescriptorList) or not isinstance(dst, DescriptorList):
            raise InvalidArgumentError("src and dst must be DescriptorList values")
        if not isinstance(peer, Peer):
            raise InvalidArgumentError(f"peer must be a Peer, got {type(peer).__name__}")
        require_finite_positive("deadline_s", deadline_s, InvalidArgumentError)
        if notify is not None and (not isinstance(notify, bytes) or len(notify) > MAX_NOTIFY_BYTES):
            raise InvalidArgumentError(
                f"notify must be None or bytes of at most {MAX_NOTIFY_BYTES} bytes, got "
                f"{type(notify).__name__} {notify[:16] if isinstance(notify, bytes) else notify!r}"
            )
        with self._lock:
            known = self._peers.get(peer.peer_id)
        if known is None:
            raise UnknownPeerError(f"peer {peer.peer_id!r} is not connected to {self.agent!r}")
        ours, theirs = self._regions.lengths(), known.regions
        far = f"peer {known.peer_id!r}"
        if kind is XferKind.WRITE:
            lengths, tables = (ours, theirs), ("local", far)
        else:
            lengths, tables = (theirs, ours), (far, "local")
        proof = vouched(src, dst)
        if proof is None:
            check_batch(src, dst, *lengths, tables=tables)
        else:  # proved before: only its regions may have changed since
            proof.check_regions(*lengths, tables=tables)
        if known.peer_id == self.agent:
            check_no_cross_overlap(src, dst)
        return known
