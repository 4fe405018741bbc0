"""A transport served by a child process: the far side of cross-process tests and benches.

A fresh interpreter (never fork) runs requests from a socket pair; a failure comes back as the
same ``kvplane.errors`` class. See docs/transports.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from kvplane import errors
from kvplane.errors import TransferTimeoutError, TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.transports.base import DescriptorList, FailureKind, Peer, Poll, XferKind, XferState

_NOT_RUNNING = frozenset("TtZX")
"""/proc thread states that run no code: stopped, traced, zombie, dead."""


def _all_threads_stopped(pid: int) -> bool:
    """True when no thread of ``pid`` can run (every state in :data:`_NOT_RUNNING`; a thread
    that exits while we look is skipped, a process that is gone counts as stopped)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state not in _NOT_RUNNING:
            return False
    return True


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """Deterministic pseudo-random bytes (the same in every process for the same seed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


SCATTER_CALL_PIECES = 1024
"""Pieces handed to one ``recvmsg_into`` of the scattered raw sink: Linux's ``IOV_MAX``, with
``MSG_WAITALL`` so one call fills them all however the bytes trickle in (in 256 KiB calls
without it, the raw scatter ran below kvplane's own vectored receive)."""


def _recv_contiguous(conn: socket.socket, buf: memoryview) -> bool:
    """Fill ``buf`` with ``recv_into`` calls that each ask for all that is left (``MSG_WAITALL``:
    the fastest raw receive; without it one call per arrival ran 1.1-1.4x slower); False on
    EOF."""
    view = buf
    while len(view):
        got = conn.recv_into(view, len(view), socket.MSG_WAITALL)
        if got == 0:
            return False
        view = view[got:]
    return True


def _recv_scattered(conn: socket.socket, pieces: list[memoryview], block: int) -> bool:
    """Fill ``pieces`` (each ``block`` bytes) in order with ``recvmsg_into`` (``MSG_WAITALL``,
    :data:`SCATTER_CALL_PIECES` per call), straight from the socket into them; False on EOF."""
    per, k, head = SCATTER_CALL_PIECES, 0, None
    while k < len(pieces):
        group = pieces[k : k + per] if head is None else [head, *pieces[k + 1 : k + per]]
        got = conn.recvmsg_into(group, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            return False
        if got < len(group[0]):  # still inside the first piece
            head = group[0][got:]
            continue
        got -= len(group[0])
        k += 1 + got // block
        head = pieces[k][got % block :] if got % block else None
    return True


def _raw_sink(
    nbytes: int, reps: int, ready: list[int], block: int = 0, offsets: list[int] | None = None
) -> None:
    """Receive ``reps`` x ``nbytes``, acking each (bench limits): with a plain ``recv_into``
    loop into one buffer, or, given ``offsets``, straight into the ``block``-byte pieces of
    the buffer at those offsets in that order (the scattered pages of a paged pool)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        ready.append(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = memoryview(bytearray(nbytes))
            pieces = [buf[o : o + block] for o in offsets or ()]  # built before any timing
            for _ in range(reps):
                ok = _recv_scattered(conn, pieces, block) if pieces else _recv_contiguous(conn, buf)
                if not ok:
                    return
                conn.sendall(b"k")


class _Child:
    def __init__(self, transport: str, options: dict[str, Any]) -> None:
        from kvplane.transports.registry import create_transport

        self.t = create_transport(transport, **options)
        self.tensors: dict[int, torch.Tensor] = {}
        self.handles: dict[int, Any] = {}
        self.peers: dict[str, Peer] = {}

    def alloc(self, nbytes: int, seed: int | None) -> int:
        allocate = getattr(self.t, "allocate", None)
        buf = allocate(nbytes) if allocate is not None else torch.zeros(nbytes, dtype=torch.uint8)
        if seed is not None:
            buf.copy_(pattern(nbytes, seed))
        region = self.t.register(buf)
        self.tensors[int(region.region_id)] = buf
        return int(region.region_id)

    def connect(self, meta: bytes) -> list[Any]:
        peer = self.t.connect(meta)
        self.peers[peer.peer_id] = peer
        return [peer.peer_id, [[int(k), v] for k, v in peer.regions.items()]]

    def submit(self, spec: list[Any]) -> int:
        """``spec``: kind, src columns, dst columns, peer id, notify, deadline."""
        kind, src, dst, peer, notify, deadline_s = spec
        src_d = DescriptorList(*np.asarray(src, dtype=np.int64).reshape(3, -1))
        dst_d = DescriptorList(*np.asarray(dst, dtype=np.int64).reshape(3, -1))
        handle = self.t.submit(XferKind(kind), src_d, dst_d, self.peers[peer],
                               notify=notify, deadline_s=deadline_s)  # fmt: skip
        self.handles[handle.xfer_id] = handle
        return int(handle.xfer_id)

    def deregister(self, region: int) -> None:
        self.t.deregister(RegionId(region))

    def wait(self, xfer_id: int, timeout_s: float) -> list[Any]:
        end = time.monotonic() + timeout_s
        while True:
            got = self.t.poll(self.handles[xfer_id])
            if got.state.terminal or time.monotonic() > end:
                failure = None if got.failure is None else got.failure.value
                return [got.state.value, got.bytes_done, failure, got.reason]
            time.sleep(2e-4)

    def read(self, region: int, offset: int, length: int) -> bytes:
        return bytes(self.tensors[region][offset : offset + length].numpy().tobytes())

    def notifications(self, timeout_s: float) -> list[list[Any]]:
        end = time.monotonic() + timeout_s
        while True:
            got = self.t.notifications()
            if got or time.monotonic() > end:
                return [[p, m] for p, m in got]
            time.sleep(2e-4)

    def status(self) -> dict[str, int]:
        pinned = getattr(self.t, "pinned_regions", lambda: -1)()
        live = getattr(self.t, "live_batches", lambda: -1)()
        threads = sum(1 for th in threading.enumerate() if th.name.startswith("kvplane-"))
        return {"pinned": pinned, "live": live, "threads": threads}

    def raw_sink(
        self, nbytes: int, reps: int, block: int = 0, offsets: list[int] | None = None
    ) -> int:
        ready: list[int] = []
        args = (nbytes, reps, ready, block, offsets)
        threading.Thread(target=_raw_sink, args=args, daemon=True).start()
        while not ready:
            time.sleep(1e-3)
        return ready[0]


def _send(sock: socket.socket, obj: object) -> None:
    data = msgspec.msgpack.encode(obj)
    sock.sendall(len(data).to_bytes(8, "little") + data)


def _recv(sock: socket.socket) -> Any:
    head = _exact(sock, 8)
    return msgspec.msgpack.decode(_exact(sock, int.from_bytes(head, "little")))


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise EOFError("peer process closed its end")
        view = view[got:]
    return bytes(buf)


def _child_main(sock: socket.socket, transport: str, options: dict[str, Any]) -> None:
    try:
        child = _Child(transport, options)
    except Exception as exc:
        _send(sock, ["err", type(exc).__name__, str(exc)])
        return
    _send(sock, ["ok", os.getpid()])
    ops: dict[str, Callable[..., Any]] = {
        "alloc": child.alloc, "metadata": child.t.metadata, "connect": child.connect,
        "submit": child.submit, "wait": child.wait, "read": child.read,
        "notifications": child.notifications, "status": child.status,
        "deregister": child.deregister, "raw_sink": child.raw_sink,
    }  # fmt: skip
    while True:
        try:
            op, args = _recv(sock)
        except (EOFError, OSError):
            break
        if op == "close":
            break
        try:
            reply = ["ok", ops[op](*args)]
        except Exception as exc:
            reply = ["err", type(exc).__name__, str(exc)]
        _send(sock, reply)
    child.t.close()
    with contextlib.suppress(OSError):
        _send(sock, ["ok", child.status()])


class PeerProcess:
    """One transport in a spawned child, driven over a pipe. Use as a context manager."""

    def __init__(
        self,
        transport: str,
        options: dict[str, Any] | None = None,
        *,
        start_timeout_s: float = 60.0,
    ) -> None:
        ours, theirs = socket.socketpair()
        blob = msgspec.msgpack.encode([transport, options or {}]).hex()
        cmd = [sys.executable, "-m", "kvplane.testing.peer_process", str(theirs.fileno()), blob]
        # the child's stdout goes to our stderr: engines that log on stdout stay out of ours
        self._proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdout=sys.stderr.fileno())
        theirs.close()
        self._sock = ours
        self.pid: int = self._reply(start_timeout_s)
        self.transport = transport

    def _reply(self, timeout_s: float) -> Any:
        self._sock.settimeout(timeout_s)
        try:
            reply = _recv(self._sock)
        except TimeoutError:
            raise TransferTimeoutError(
                f"peer process did not answer within {timeout_s} s"
            ) from None
        except (EOFError, OSError) as exc:
            raise errors.RemoteDisconnectError(f"peer process is gone: {exc!r}") from None
        if reply[0] == "err":
            cls = getattr(errors, reply[1], None)
            if not (isinstance(cls, type) and issubclass(cls, errors.KVPlaneError)):
                cls = TransportError
            raise cls(f"[peer {reply[1]}] {reply[2]}")
        return reply[1]

    def call(self, op: str, *args: Any, timeout_s: float = 60.0) -> Any:
        _send(self._sock, [op, list(args)])
        return self._reply(timeout_s)

    def alloc(self, nbytes: int, seed: int | None = None) -> RegionId:
        return RegionId(self.call("alloc", nbytes, seed))

    def metadata(self) -> bytes:
        return bytes(self.call("metadata"))

    def connect(self, meta: bytes) -> Peer:
        peer_id, regions = self.call("connect", meta)
        return Peer(PeerId(peer_id), {RegionId(k): v for k, v in regions})

    def submit(self, kind: XferKind, src: DescriptorList, dst: DescriptorList, peer: PeerId, *,
               notify: bytes | None = None, deadline_s: float = 30.0) -> int:  # fmt: skip
        cols = [[c.tolist() for c in (d.regions, d.offsets, d.lengths)] for d in (src, dst)]
        return int(self.call("submit", [kind.value, cols[0], cols[1], peer, notify, deadline_s]))

    def wait(self, xfer_id: int, timeout_s: float = 30.0) -> Poll:
        state, done, failure, reason = self.call("wait", xfer_id, timeout_s,
                                                 timeout_s=timeout_s + 30)  # fmt: skip
        kind = None if failure is None else FailureKind(failure)
        return Poll(XferState(state), done, kind, reason)

    def read(self, region: RegionId, offset: int, length: int) -> bytes:
        return bytes(self.call("read", int(region), offset, length))

    def notifications(self, timeout_s: float = 0.0) -> list[tuple[PeerId, bytes]]:
        got = self.call("notifications", timeout_s, timeout_s=timeout_s + 30)
        return [(PeerId(p), bytes(m)) for p, m in got]

    def deregister(self, region: RegionId) -> None:
        self.call("deregister", int(region))

    def status(self) -> dict[str, int]:
        return dict(self.call("status"))

    def raw_sink(
        self, nbytes: int, reps: int, block: int = 0, offsets: Sequence[int] | None = None
    ) -> int:
        """Start a raw socket sink in the child (see :func:`_raw_sink`); its port. Pieces
        outside the buffer are refused here, before the child is asked."""
        where = None if offsets is None else [int(o) for o in offsets]
        if where and (block <= 0 or min(where) < 0 or max(where) + block > nbytes):
            raise errors.InvalidArgumentError(
                f"{block}-byte pieces at offsets {min(where)}..{max(where)} do not fit in "
                f"{nbytes} bytes"
            )
        return int(self.call("raw_sink", nbytes, reps, block, where))

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP the child and return only once every one of its threads is stopped.

        The signal is delivered asynchronously: without the wait, a thread of the child that is
        running on another core may still answer one more frame after ``stop`` returned."""
        os.kill(self.pid, signal.SIGSTOP)
        end = time.monotonic() + timeout_s
        while not _all_threads_stopped(self.pid):
            if time.monotonic() > end:
                raise TransportError(f"peer process {self.pid} did not stop in {timeout_s} s")
            time.sleep(0.001)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self._proc.wait(10)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self, timeout_s: float = 30.0) -> dict[str, int] | None:
        """Close the child's transport and wait for it to exit; its final status if it could."""
        status = None
        if self.alive:
            with contextlib.suppress(Exception):
                _send(self._sock, ["close", []])
                status = self._reply(timeout_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout_s)
        if self.alive:
            self._proc.kill()
            self._proc.wait(timeout_s)
        self._sock.close()
        return status

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    _fd, _blob = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
    _name, _options = msgspec.msgpack.decode(_blob)
    _child_main(socket.socket(fileno=_fd), _name, _options)
