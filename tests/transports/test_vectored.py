"""vectored: recvmsg/writev of many runs equal a byte-by-byte reference; a partial transfer
advances the entry array exactly."""

from __future__ import annotations

import ctypes
import errno
import socket
import threading

import numpy as np
import pytest
import torch

from kvplane.ids import RegionId
from kvplane.transports import vectored
from kvplane.transports.base import DescriptorList

A, B = RegionId(1), RegionId(2)


def _pair(buf: int) -> tuple[socket.socket, socket.socket]:
    left, right = socket.socketpair()
    for s in (left, right):  # small buffers: the sender's writev returns partially
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf)
    return left, right


def test_send_then_receive_runs_across_regions(kit):
    rng = np.random.default_rng(7)
    n, size = 3000, 1 << 20  # more than IOV_MAX runs, two regions on each side
    src = {A: torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8)),
           B: torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))}  # fmt: skip
    dst = {A: torch.zeros(size, dtype=torch.uint8), B: torch.zeros(size, dtype=torch.uint8)}
    lengths = rng.integers(1, 300, n).astype(np.int64)
    regions = rng.integers(1, 3, n).astype(np.int64)
    s = DescriptorList(regions, rng.integers(0, size - 300, n), lengths)
    d_off = np.zeros(n, dtype=np.int64)
    for r in (1, 2):  # disjoint destinations per region, interleaved between the regions
        mine = np.flatnonzero(regions == r)
        d_off[mine] = np.cumsum(lengths[mine]) - lengths[mine]
    d = DescriptorList(regions[::-1].copy(), d_off[::-1].copy(), lengths[::-1].copy())
    s = DescriptorList(s.regions[::-1].copy(), s.offsets[::-1].copy(), lengths[::-1].copy())
    left, right = _pair(4096)
    assert vectored.usable(left, src) and vectored.usable(right, dst)
    sender = threading.Thread(target=vectored.send_runs, args=(left, vectored.iovecs(src, s)))
    sender.start()
    vectored.recv_into_runs(right, vectored.iovecs(dst, d))
    sender.join()
    expected = {r: torch.zeros(size, dtype=torch.uint8) for r in (A, B)}
    for i in range(n):  # independent per-run reference
        so, do, ln = int(s.offsets[i]), int(d.offsets[i]), int(lengths[::-1][i])
        expected[RegionId(int(d.regions[i]))][do : do + ln] = src[RegionId(int(s.regions[i]))][
            so : so + ln
        ]
    assert torch.equal(dst[A], expected[A]) and torch.equal(dst[B], expected[B])
    left.close()
    right.close()


def test_eof_mid_receive_is_a_connection_reset_and_timeouts_are_not_vectored():
    left, right = _pair(4096)
    buf = {A: torch.zeros(1 << 16, dtype=torch.uint8)}
    iov = vectored.iovecs(buf, DescriptorList.of([(1, 0, 1000), (1, 5000, 1000)]))
    assert iov[:, 1].tolist() == [1000, 1000]
    assert iov[:, 0].tolist() == [buf[A].data_ptr(), buf[A].data_ptr() + 5000]
    left.sendall(bytes(range(256)) * 5)  # 1280 of the 2000 bytes, then EOF
    left.close()
    with pytest.raises(ConnectionResetError, match="peer closed"):
        vectored.recv_into_runs(right, iov)
    assert buf[A][:1000].tolist() == (list(range(256)) * 4)[:1000]
    assert buf[A][5000:5280].tolist() == (list(range(256)) * 5)[1000:1280]
    right.settimeout(1.0)
    assert not vectored.usable(right, buf)
    right.close()


def test_a_partial_call_advances_the_entries_it_moved_and_eintr_retries():
    """A scripted system call: each call records the entries it was given and moves ``got``
    bytes -- mid-entry, exactly to an entry boundary, interrupted (EINTR), then the rest."""
    base = 1 << 20
    iov = np.array([[base, 10], [base + 100, 20], [base + 200, 30]], dtype=np.uint64)
    script = [15, 15, -1, 10, 20]
    seen: list[list[tuple[int, int]]] = []

    def call(fd: int, ptr: int, count: int) -> int:
        entries = (ctypes.c_uint64 * (2 * count)).from_address(ptr)
        seen.append([(int(entries[2 * i]), int(entries[2 * i + 1])) for i in range(count)])
        got = script.pop(0)
        if got < 0:
            ctypes.set_errno(errno.EINTR)
        return got

    left, right = socket.socketpair()
    vectored._transfer(right, iov, call, "scripted")
    assert seen == [
        [(base, 10), (base + 100, 20), (base + 200, 30)],
        [(base + 105, 15), (base + 200, 30)],  # 5 bytes of entry 1 had moved
        [(base + 200, 30)],  # 15 more ended exactly at entry 1's end
        [(base + 200, 30)],  # interrupted: the same call again
        [(base + 210, 20)],
    ]
    assert not script
    assert iov[:, 1].tolist() == [10, 20, 30]  # the caller's array is never advanced
    left.close()
    right.close()
