"""``shm``: processes on one host copy straight into each other's memory.

Sealed memfd segments passed by SCM_RIGHTS; PIN, copy, COMMIT per batch. See
docs/transports.md.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Unpack

import numpy as np
import torch

from kvplane.errors import (
    IncompatiblePeerError,
    KVPlaneError,
    MalformedMessageError,
    TransportError,
)
from kvplane.ids import PeerId, RegionId
from kvplane.transports.base import FailureKind, Peer, XferKind, XferState
from kvplane.transports.batches import Job
from kvplane.transports.channel import MAX_FDS, Channel, Link
from kvplane.transports.copier import copy_pairs
from kvplane.transports.stream import LinkState, StreamOptions, StreamTransport
from kvplane.transports.wire import (
    FLAG_ERROR,
    FLAG_NOTIFY,
    FrameType,
    Header,
    SegmentInfo,
    Welcome,
    decode_metadata,
    pack_header,
)
from kvplane.validators import require_size

_PIN_POLL_S = 0.05
"""How often a sender waiting for PINNED re-checks for cancel, deadline and link loss."""
_SENDER_STOP_S = 5.0
"""How long, past ``link_drain_s``, a dead link's receiver waits for its sender to stop before
leaving the peer's mappings to ``close``."""
PIN_AHEAD = 8
"""Most queued jobs whose PINs a sender sends ahead of running them."""


MADV_POPULATE_WRITE = 23
"""Linux's ``madvise`` advice (5.14+) that fills a range's page tables as if each page were written
(Python 3.11's ``mmap`` module does not name it)."""


def _map(fd: int, nbytes: int) -> mmap.mmap:
    """A shared mapping of a segment whose page tables are filled at once, writable and dirty.

    Without that, the first copy into each 4 KiB page of a peer's pool paid a page fault (which
    made a 4.7 MiB slice copy several times slower than memcpy). Filling them by
    ``MAP_POPULATE`` is not enough: it maps pages clean, and the first write to each page then
    makes the CPU set the page-table entry's dirty bit, a slow assist under virtualisation --
    measured here, a 36 MiB copy into a peer's pool took 7.5 ms the first time and 4.4 ms after.
    ``MADV_POPULATE_WRITE`` installs the entries as a write fault would (dirty), without writing
    a byte, so it is safe while the owner or other peers use the memory. Kernels without it get
    ``MAP_POPULATE``. Costs about 0.1 ms per MiB, once per mapping."""
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except OSError:  # before Linux 5.14 (EINVAL): populate clean
        mapping.close()
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    return mapping


_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""Seals of every segment we create: its size is fixed for good (so no mapping of it can fault)."""


def _check_segment(fd: int, length: int) -> None:
    """``MalformedMessageError`` unless the peer's segment ``fd`` is sealed against shrinking
    and holds at least ``length`` bytes: only then can no later truncation fault our copies."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise MalformedMessageError(f"a WELCOME segment is not a sealable memfd: {exc}") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise MalformedMessageError("a WELCOME segment is not sealed against shrinking")
    if size < length:
        raise MalformedMessageError(f"a WELCOME segment of {size} bytes claims {length}")


def host_id() -> str:
    """This machine's identity for the same-host check: the kernel boot id."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: fall back to the host name
        return socket.gethostname()


@dataclass(slots=True)
class _Segment:
    fd: int
    mapping: mmap.mmap
    tensor: torch.Tensor


@dataclass(slots=True)
class _ShmLink(LinkState):
    """Initiator state: the peer's mapped segments and region views, pending PIN replies."""

    mappings: dict[int, mmap.mmap] = field(default_factory=dict)
    views: dict[RegionId, torch.Tensor] = field(default_factory=dict)
    pin_replies: dict[int, str] = field(default_factory=dict)
    pin_ready: threading.Condition = field(default_factory=threading.Condition)
    pinned_ahead: set[int] = field(default_factory=set)
    """Transfer ids whose PIN went out before their job ran (only the sender thread uses it)."""


