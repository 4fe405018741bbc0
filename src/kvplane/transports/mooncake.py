"""``mooncake``: adapter over the Mooncake Transfer Engine (tcp protocol, P2P handshake).

The engine is imported only here. One-sided: peers must reconnect before deregistered memory is
reused. See docs/transports.md.
"""

from __future__ import annotations

import base64
import contextlib
import queue
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvplane.errors import InvalidArgumentError, TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.metrics import MetricsRegistry
from kvplane.transports.base import (
    FailureKind,
    Int64Array,
    Peer,
    XferKind,
    XferState,
)
from kvplane.transports.batches import Job
from kvplane.transports.copier import coalesce
from kvplane.transports.core import TransportCore
from kvplane.transports.pointers import addresses, local_bases, peer_tables, region_infos
from kvplane.transports.regions import RegionEntry
from kvplane.transports.registry import engine_missing, import_engine
from kvplane.transports.wire import WIRE_VERSION, Metadata, decode_metadata, encode
from kvplane.transports.workers import JobThread

INSTALL_HINT = (
    "Mooncake Transfer Engine is not installed: pip install mooncake-transfer-engine-non-cuda "
    "and apt-get install -y libibverbs1"
)
SUB_BATCH = 512
"""Descriptors per engine call."""
_MAILBOX = 64


def probe() -> str | None:
    """None if the engine can be imported here, else why not and how to install it."""
    return engine_missing("mooncake.engine", INSTALL_HINT)  # ImportError, or libibverbs missing


@dataclass(frozen=True, slots=True)
class _Remote:
    session: str
    bases: dict[RegionId, int]
    mailbox: int


def _peer_alive(session: str) -> bool:
    host, _, port = session.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


class MooncakeTransport(TransportCore):
    """Mooncake Transfer Engine as a kvplane transport (CPU memory, tcp protocol)."""

    name = "mooncake"
    _cpu_only = True

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        agent: str | None = None,
        metrics: MetricsRegistry | None = None,
        history: int = 100_000,
    ) -> None:
        engine = import_engine("mooncake.engine", INSTALL_HINT)
        if not isinstance(host, str) or not host:
            raise InvalidArgumentError(f"host must be a non-empty string, got {host!r}")
        super().__init__(agent=agent, metrics=metrics, history=history)
        self._notify_cls: Any = engine.TransferNotify
        ops = engine.TransferOpcode
        self._ops: Any = {XferKind.WRITE: ops.Write, XferKind.READ: ops.Read}
        self._engine: Any = engine.TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise TransportError(f"Mooncake engine failed to initialise on {host}")
        self.address = f"{host}:{self._engine.get_rpc_port()}"
        self._mailbox = torch.zeros(_MAILBOX, dtype=torch.uint8)
        if self._engine.register_memory(self._mailbox.data_ptr(), _MAILBOX) != 0:
            raise TransportError("Mooncake engine refused to register the mailbox")
        self._remotes: dict[PeerId, _Remote] = {}
        self._worker = JobThread(f"kvplane-mooncake-{self.agent}-worker", self._work)

    # -- memory and metadata -------------------------------------------------------------------
    def _on_register(self, entry: RegionEntry) -> None:
        r = entry.region
        if self._engine.register_memory(r.base, r.length) != 0:
            raise TransportError(f"Mooncake refused to register region {r.region_id}")

    def _on_deregister(self, entry: RegionEntry) -> None:
        self._engine.unregister_memory(entry.region.base)

    def metadata(self) -> bytes:
        self._check_open()
        regions = region_infos(self._regions.entries())
        mailbox = self._mailbox.data_ptr().to_bytes(8, "little")
        meta = Metadata(WIRE_VERSION, self.name, self.agent, self.address, "", regions, mailbox)
        return encode(meta)

    def _connect(self, peer_metadata: bytes) -> Peer:
        meta = decode_metadata(peer_metadata, self.name)
        if len(meta.engine) != 8:
            raise TransportError(f"mooncake metadata of {meta.agent!r} lacks a mailbox address")
        peer, bases = peer_tables(meta)
        remote = _Remote(meta.address, bases, int.from_bytes(meta.engine, "little"))
        with self._lock:
            self._remotes[peer.peer_id] = remote
        return peer

    # -- transfers -----------------------------------------------------------------------------
    def _start(self, job: Job) -> None:
        with self._lock:
            remote = self._remotes[job.peer.peer_id]
        self._worker.put((job, remote))

    def _call(self, remote: _Remote, kind: XferKind, lists: list[list[int]], notify: Any) -> int:
        rc = int(self._engine.batch_transfer_sync(remote.session, *lists, self._ops[kind], notify))
        if rc != 0:  # retry once: the engine's first transfer after an idle period may fail
            rc = int(
                self._engine.batch_transfer_sync(remote.session, *lists, self._ops[kind], notify)
            )
        return rc

    def _run(self, job: Job, remote: _Remote) -> None:
        batch = job.batch
        src, dst = coalesce(job.src, job.dst, min_gain=1.0)  # fewer engine requests
        local, far = (src, dst) if batch.kind is XferKind.WRITE else (dst, src)
        bases = local_bases(self._regions.entries())
        local_addr = addresses(bases, local, "Mooncake")
        far_addr = addresses(remote.bases, far, "Mooncake")
        lengths = src.lengths
        kind = batch.kind
        if not len(src):  # notify-only: one mailbox byte carries it
            local_addr = np.array([self._mailbox.data_ptr()], dtype=np.int64)
            far_addr, lengths, kind = np.array([remote.mailbox]), np.array([1]), XferKind.WRITE
        notify = None
        if job.notify is not None:
            notify = self._notify_cls(self.agent, base64.b64encode(job.notify).decode())
        n = len(lengths)
        for a in range(0, n, SUB_BATCH):
            if batch.terminal:
                return
            b = min(n, a + SUB_BATCH)
            lists = [local_addr[a:b].tolist(), far_addr[a:b].tolist(), lengths[a:b].tolist()]
            if self._call(remote, kind, lists, notify if b == n else None) != 0:
                failure = (FailureKind.BACKEND_ERROR if _peer_alive(remote.session)
                           else FailureKind.REMOTE_DISCONNECT)  # fmt: skip
                # the engine call returned: nothing touches it, so unpinned before FAILED shows
                self._batches.finish(batch, XferState.FAILED, failure,
                                     f"Mooncake transfer to {remote.session} failed",
                                     quiescent=True)  # fmt: skip
                return
            if b < n:
                batch.bytes_done += int(lengths[a:b].sum())
        # every engine call returned: unpinned before DONE shows, a caller may deregister then
        self._batches.finish(batch, XferState.DONE, quiescent=True)

    def _work(self, jobs: queue.SimpleQueue[tuple[Job, _Remote] | None]) -> None:
        """The worker thread: each batch in turn, with the peer as it was at submit (one that
        ended while queued, by cancel, deadline or close, is only released)."""
        while (item := jobs.get()) is not None:
            job = item[0]
            if self._batches.begin(job.batch):
                try:
                    self._run(*item)
                except Exception as exc:  # an engine exception fails this batch, not the worker
                    self._batches.finish(job.batch, XferState.FAILED, FailureKind.BACKEND_ERROR,
                                         repr(exc))  # fmt: skip
            self._batches.quiesce(job.batch)

    def notifications(self) -> list[tuple[PeerId, bytes]]:
        engine = self._engine  # None once closed
        for note in engine.get_notifies() if engine is not None else ():
            with contextlib.suppress(ValueError):
                self._deliver(PeerId(str(note.name)), base64.b64decode(note.msg, validate=True))
        return super().notifications()

    def _close(self) -> None:
        self._worker.stop(60.0)
        with contextlib.suppress(Exception):
            self._engine.unregister_memory(self._mailbox.data_ptr())

    def close(self) -> None:
        """Close as every transport does, then destroy the engine here, not later.

        The engine's destructor stops its threads while holding the GIL (0.7 s here). Left to
        the garbage collector (a transport sits in reference cycles), it ran at an arbitrary
        moment and froze every thread of the process that long: PD leases of 0.6 s expired in
        a pipeline that happened to be running then.
        """
        super().close()
        with self._lock:
            engine, self._engine = self._engine, None
        del engine  # the last reference: the engine stops now, on the closing thread


