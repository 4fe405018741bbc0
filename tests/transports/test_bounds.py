"""Connection bounds of the stream transports: caps before and after the handshake, the
handshake deadline and the idle bound (spared by keep-alives), on real sockets.

A flood against a child process and the stall bound's tolerance: ``test_stream_floods``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest
import torch

from kvplane.errors import InvalidArgumentError
from kvplane.transports.base import XferKind, XferState
from kvplane.transports.bounds import ConnectionLimits
from kvplane.transports.channel import Channel
from kvplane.transports.handshake import client_handshake
from kvplane.transports.shm import ShmTransport
from kvplane.transports.tcp import TcpTransport


def _count(t: TcpTransport | ShmTransport, metric: str, reason: str) -> float:
    return t.metrics.value(metric, {"transport": t.name, "reason": reason}, "_total")


def _raw(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_within(s: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the peer closed ``s`` (EOF or reset), or None if it did not by then."""
    start = time.monotonic()
    s.settimeout(timeout_s)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_the_caps_refuse_past_pending_and_total_and_count_it(kit):
    """Handshaking connections are capped at ``max_pending``, all at ``max_connections``;
    one past either is closed unanswered, counted by reason; a closed one frees its slot."""
    t = TcpTransport(agent="target", limits=ConnectionLimits(max_pending=2, max_connections=3))
    peers = [TcpTransport(agent=f"p{i}") for i in range(3)]
    socks: list[socket.socket] = []
    try:
        socks = [_raw(t.address) for _ in range(3)]  # silent: all three still handshaking
        assert _closed_within(socks[2], 5) is not None  # the third is past max_pending
        assert _count(t, "stream_connections_refused", "pending_cap") == 1
        for s in socks:
            s.close()
        assert _eventually(lambda: t._admission.pending == 0)
        for p in peers:  # three open connections fill the total cap
            p.connect(t.metadata())
        extra = _raw(t.address)
        assert _closed_within(extra, 5) is not None
        extra.close()
        assert _count(t, "stream_connections_refused", "total_cap") == 1
        peers.pop().close()  # its slot is free again
        assert _eventually(lambda: t._admission.open == 2)
        socks = [_raw(t.address) for _ in range(2)]
        assert _closed_within(socks[0], 0.3) is None  # admitted: waits in its handshake
        assert _closed_within(socks[1], 5) is not None  # the fourth again
        assert _count(t, "stream_connections_refused", "total_cap") == 2
    finally:
        for s in socks:
            s.close()
        for p in peers:
            p.close()
        t.close()
    with pytest.raises(InvalidArgumentError, match="max_pending 4 exceeds max_connections 3"):
        ConnectionLimits(max_pending=4, max_connections=3)
    with pytest.raises(InvalidArgumentError, match="idle_timeout_s"):
        ConnectionLimits(idle_timeout_s=float("inf"))


def _eventually(check, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("kind", [TcpTransport, ShmTransport])
def test_a_trickled_handshake_is_dropped_at_its_deadline(kind):
    """One byte every 50 ms used to restart a per-read timeout for ever; the handshake now has
    one deadline, met within 0.3 s (scheduling), and its drop is counted."""
    t = kind(agent="target", limits=ConnectionLimits(handshake_timeout_s=0.5))
    if kind is TcpTransport:
        s = _raw(t.address)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + t.address)
    try:
        start = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(100):  # 5 s of trickle, far past the deadline
                s.send(b"K")
                time.sleep(0.05)
        assert time.monotonic() - start <= 0.5 + 0.3 + 0.1  # a send failed: we were dropped
        assert _count(t, "stream_connections_dropped", "handshake_timeout") == 1
    finally:
        s.close()
        t.close()


@pytest.mark.parametrize("kind", [TcpTransport, ShmTransport])
def test_an_idle_connection_is_dropped_but_a_quiet_link_lives_on(kind, kit):
    """A peer that handshakes and then says nothing holds a thread no longer than
    ``idle_timeout_s`` (counted); our own idle link pings and stays up across 4 bounds."""
    idle = 0.4
    t = kind(agent="target", limits=ConnectionLimits(idle_timeout_s=idle))
    a = kind(agent="quiet")
    if kind is TcpTransport:
        raw = _raw(t.address)
    else:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect("\0" + t.address)
    try:
        mem = t.allocate(64) if isinstance(t, ShmTransport) else torch.zeros(64, dtype=torch.uint8)
        dst = t.register(mem).region_id
        src = a.register(torch.ones(64, dtype=torch.uint8)).region_id
        peer = a.connect(t.metadata())
        _, _, fds = client_handshake(Channel(raw), "silent", t.name, None,
                                     with_fds=kind is ShmTransport)  # fmt: skip
        for fd in fds:
            os.close(fd)
        waited = _closed_within(raw, 5)
        assert waited is not None and waited <= idle + 0.2  # bound, plus scheduling
        assert _count(t, "stream_connections_dropped", "idle") == 1
        time.sleep(4 * idle)
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(dst, 0, 64), peer)
        assert kit.wait(a, h).state is XferState.DONE and int(mem.sum()) == 64
        assert _count(t, "stream_connections_dropped", "idle") == 1
    finally:
        raw.close()
        a.close()
        t.close()
