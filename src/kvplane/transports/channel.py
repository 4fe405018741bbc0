"""Socket plumbing shared by the ``tcp`` and ``shm`` transports: channels and their threads.

:class:`Link` (a sender that never reads, a receiver that never writes; keep-alives when idle)
and :class:`Listener` (a thread per admitted connection; past the caps of ``bounds`` the
oldest handshaking one is evicted, or the newcomer closed).
The handshake lives in ``handshake``. See docs/transports.md.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable

from kvplane.transports.bounds import Admission, Ticket
from kvplane.transports.wire import (
    HEADER,
    FrameType,
    Header,
    pack_header,
    parse_header,
    recv_bytes,
    recv_exact,
)

MAX_FDS = 250
"""Most segment file descriptors one WELCOME may carry (the kernel's SCM_MAX_FD is 253)."""


class Channel:
    """A connected stream socket speaking ``wire`` frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, *parts: bytes | memoryview) -> None:
        with self._send_lock:
            for part in parts:
                self.sock.sendall(part)

    def send_frame(
        self, ftype: FrameType, xfer_id: int, body: bytes = b"", count: int = 0, flags: int = 0
    ) -> None:
        self.send(pack_header(ftype, xfer_id, len(body), count, flags) + body)

    def recv_header(self) -> Header:
        return parse_header(recv_bytes(self.sock, HEADER.size))

    def recv_body(self, header: Header) -> bytes:
        return recv_bytes(self.sock, header.length)

    def recv_into(self, view: memoryview) -> None:
        recv_exact(self.sock, view)

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        self.sock.close()


class Listener:
    """Accepts connections on ``sock`` and runs ``serve(channel, ticket)`` in a thread per
    connection that ``admission`` admits; any other is closed at once, unanswered. ``serve``
    settles the admitted connection's slot (``Admission.opened``/``release``) before it
    returns; the channel is closed after."""

    def __init__(
        self, sock: socket.socket, name: str, serve: Callable[[Channel, Ticket], None],
        admission: Admission,
    ) -> None:  # fmt: skip
        self.sock = sock
        self._name = name
        self._serve = serve
        self._admission = admission
        self._lock = threading.Lock()
        self._channels: set[Channel] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            ch = Channel(conn)
            ticket = self._admission.admit(conn)
            if ticket is None:
                ch.close()  # past a cap with nothing to evict: no thread, no byte
                continue
            with self._lock:
                if self._closed:
                    self._admission.release(ticket)
                    ch.close()
                    return
                thread = threading.Thread(target=self._run, args=(ch, ticket),
                                          name=f"{self._name}-serve", daemon=True)  # fmt: skip
                self._channels.add(ch)
                self._threads.add(thread)
            thread.start()

    def _run(self, ch: Channel, ticket: Ticket) -> None:
        try:
            self._serve(ch, ticket)
        finally:
            self._admission.release(ticket)  # before the close: an eviction may still shut it
            ch.close()
            with self._lock:
                self._channels.discard(ch)
                self._threads.discard(threading.current_thread())

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            channels, threads = list(self._channels), list(self._threads)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for ch in channels:
            ch.shutdown()
        self._thread.join(timeout)
        for thread in threads:
            thread.join(timeout)


_STOP = object()


class Link:
    """Initiator end of one connection: a sender thread for jobs, a receiver thread for frames."""

    def __init__(
        self,
        ch: Channel,
        name: str,
        *,
        run_job: Callable[[object], None],
        drop_job: Callable[[object], None],
        on_frame: Callable[[Header], None],
        on_down: Callable[[Link, str], None],
        on_recv_exit: Callable[[Link], None] | None = None,
        drain_s: float = 0.0,
        keepalive_s: float = 0.0,
    ) -> None:
        self.ch = ch
        self._keepalive_s = keepalive_s or None
        """A sender idle this long sends a PING (None: never), so the target's idle bound
        (``bounds.ConnectionLimits.idle_timeout_s``) spares a quiet but live link."""
        self._drain_s = drain_s
        """How long :meth:`fail` lets a running job end before it shuts the socket (0: at
        once, which unblocks a sender stuck in ``sendall``; shm's target drops its pins at EOF,
        so a copy into its memory must end first)."""
        self._idle = threading.Event()
        self._idle.set()
        self.current: object | None = None
        """The job the sender is running now (None between jobs)."""
        self._run_job, self._drop_job = run_job, drop_job
        self._on_frame, self._on_down = on_frame, on_down
        self._on_recv_exit = on_recv_exit
        self.lock = threading.Lock()
        self.down = False
        self.reason = ""
        self._jobs: queue.Queue[object] = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"{name}-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    def put(self, job: object) -> bool:
        """Queue a job for the sender; False if the link is already down (job not taken)."""
        with self.lock:
            if self.down:
                return False
            self._jobs.put(job)
            return True

    def queued(self) -> list[object]:
        """A snapshot of the jobs waiting behind the one running, oldest first, so the sender
        can prepare them ahead (``shm`` sends their PINs); the queue is not changed."""
        with self._jobs.mutex:
            return [job for job in self._jobs.queue if job is not _STOP]

    def fail(self, reason: str) -> None:
        """Take the link down once: shut the socket, wake both threads, tell the transport."""
        with self.lock:
            if self.down:
                return
            self.down = True
            self.reason = reason
            self._jobs.put(_STOP)
        if self._drain_s and threading.current_thread() is not self._sender:
            self._idle.wait(self._drain_s)  # a job running now ends before the peer sees EOF
        self.ch.shutdown()
        self._on_down(self, reason)

    def _send_loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._keepalive_s)
            except queue.Empty:
                self._ping()
                continue
            if job is _STOP:
                break
            self._idle.clear()  # before reading ``down``: a fail() from now on waits for us
            try:
                if self.down:
                    self._drop_job(job)
                    continue
                self.current = job
                self._run_job(job)
            except Exception as exc:  # any failure mid-job leaves the stream unusable
                self._drop_job(job)
                self.fail(f"send failed: {exc!r}")
            finally:
                self.current = None
                self._idle.set()
        while True:  # the link is down: whatever is still queued will never run
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                self._drop_job(job)

    def _ping(self) -> None:
        try:
            self.ch.send_frame(FrameType.PING, 0)
        except OSError as exc:
            self.fail(f"keep-alive failed: {exc!r}")

    def _recv_loop(self) -> None:
        try:
            while True:
                self._on_frame(self.ch.recv_header())
        except Exception as exc:  # EOF, reset, malformed frame: the link is over either way
            self.fail(f"connection lost: {exc!r}")
        finally:
            if self._on_recv_exit is not None:
                self._on_recv_exit(self)

    def join_sender(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the sender thread to end (it does once the link is down
        and its running job has ended); whether it has. Not from the sender thread."""
        self._sender.join(timeout)
        return not self._sender.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        self.fail("closed")
        self._sender.join(timeout)
        self._receiver.join(timeout)
        self.ch.close()
