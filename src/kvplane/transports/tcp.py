"""``tcp``: kvplane's own stream transport between processes and hosts (127.0.0.1 by default).

A target checks every table against its own regions and drops a stalled peer; frames from a
target are not trusted either. See docs/transports.md.
"""

from __future__ import annotations

import collections
import logging
import socket
from dataclasses import dataclass, field
from typing import Unpack

import torch

from kvplane.errors import (
    InvalidArgumentError,
    KVPlaneError,
    MalformedMessageError,
    PlanError,
    TransportError,
)
from kvplane.ids import PeerId, RegionId
from kvplane.transports.base import DescriptorList, FailureKind, Peer, XferKind, XferState
from kvplane.transports.batches import Batch, Job
from kvplane.transports.channel import Channel, Link
from kvplane.transports.copier import coalesce, split
from kvplane.transports.payload import (
    FRAME_BYTES,
    discard,
    frames,
    recv_payload,
    send_payload,
    staging_buffer,
    sub,
)
from kvplane.transports.stream import LinkState, StreamOptions, StreamTransport
from kvplane.transports.wire import (
    FLAG_ERROR,
    FLAG_NOTIFY,
    FrameType,
    Header,
    Metadata,
    Welcome,
    decode_metadata,
    pack_header,
    pack_table,
    parse_table,
)
from kvplane.validators import require_int

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Notify:
    """A COMMIT that only carries a finished READ's notify to the target."""

    xfer_id: int
    payload: bytes


@dataclass(slots=True)
class _Read:
    batch: Batch
    chunks: collections.deque[DescriptorList]
    notify: bytes | None
    failed: str = ""