class ShmTransport(StreamTransport):
    """Same-host transport over shared memory; allocate peer-visible memory with ``allocate``.

    ``target_stall_s``: a peer that holds pins on our regions and sends no frame for this long
    (no COMMIT, ABORT, next PIN) is dropped and its pins released, as on ``tcp``. Its copies
    send nothing, so it also bounds one batch's copy (60 s: hundreds of GB at memcpy speed)."""

    name = "shm"
    link_drain_s = 5.0
    """The target releases a connection's pins when it sees EOF: a copy into its memory that
    is running when the link fails (our close, a lost receiver) ends before that."""

    def __init__(self, **options: Unpack[StreamOptions]) -> None:
        super().__init__(**options)
        self._segments: dict[int, _Segment] = {}
        self._next_segment = 1
        self.address = f"kvplane-shm-{os.getpid()}-{secrets.token_hex(8)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + self.address)  # abstract namespace: nothing on the file system
        sock.listen()
        self._listen(sock)

    # -- memory ----------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zeroed ``uint8`` tensor of ``nbytes`` in a new shared segment (register to export)."""
        self._check_open()
        require_size("nbytes", nbytes, min=1)
        with self._lock:
            if len(self._segments) >= MAX_FDS:
                raise TransportError(f"at most {MAX_FDS} shared segments per transport")
            seg_id = self._next_segment
            self._next_segment += 1
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        fd = os.memfd_create(f"kvplane-{self.agent}-{seg_id}", flags)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # peers check it: see ``_check_segment``
            mapping = _map(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            raise TransportError(f"cannot allocate {nbytes} shared bytes: {exc}") from None
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        with self._lock:
            self._segments[seg_id] = _Segment(fd, mapping, tensor)
        return tensor

    def _exported(self, view: torch.Tensor) -> tuple[bool, object]:
        if view.device.type != "cpu":
            raise TransportError(f"shm registers CPU memory only, got a tensor on {view.device}")
        start = view.data_ptr()
        end = start + view.numel() * view.element_size()
        with self._lock:
            for seg_id, seg in self._segments.items():
                base = seg.tensor.data_ptr()
                if base <= start and end <= base + seg.tensor.numel():
                    return True, (seg_id, start - base)
        return False, None

    def _welcome(self) -> tuple[Welcome, list[int]]:
        regions = self._region_infos()  # first: segments only grow, so each one's is listed
        with self._lock:
            segs = dict(self._segments)
        infos = [SegmentInfo(i, s.tensor.numel()) for i, s in segs.items()]
        return Welcome(regions, infos, self._idle_ms()), [s.fd for s in segs.values()]

    def _host(self) -> str:
        return host_id()

    # -- connecting ------------------------------------------------------------------------------
    def _connect(self, peer_metadata: bytes) -> Peer:
        meta = decode_metadata(peer_metadata, self.name)
        if meta.host != host_id():
            raise IncompatiblePeerError(f"shm peer {meta.agent!r} runs on another host")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._connect_timeout)
        ch = Channel(sock)
        agent, welcome, fds = self._handshake(
            ch, meta.agent, failure=f"cannot reach shm peer {meta.agent!r}",
            address="\0" + meta.address, with_fds=True,
        )  # fmt: skip
        try:
            if agent != meta.agent or len(fds) != len(welcome.segments):
                raise MalformedMessageError(f"bad WELCOME from {agent!r} (expected {meta.agent!r})")
            for info, fd in zip(welcome.segments, fds, strict=True):
                _check_segment(fd, info.length)  # before mapping: a shrunk segment would SIGBUS
            mappings = {s.segment: _map(fd, s.length) for s, fd in
                        zip(welcome.segments, fds, strict=True)}  # fmt: skip
            views = {}  # checked before the link exists: a bad WELCOME installs nothing
            for r in welcome.regions:
                seg = mappings.get(r.segment)
                if seg is None or r.segment_offset + r.length > len(seg):
                    raise MalformedMessageError(f"region {r.region_id} lies outside its segment")
                whole = torch.frombuffer(seg, dtype=torch.uint8)
                views[RegionId(r.region_id)] = whole.narrow(0, r.segment_offset, r.length)
        except BaseException:
            ch.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        peer, state = self._install(PeerId(agent), ch, welcome)
        assert isinstance(state, _ShmLink)
        state.mappings, state.views = mappings, views  # in-flight jobs keep their old views
        return peer

    def _new_state(self, peer_id: PeerId) -> _ShmLink:
        return _ShmLink(peer_id)

    # -- initiator -------------------------------------------------------------------------------
    def _run(self, state: LinkState, job: object) -> None:
        assert isinstance(state, _ShmLink) and state.link is not None and isinstance(job, Job)
        batch, link = job.batch, state.link
        xid = batch.handle.xfer_id
        sent = xid in state.pinned_ahead
        state.pinned_ahead.discard(xid)
        if not self._batches.begin(batch):  # ended while queued
            if sent:
                with state.pin_ready:
                    state.pin_replies.pop(xid, None)
                if not link.down:
                    link.ch.send_frame(FrameType.ABORT, xid)  # releases the pin sent ahead
            self._batches.quiesce(batch)
            return
        if not sent:
            self._send_pin(link, job)
        self._pin_ahead(state, link)
        remote = job.dst if batch.kind is XferKind.WRITE else job.src
        ids = remote.facts.region_ids
        with state.pin_ready:
            while xid not in state.pin_replies and not batch.terminal and not link.down:
                state.pin_ready.wait(_PIN_POLL_S)
            refused = state.pin_replies.pop(xid, None)
        if refused:  # the peer could not pin (region gone or not exported): nothing pinned
            self._batches.finish(batch, XferState.FAILED, FailureKind.BACKEND_ERROR, refused)
            self._batches.quiesce(batch)
            return
        if refused is None or batch.terminal or link.down:  # cancelled, timed out, link down
            if not link.down:
                link.ch.send_frame(FrameType.ABORT, xid)  # releases a pin granted later
            self._batches.quiesce(batch)
            return
        local = self._regions.views(
            (job.src if remote is job.dst else job.dst).facts.region_ids.tolist()
        )
        peer_views = {RegionId(int(r)): state.views[RegionId(int(r))] for r in ids}
        if batch.kind is XferKind.WRITE:
            copy_pairs(local, peer_views, job.src, job.dst, self._copy_workers)
        else:
            copy_pairs(peer_views, local, job.src, job.dst, self._copy_workers)
        committed = self._batches.commit(batch)
        self._batches.quiesce(batch)  # the copy is over: unpinned before the ACK can end it
        if committed:
            flags = 0 if job.notify is None else FLAG_NOTIFY
            link.ch.send_frame(FrameType.COMMIT, xid, job.notify or b"", flags=flags)
        else:
            link.ch.send_frame(FrameType.ABORT, xid)

    @staticmethod
    def _send_pin(link: Link, job: Job) -> None:
        remote = job.dst if job.batch.kind is XferKind.WRITE else job.src
        ids = remote.facts.region_ids
        xid = job.batch.handle.xfer_id
        link.ch.send(pack_header(FrameType.PIN, xid, 8 * len(ids), len(ids)) + ids.tobytes())

    def _pin_ahead(self, state: _ShmLink, link: Link) -> None:
        """Send the PINs of jobs queued behind the running one (at most :data:`PIN_AHEAD`
        outstanding); their replies wait in ``pin_replies`` until the jobs run."""
        for job in link.queued():
            if len(state.pinned_ahead) >= PIN_AHEAD:
                return
            if not isinstance(job, Job) or job.batch.terminal:
                continue
            if job.batch.handle.xfer_id not in state.pinned_ahead:
                self._send_pin(link, job)
                state.pinned_ahead.add(job.batch.handle.xfer_id)

    def _on_frame(self, state: LinkState, h: Header) -> None:
        assert isinstance(state, _ShmLink) and state.link is not None
        body = state.link.ch.recv_body(h)
        if h.ftype is FrameType.PINNED:
            batch = self._batches.by_id(h.xfer_id)
            if batch is None or batch.terminal:
                return  # the sender gave up waiting and sent ABORT
            refused = ""  # "" is granted, so a refusal always carries a reason
            if h.flags & FLAG_ERROR:
                refused = body.decode(errors="replace") or "pin refused, no reason given"
            with state.pin_ready:
                state.pin_replies[h.xfer_id] = refused
                state.pin_ready.notify_all()
        elif h.ftype is FrameType.ACK:
            batch = self._batches.by_id(h.xfer_id)
            if batch is None:
                return
            if h.flags & FLAG_ERROR:
                self._batches.finish(batch, XferState.FAILED, FailureKind.BACKEND_ERROR,
                                     body.decode(errors="replace"))  # fmt: skip
            else:
                self._batches.finish(batch, XferState.DONE)
        else:
            raise MalformedMessageError(f"unexpected {h.ftype.name} frame from the shm target")

    def _on_recv_exit(self, state: LinkState) -> None:
        """The link is down (peer gone, or our close): wake a sender waiting for PINNED; once
        the sender has stopped, forget the link and drop the peer's mappings. Peers come back
        under new agent names, so a dead peer's state would otherwise stay (its segments
        mapped) until ``close``."""
        assert isinstance(state, _ShmLink)
        with state.pin_ready:
            state.pin_ready.notify_all()
        link = state.link
        if link is None or not link.join_sender(self.link_drain_s + _SENDER_STOP_S):
            return  # still copying (or stuck): ``close`` or a reconnect releases it later
        with self._lock:
            if self._links.get(state.peer_id) is state:
                del self._links[state.peer_id]
        link.ch.close()
        self._on_link_closed(state)

    def _on_link_closed(self, state: LinkState) -> None:
        assert isinstance(state, _ShmLink)
        state.views, state.mappings = {}, {}  # unmapped once in-flight copies drop their views

    # -- target ----------------------------------------------------------------------------------
    def _serve_target(self, ch: Channel, peer: PeerId) -> None:
        """Idle-bounded while it holds no pin, stall-bounded while it holds one (then the
        connection is dropped, counted, and its pins released)."""
        pins: dict[int, tuple[RegionId, ...]] = {}
        try:
            while True:
                h = ch.recv_header()
                body = ch.recv_body(h)
                if h.ftype is FrameType.PIN:
                    if len(body) != 8 * h.count:
                        raise MalformedMessageError(f"PIN of {len(body)} bytes for {h.count} ids")
                    if h.xfer_id in pins:  # each transfer pins once (else the first leaks)
                        raise MalformedMessageError(f"second PIN for transfer {h.xfer_id}")
                    ids = np.frombuffer(body, dtype="<i8").tolist()
                    try:
                        pins[h.xfer_id] = self._regions.pin(ids, exported_only=True)
                        if len(pins) == 1:
                            self._holding(ch)
                        ch.send_frame(FrameType.PINNED, h.xfer_id)
                    except TransportError as exc:
                        ch.send_frame(
                            FrameType.PINNED, h.xfer_id, str(exc).encode(), flags=FLAG_ERROR
                        )
                elif h.ftype in (FrameType.COMMIT, FrameType.ABORT):
                    held = pins.pop(h.xfer_id, None)
                    self._regions.unpin(held or ())
                    if held is not None and not pins:
                        self._idle(ch)
                    if h.ftype is FrameType.COMMIT:
                        if h.flags & FLAG_NOTIFY:
                            self._deliver(peer, body)
                        ch.send_frame(FrameType.ACK, h.xfer_id)
                elif h.ftype is not FrameType.PING or body:
                    raise MalformedMessageError(f"unexpected {h.ftype.name} frame on shm")
        except (OSError, KVPlaneError) as exc:
            self._ended(exc, holding=bool(pins))
        finally:
            for held in pins.values():
                self._regions.unpin(held)

    def _close(self) -> None:
        super()._close()
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
        for seg in segments:  # the mapping is not closed: a caller's tensor from ``allocate``
            os.close(seg.fd)  # may still use it (torch holds the mmap, not a buffer export),
            # and a close would unmap it under that tensor; it unmaps with its last reference
