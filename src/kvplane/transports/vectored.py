"""Vectored socket I/O: one ``readv``/``writev`` system call moves many descriptor runs.

Only blocking sockets and CPU memory qualify (:func:`usable`); the caller keeps the regions
pinned. See docs/transports.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket
from collections.abc import Callable, Mapping

import numpy as np
import numpy.typing as npt
import torch

from kvplane.ids import RegionId
from kvplane.transports.base import DescriptorList

IOV_MAX = 1024
"""Entries per ``readv``/``writev`` call (the POSIX minimum of ``IOV_MAX`` on Linux)."""

IovArray = npt.NDArray[np.uint64]


class _MsgHdr(ctypes.Structure):
    """``struct msghdr`` (Linux): no address, no control data."""

    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.writev.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
        libc.writev.restype = ctypes.c_ssize_t
        libc.recvmsg.argtypes = (ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int)
        libc.recvmsg.restype = ctypes.c_ssize_t
    except (OSError, AttributeError):
        return None
    return libc


def _readv_all(fd: int, iov: int, count: int) -> int:
    """``readv`` that waits for all ``count`` entries (``recvmsg`` with ``MSG_WAITALL``): one
    call per ``IOV_MAX`` runs however the bytes trickle in, instead of one per arrival."""
    assert _LIBC is not None
    msg = _MsgHdr(None, 0, iov, count, None, 0, 0)
    return int(_LIBC.recvmsg(fd, ctypes.byref(msg), socket.MSG_WAITALL))


def _writev(fd: int, iov: int, count: int) -> int:
    assert _LIBC is not None
    return int(_LIBC.writev(fd, iov, count))


_LIBC = _load_libc()
"""libc (read-only after import), or None where it cannot be loaded (then nothing is vectored)."""


def usable(sock: socket.socket, views: Mapping[RegionId, torch.Tensor]) -> bool:
    """Whether vectored I/O applies: libc loaded, a blocking socket and CPU region views."""
    return (
        _LIBC is not None
        and sock.gettimeout() is None
        and all(v.device.type == "cpu" for v in views.values())
    )


def iovecs(views: Mapping[RegionId, torch.Tensor], descs: DescriptorList) -> IovArray:
    """The ``(n, 2)`` iovec array (address, length) of ``descs`` inside ``views`` (flat uint8)."""
    regions = descs.regions
    if len(regions) and int(regions.min()) == int(regions.max()):
        bases: npt.NDArray[np.int64] | int = views[RegionId(int(regions[0]))].data_ptr()
    else:
        ids = np.unique(regions)
        table = np.array([views[RegionId(int(r))].data_ptr() for r in ids], dtype=np.int64)
        bases = table[np.searchsorted(ids, regions)]
    iov = np.empty((len(regions), 2), dtype=np.uint64)
    iov[:, 0] = bases + descs.offsets
    iov[:, 1] = descs.lengths
    return iov


def _transfer(
    sock: socket.socket, iov: IovArray, call: Callable[[int, int, int], int], name: str
) -> None:
    fd = sock.fileno()
    iov = np.array(iov, dtype=np.uint64, copy=True)  # advanced in place on partial transfers
    pos, n = 0, len(iov)
    while pos < n:
        count = min(IOV_MAX, n - pos)
        got = call(fd, iov[pos:].ctypes.data, count)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, f"{name}: {os.strerror(err)}")
        if got == 0:
            raise ConnectionResetError("peer closed the connection")
        ends = np.cumsum(iov[pos : pos + count, 1])
        if got == int(ends[-1]):  # the usual case: every entry of the call moved
            pos += count
            continue
        done = int(np.searchsorted(ends, got, side="right"))
        pos += done
        if done < count:  # part of entry ``pos`` moved: advance it
            moved = got - (int(ends[done - 1]) if done else 0)
            iov[pos, 0] += np.uint64(moved)
            iov[pos, 1] -= np.uint64(moved)


def recv_into_runs(sock: socket.socket, iov: IovArray) -> None:
    """Fill every run of ``iov`` from ``sock`` in order; ``ConnectionResetError`` on EOF."""
    _transfer(sock, iov, _readv_all, "recvmsg")


def send_runs(sock: socket.socket, iov: IovArray) -> None:
    """Send every run of ``iov`` in order (like ``sendall`` over their concatenation)."""
    _transfer(sock, iov, _writev, "writev")