@dataclass(slots=True)
class _TcpLink(LinkState):
    """Per-connection initiator state shared by its sender and receiver threads."""

    reads: collections.deque[_Read] = field(default_factory=collections.deque)
    send_stage: torch.Tensor = field(default_factory=staging_buffer)
    recv_stage: torch.Tensor = field(default_factory=staging_buffer)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpTransport(StreamTransport):
    """Stream transport over TCP; ``secret`` (bytes) makes peers prove they share it.

    ``target_stall_s``: how long our target side waits at most for the next byte of a peer, or
    for the peer to take the next byte of a READ reply, while it holds pins for that peer's
    batch; then the connection is dropped and the pins released (a peer gone without a FIN,
    hung, or no longer reading). A connection holding nothing is bounded by
    ``ConnectionLimits.idle_timeout_s`` instead."""

    name = "tcp"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        **options: Unpack[StreamOptions],
    ) -> None:
        if not isinstance(host, str) or not host:
            raise InvalidArgumentError(f"host must be a non-empty string, got {host!r}")
        require_int("port", port, min=0, max=65535)
        super().__init__(**options)
        try:
            sock = socket.create_server((host, port))
        except OSError as exc:
            raise TransportError(f"cannot listen on {host}:{port}: {exc}") from None
        self.address = f"{host}:{sock.getsockname()[1]}"
        self._listen(sock)

    # -- metadata and connections --------------------------------------------------------------
    def _dial(self, meta: Metadata) -> tuple[Channel, Welcome]:
        host, _, port = meta.address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=self._connect_timeout)
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot reach {meta.agent!r} at {meta.address}: {exc}") from None
        _tune(sock)
        ch = Channel(sock)
        _, welcome, _ = self._handshake(
            ch, meta.agent, failure=f"handshake with {meta.agent!r} failed"
        )
        return ch, welcome

    def _connect(self, peer_metadata: bytes) -> Peer:
        meta = decode_metadata(peer_metadata, self.name)
        ch, welcome = self._dial(meta)
        return self._install(PeerId(meta.agent), ch, welcome)[0]

    def _new_state(self, peer_id: PeerId) -> _TcpLink:
        return _TcpLink(peer_id)

    # -- initiator: sender and receiver threads ------------------------------------------------
    def _run(self, state: LinkState, job: object) -> None:
        assert isinstance(state, _TcpLink) and state.link is not None
        ch = state.link.ch
        if isinstance(job, _Notify):
            ch.send_frame(FrameType.COMMIT, job.xfer_id, job.payload, flags=FLAG_NOTIFY)
            return
        assert isinstance(job, Job)
        batch = job.batch
        if not self._batches.begin(batch):
            self._batches.quiesce(batch)
            return
        xid = batch.handle.xfer_id
        src, dst = split(*coalesce(job.src, job.dst), FRAME_BYTES)
        if batch.kind is XferKind.READ and len(src):
            chunks = collections.deque(sub(dst, a, b) for a, b in frames(dst.lengths))
            with state.link.lock:
                if state.link.down:
                    raise TransportError(f"connection down: {state.link.reason}")
                state.reads.append(_Read(batch, chunks, job.notify))
                job.handed_off = True
            for a, b in frames(src.lengths):
                ch.send(pack_header(FrameType.READ_REQ, xid, 0, b - a) + pack_table(sub(src, a, b)))
            return
        views = self._regions.views(src.facts.region_ids.tolist())
        for a, b in frames(dst.lengths):
            if batch.terminal:
                ch.send_frame(FrameType.ABORT, xid)
                self._batches.quiesce(batch)
                return
            part = sub(dst, a, b)
            ch.send(pack_header(FrameType.DATA, xid, part.total_bytes, b - a) + pack_table(part))
            send_payload(ch.sock, views, sub(src, a, b), state.send_stage)
        committed = self._batches.commit(batch)
        self._batches.quiesce(batch)  # every byte is in the socket: unpinned before the ACK
        if committed:
            flags = 0 if job.notify is None else FLAG_NOTIFY
            ch.send_frame(FrameType.COMMIT, xid, job.notify or b"", flags=flags)
        else:
            ch.send_frame(FrameType.ABORT, xid)

    def _on_frame(self, state: LinkState, h: Header) -> None:
        assert isinstance(state, _TcpLink) and state.link is not None
        ch = state.link.ch
        if h.ftype is FrameType.ACK:
            body = ch.recv_body(h)
            if state.reads and state.reads[0].batch.handle.xfer_id == h.xfer_id:
                if not h.flags & FLAG_ERROR:  # a READ chunk is answered by DATA or a refusal
                    raise MalformedMessageError(f"plain ACK for READ chunk of {h.xfer_id}")
                read = state.reads[0]
                why = body.decode(errors="replace") or "refused, no reason given"
                read.failed = read.failed or why
                read.chunks.popleft()
                self._maybe_end_read(state)
                return
            batch = self._batches.by_id(h.xfer_id)
            if batch is None:
                return  # a late ACK: the batch already ended (deadline, cancel) and retired
            if batch.kind is not XferKind.WRITE or not batch.committed:  # no COMMIT was sent
                raise MalformedMessageError(f"ACK for transfer {h.xfer_id}, which sent no COMMIT")
            if h.flags & FLAG_ERROR:
                self._batches.finish(batch, XferState.FAILED, FailureKind.BACKEND_ERROR,
                                     f"peer refused: {body.decode(errors='replace')}")  # fmt: skip
            else:
                self._batches.finish(batch, XferState.DONE)
        elif h.ftype is FrameType.DATA:
            if not state.reads or state.reads[0].batch.handle.xfer_id != h.xfer_id:
                raise MalformedMessageError(f"unexpected DATA frame for transfer {h.xfer_id}")
            read = state.reads[0]
            part = read.chunks.popleft()
            if h.count or h.length != part.total_bytes:
                raise MalformedMessageError(
                    f"read reply of {h.length} bytes, {part.total_bytes} asked"
                )
            if read.batch.terminal or read.failed:
                discard(ch.sock, h.length, state.recv_stage)
            else:
                views = self._regions.views(part.facts.region_ids.tolist())
                recv_payload(ch.sock, views, part, state.recv_stage)
                read.batch.bytes_done += h.length
            self._maybe_end_read(state)
        else:
            raise MalformedMessageError(f"unexpected {h.ftype.name} frame from the target")

    def _maybe_end_read(self, state: _TcpLink) -> None:
        read = state.reads[0]
        if read.chunks:
            return
        state.reads.popleft()
        batch = read.batch
        # the last reply has landed: nothing touches it, so unpinned before the end shows
        if read.failed:
            self._batches.finish(batch, XferState.FAILED, FailureKind.BACKEND_ERROR,
                                 f"peer refused: {read.failed}", quiescent=True)  # fmt: skip
        else:
            done = self._batches.finish(batch, XferState.DONE, quiescent=True)
            if done and read.notify is not None:
                assert state.link is not None
                state.link.put(_Notify(batch.handle.xfer_id, read.notify))

    def _on_recv_exit(self, state: LinkState) -> None:
        assert isinstance(state, _TcpLink) and state.link is not None
        with state.link.lock:
            reads = list(state.reads)
            state.reads.clear()
        for read in reads:
            self._batches.fail_all([read.batch], FailureKind.REMOTE_DISCONNECT, state.link.reason)
            self._batches.quiesce(read.batch)

    def _abort(self, batch: Batch) -> None:
        """A batch past its deadline mid-stream tears its stream down; so does one that timed
        out queued behind a job that already ended but is still sending (cancelled while
        ``sendall`` is blocked on a stalled target: nothing else would ever unblock it)."""
        link = batch.job
        if batch.failure is not FailureKind.TIMEOUT or not isinstance(link, Link):
            return
        ahead = link.current
        stuck = isinstance(ahead, Job) and ahead.batch is not batch and ahead.batch.terminal
        if batch.started or stuck:
            link.fail(f"transfer {batch.handle.xfer_id} passed its deadline "
                      + ("mid-stream" if batch.started else "behind a stalled stream"))  # fmt: skip

    def _serve_target(self, ch: Channel, peer: PeerId) -> None:
        _tune(ch.sock)
        _Target(self, ch, peer).serve()


