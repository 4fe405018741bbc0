"""Connection bounds of the stream transports: caps before and after the handshake (evicting
the oldest handshake), the first-byte and handshake deadlines and the idle bound (spared by
keep-alives), on real sockets.

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


def test_past_a_cap_the_oldest_handshake_is_evicted_never_an_open_connection(kit):
    """Handshaking connections are capped at ``max_pending``, all at ``max_connections``; a
    newcomer past either evicts the oldest handshaking one (closed unanswered, counted). With
    every slot held by an authenticated connection, the newcomer itself is refused."""
    limits = ConnectionLimits(max_pending=2, max_connections=3, first_byte_timeout_s=30.0)
    t = TcpTransport(agent="target", limits=limits)
    peers = [TcpTransport(agent=f"p{i}") for i in range(3)]
    socks: list[socket.socket] = []
    try:
        socks = [_raw(t.address) for _ in range(3)]  # silent: all three still handshaking
        assert _closed_within(socks[0], 5) is not None  # the oldest made room for the third
        assert _closed_within(socks[1], 0.2) is None and _closed_within(socks[2], 0.2) is None
        assert _count(t, "stream_connections_dropped", "evicted") == 1
        assert t._admission.pending == 2
        for s in socks:
            s.close()
        assert _eventually(lambda: t._admission.pending == 0)
        for p in peers:  # three open connections fill the total cap
            p.connect(t.metadata())
        extra = _raw(t.address)
        assert _closed_within(extra, 5) is not None  # nothing to evict: refused
        extra.close()
        assert _count(t, "stream_connections_refused", "total_cap") == 1
        peers.pop().close()  # its slot is free again
        assert _eventually(lambda: t._admission.open == 2)
        socks = [_raw(t.address) for _ in range(2)]
        assert _closed_within(socks[0], 5) is not None  # the second evicts the first
        assert _closed_within(socks[1], 0.2) is None
        assert _count(t, "stream_connections_dropped", "evicted") == 2
        assert _count(t, "stream_connections_refused", "total_cap") == 1
        assert t._admission.open == 2 and t._admission.pending == 1
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
    with pytest.raises(InvalidArgumentError, match="first_byte_timeout_s"):
        ConnectionLimits(first_byte_timeout_s=0)


def _silent(t: TcpTransport | ShmTransport) -> socket.socket:
    """A raw connection to ``t``'s listener that says nothing."""
    if isinstance(t, TcpTransport):
        return _raw(t.address)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + t.address)
    return s


@pytest.mark.parametrize("kind", [TcpTransport, ShmTransport])
def test_silent_sockets_past_the_pending_cap_do_not_lock_out_a_genuine_peer(kind, kit):
    """Before, 64 sockets that connect and never send a byte filled ``max_pending`` and every
    genuine peer was refused until their handshake deadline (10 s). Now each newcomer evicts
    the oldest handshaking connection: 70 silent sockets evict exactly the 6 oldest, a genuine
    peer then connects (evicting the 7th) and moves bytes within 2 s, and a link that was
    already open is untouched. The first-byte deadline is set far off to isolate eviction."""
    t = kind(agent="target", limits=ConnectionLimits(first_byte_timeout_s=30.0))
    old, new = kind(agent="old"), kind(agent="genuine")
    socks: list[socket.socket] = []
    try:
        mem = t.allocate(64) if isinstance(t, ShmTransport) else torch.zeros(64, dtype=torch.uint8)
        dst = t.register(mem).region_id
        srcs = [p.register(torch.ones(64, dtype=torch.uint8)).region_id for p in (old, new)]
        old_peer = old.connect(t.metadata())
        socks = [_silent(t) for _ in range(70)]
        assert _eventually(lambda: _count(t, "stream_connections_dropped", "evicted") == 6)
        assert [_closed_within(s, 5) is not None for s in socks[:6]] == [True] * 6
        assert _closed_within(socks[6], 0.1) is None
        start = time.monotonic()
        peer = new.connect(t.metadata())
        h = new.submit(XferKind.WRITE, kit.one(srcs[1], 0, 32), kit.one(dst, 0, 32), peer)
        assert kit.wait(new, h).state is XferState.DONE
        assert time.monotonic() - start <= 2.0
        assert _closed_within(socks[6], 5) is not None and _closed_within(socks[7], 0.1) is None
        assert _count(t, "stream_connections_dropped", "evicted") == 7
        assert _count(t, "stream_connections_refused", "total_cap") == 0
        h = old.submit(XferKind.WRITE, kit.one(srcs[0], 32, 32), kit.one(dst, 32, 32), old_peer)
        assert kit.wait(old, h).state is XferState.DONE and int(mem.sum()) == 64
        assert (t._admission.open, t._admission.pending) == (2, 63)
    finally:
        for s in socks:
            s.close()
        new.close()
        old.close()
        t.close()


@pytest.mark.parametrize("kind", [TcpTransport, ShmTransport])
def test_a_connection_that_sends_no_first_byte_is_dropped_by_its_deadline(kind):
    """``first_byte_timeout_s`` (0.3 s here) ends a connection that never speaks, long before
    the handshake deadline (5 s), counted apart; one byte in time moves it onto the handshake
    deadline instead."""
    limits = ConnectionLimits(first_byte_timeout_s=0.3, handshake_timeout_s=1.0)
    t = kind(agent="target", limits=limits)
    mute, talker = _silent(t), _silent(t)
    try:
        talker.sendall(b"K")  # the first byte of a frame header, then nothing
        start = time.monotonic()
        waited = _closed_within(mute, 5)
        assert waited is not None and 0.2 <= waited <= 0.3 + 0.2
        assert _count(t, "stream_connections_dropped", "first_byte_timeout") == 1
        waited = _closed_within(talker, 5)
        assert waited is not None and 0.8 <= time.monotonic() - start <= 1.0 + 0.3
        assert _count(t, "stream_connections_dropped", "handshake_timeout") == 1
        assert _count(t, "stream_connections_dropped", "first_byte_timeout") == 1
    finally:
        mute.close()
        talker.close()
        t.close()


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