class RawMooncakeWriter:
    """The raw engine API with nothing of kvplane in between: the bench's limit for the adapter.

    A fresh engine registers ``buffer``; :meth:`write` issues ``batch_transfer_sync_write`` in
    sub-batches of ``SUB_BATCH`` (the engine's own limit) with the same retry-once rule.
    """

    def __init__(self, peer_metadata: bytes, buffer: torch.Tensor, host: str = "127.0.0.1") -> None:
        from mooncake.engine import TransferEngine

        meta = decode_metadata(peer_metadata, "mooncake")
        self._engine: Any = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise TransportError("raw Mooncake engine failed to initialise")
        self._base = buffer.data_ptr()
        if self._engine.register_memory(self._base, buffer.numel() * buffer.element_size()) != 0:
            raise TransportError("raw Mooncake engine refused the buffer")
        self._session = meta.address
        self._bases = {r.region_id: r.base for r in meta.regions}

    def write(self, src_offsets: Int64Array, region: int, dst_offsets: Int64Array,
              lengths: Int64Array) -> None:  # fmt: skip
        srcs = (self._base + src_offsets).tolist()
        dsts = (self._bases[region] + dst_offsets).tolist()
        lens = lengths.tolist()
        for a in range(0, len(lens), SUB_BATCH):
            part = (srcs[a : a + SUB_BATCH], dsts[a : a + SUB_BATCH], lens[a : a + SUB_BATCH])
            rc = self._engine.batch_transfer_sync_write(self._session, *part)
            if rc != 0:
                rc = self._engine.batch_transfer_sync_write(self._session, *part)
            if rc != 0:
                raise TransportError(f"raw Mooncake write failed ({rc})")

    def close(self) -> None:
        """Unregister the buffer; destroy the engine now (see :meth:`MooncakeTransport.close`)."""
        with contextlib.suppress(Exception):
            self._engine.unregister_memory(self._base)
        self._engine = None