class _Target:
    """State of one accepted connection: pins of incoming writes until COMMIT/ABORT/EOF."""

    def __init__(self, transport: TcpTransport, ch: Channel, peer: PeerId) -> None:
        self.t, self.ch, self.peer = transport, ch, peer
        self.pins: dict[int, tuple[RegionId, ...]] = {}
        self.errors: dict[int, str] = {}
        self.stage = staging_buffer()
        self._watched = False

    def _watch(self) -> None:
        """Bound silence by the stall (receive and send: a READ reply is sent while its pins
        are held) while pins are held, by the idle timeout when none are."""
        if bool(self.pins) != self._watched:
            self._watched = bool(self.pins)
            if self._watched:
                self.t._holding(self.ch)
            else:
                self.t._idle(self.ch)

    def serve(self) -> None:
        try:
            while True:
                self.handle(self.ch.recv_header())
        except (OSError, KVPlaneError) as exc:
            self.t._ended(exc, holding=bool(self.pins))
        except Exception:  # a bug must end only this connection (its pins released below)
            log.exception("tcp target connection from %s failed", self.peer)
        finally:
            for pins in self.pins.values():
                self.t._regions.unpin(pins)
            self.pins.clear()

    def _checked(self, xid: int, table: DescriptorList) -> str:
        """'' if ``table`` fits our exported regions (pinning them for ``xid``), else why not."""
        try:
            table.check_bounds(self.t._regions.lengths(exported_only=True), "requested")
            new = set(table.facts.region_ids.tolist()) - set(self.pins.get(xid, ()))
            self.pins[xid] = self.pins.get(xid, ()) + self.t._regions.pin(new, exported_only=True)
        except (PlanError, TransportError) as exc:
            return str(exc)
        self._watch()
        return ""

    def _table(self, h: Header) -> DescriptorList:
        raw = self.ch.recv_body(Header(h.ftype, 0, 0, h.xfer_id, 24 * h.count))
        return parse_table(raw, h.count)

    def handle(self, h: Header) -> None:
        ch, t, xid = self.ch, self.t, h.xfer_id
        if h.ftype is FrameType.DATA:
            table = self._table(h)
            if table.total_bytes != h.length:
                raise MalformedMessageError(
                    f"DATA table sums to {table.total_bytes}, not {h.length}"
                )
            why = self.errors.get(xid) or self._checked(xid, table)
            if why:
                self.errors[xid] = why
                discard(ch.sock, h.length, self.stage)
            else:
                views = t._regions.views(table.facts.region_ids.tolist())
                recv_payload(ch.sock, views, table, self.stage)
        elif h.ftype in (FrameType.COMMIT, FrameType.ABORT):
            body = ch.recv_body(h)
            why = self.errors.pop(xid, "")
            t._regions.unpin(self.pins.pop(xid, ()))
            self._watch()
            if h.ftype is FrameType.COMMIT:
                if not why and h.flags & FLAG_NOTIFY:
                    t._deliver(self.peer, body)
                ch.send_frame(FrameType.ACK, xid, why.encode(), flags=FLAG_ERROR if why else 0)
        elif h.ftype is FrameType.READ_REQ:
            table = self._table(h)
            why = self._checked(xid, table)
            if why:
                ch.send_frame(FrameType.ACK, xid, why.encode(), flags=FLAG_ERROR)
                return
            views = t._regions.views(table.facts.region_ids.tolist())
            ch.send(pack_header(FrameType.DATA, xid, table.total_bytes))
            send_payload(ch.sock, views, table, self.stage)  # a failure ends the connection,
            t._regions.unpin(self.pins.pop(xid, ()))  # counted as holding; ``serve`` unpins
            self._watch()
        elif h.ftype is FrameType.PING and not h.length:
            return  # a keep-alive: its bytes already reset the idle bound
        else:
            raise MalformedMessageError(f"unexpected {h.ftype.name} frame from the initiator")
