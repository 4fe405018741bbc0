"""tcp initiator against a scripted target: frames a target sends are checked, not trusted."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch

import kvplane.transports.tcp as tcp_module
from kvplane.transports.base import DescriptorList, FailureKind, XferKind, XferState
from kvplane.transports.channel import Channel
from kvplane.transports.handshake import server_handshake
from kvplane.transports.tcp import TcpTransport
from kvplane.transports.wire import (
    FLAG_ERROR,
    WIRE_VERSION,
    FrameType,
    Header,
    Metadata,
    RegionInfo,
    Welcome,
    encode,
)

Reply = Callable[[Channel, Header], None]


class _ScriptedTarget:
    """Accepts one connection, offers region 1 (4 KiB) and calls ``reply`` on each frame."""

    def __init__(self, reply: Reply) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.replied = threading.Event()
        self._reply = reply
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def metadata(self) -> bytes:
        port = self.sock.getsockname()[1]
        return encode(Metadata(WIRE_VERSION, "tcp", "scripted", f"127.0.0.1:{port}"))

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        ch = Channel(conn)
        try:
            server_handshake(
                ch, "scripted", "tcp", None, lambda: (Welcome([RegionInfo(1, 4096)]), [])
            )
            while True:
                h = ch.recv_header()
                ch.recv_body(Header(h.ftype, 0, 0, h.xfer_id, 24 * h.count) if h.count else h)
                self._reply(ch, h)
        except OSError:
            pass
        finally:
            ch.close()

    def close(self) -> None:
        self.sock.close()
        self._thread.join(5)


def _read(reply: Reply) -> tuple[object, torch.Tensor]:
    target, t = _ScriptedTarget(reply), TcpTransport(agent="reader")
    try:
        dst = torch.full((4096,), 7, dtype=torch.uint8)
        region = t.register(dst).region_id
        peer = t.connect(target.metadata())
        h = t.submit(XferKind.READ, DescriptorList.of([(1, 0, 4096)]),
                     DescriptorList.of([(int(region), 0, 4096)]), peer, deadline_s=5)  # fmt: skip
        return t.wait(h, 5), dst
    finally:
        t.close()
        target.close()


def test_a_plain_ack_for_a_read_chunk_is_malformed_not_done():
    def plain_ack(ch: Channel, h: Header) -> None:
        if h.ftype is FrameType.READ_REQ:
            ch.send_frame(FrameType.ACK, h.xfer_id)  # no DATA, no FLAG_ERROR

    got, dst = _read(plain_ack)
    assert got.state is XferState.FAILED and got.failure is FailureKind.REMOTE_DISCONNECT
    assert "plain ACK" in got.reason and bool((dst == 7).all())


def test_a_refusal_without_a_reason_still_fails_the_read():
    def silent_refusal(ch: Channel, h: Header) -> None:
        if h.ftype is FrameType.READ_REQ:
            ch.send_frame(FrameType.ACK, h.xfer_id, flags=FLAG_ERROR)

    got, _ = _read(silent_refusal)
    assert (got.state, got.failure) == (XferState.FAILED, FailureKind.BACKEND_ERROR)
    assert "no reason given" in got.reason


def test_an_ack_before_the_commit_of_a_write_is_malformed(monkeypatch):
    """The target may only ACK a WRITE it received the COMMIT of; an ACK sent at the first DATA
    frame (while our sender is still sending) must not end the batch DONE."""
    acked = threading.Event()

    def early_ack(ch: Channel, h: Header) -> None:
        if h.ftype is FrameType.DATA and not acked.is_set():
            ch.send_frame(FrameType.ACK, h.xfer_id)
            acked.set()

    real_send = tcp_module.send_payload
    t = TcpTransport(agent="writer")

    def send_after_the_ack_is_handled(sock, views, descs, stage):
        assert acked.wait(5)
        end = time.monotonic() + 5  # until the receiver acted on it: ended the batch, or the link
        while any(not b.terminal for b in t._batches.live()) and time.monotonic() < end:
            time.sleep(1e-3)
        real_send(sock, views, descs, stage)

    monkeypatch.setattr(tcp_module, "send_payload", send_after_the_ack_is_handled)
    target = _ScriptedTarget(early_ack)
    try:
        src = t.register(torch.ones(4096, dtype=torch.uint8)).region_id
        peer = t.connect(target.metadata())
        h = t.submit(XferKind.WRITE, DescriptorList.of([(int(src), 0, 4096)]),
                     DescriptorList.of([(1, 0, 4096)]), peer, deadline_s=5)  # fmt: skip
        got = t.wait(h, 5)
        assert got.state is not XferState.DONE
        assert got.failure is FailureKind.REMOTE_DISCONNECT and "sent no COMMIT" in got.reason
    finally:
        t.close()
        target.close()


@pytest.fixture(autouse=True)
def _no_threads_left(kit):
    yield
    assert kit.kv_threads() == []
