"""How the router asks its workers things: one order client per worker, one query outstanding.

:class:`Asker` sends each worker its message and waits a bounded time for all answers; a query
not answered yet is waited for again rather than resent, and one outstanding for ``timeout_s``
is resent, on a fresh client when its worker is not up (zmq would otherwise hand the old frames
to the next process at that address). It owns the clients and ``WorkerHandle.asked``; it
decides nothing about who is up or paired. See docs/serving.md (Membership).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout

from kvplane.errors import KVPlaneError
from kvplane.serving.messages import AnyMessage, InfoQuery
from kvplane.serving.router.workers import WorkerHandle
from kvplane.serving.rpc import RpcClient


def _late_answer(fut: Future[AnyMessage], msg: AnyMessage) -> bool:
    """Whether done ``fut`` holds a late answer to census query ``msg`` worth using (see
    :meth:`Asker.ask`): a reply, not a failure or a cancellation."""
    return isinstance(msg, InfoQuery) and not fut.cancelled() and fut.exception() is None


class Asker:
    """Order clients and outstanding queries of a router's workers (see the module
    docstring). Thread-safe. ``timeout_s``: a call's wait and the age at which an outstanding
    query is resent; ``secret``: the order sockets' (CURVE; None: plain); once ``stop`` is set
    no client is made."""

    def __init__(self, *, timeout_s: float, stop: threading.Event, secret: bytes | None) -> None:
        self.timeout_s = timeout_s
        self.secret = secret
        self._stop = stop
        self._lock = threading.Lock()  # guards w.client swaps and w.asked

    def client(self, address: str) -> RpcClient:
        """A new order client of the worker at ``address``."""
        return RpcClient(address, timeout_s=self.timeout_s, secret=self.secret)

    def close(self, workers: Sequence[WorkerHandle]) -> None:
        """Set ``stop`` and close every one of ``workers``' clients (none is made after)."""
        with self._lock:
            self._stop.set()
            clients = [w.client for w in workers]
        for c in clients:
            c.close()

    def recycle(self, w: WorkerHandle) -> None:
        """Give ``w`` a fresh client and drop the old one with zmq's frames still queued for
        it (its calls still waiting fail with ``RemoteDisconnectError``); nothing once
        ``stop`` is set."""
        with self._lock:
            old = self._swap(w)
        if old is not None:
            old.close(discard=True)

    def _swap(self, w: WorkerHandle) -> RpcClient | None:
        """Under the lock: put a fresh client in ``w`` and forget what it was asked; the old
        client, for the caller to close (None, and nothing changed, once ``stop`` is set)."""
        if self._stop.is_set():
            return None
        old, w.client = w.client, self.client(w.address)
        w.asked.clear()
        return old

    def ask(
        self, asks: Sequence[tuple[WorkerHandle, AnyMessage]], wait_s: float
    ) -> list[AnyMessage | None]:
        """Ask each worker its message, wait ``wait_s`` in all: the replies in order (None: none
        in time, or the call failed). One not answered yet is waited for again, not resent —
        unless sent ``timeout_s`` ago or more: then sent again, on a fresh client if the worker
        is not up (see the module docstring). An ``InfoQuery`` answered after the last ask
        waited for it is that answer (resending it would throw the answer away, and with
        replies slower than ``wait_s`` no census would ever hear the worker); other answers are
        not reused (a pairing's may come from a process since restarted)."""
        return [got for got, _ in self.ask_sent(asks, wait_s)]

    def ask_sent(
        self, asks: Sequence[tuple[WorkerHandle, AnyMessage]], wait_s: float
    ) -> list[tuple[AnyMessage | None, float]]:
        """:meth:`ask`, with when each message whose answer it is was sent (monotonic)."""
        futs: list[tuple[Future[AnyMessage], float]] = []
        now = time.monotonic()
        olds: list[RpcClient] = []
        with self._lock:
            stale = [w for w, msg in asks if self._stale(w, msg, now)]
            for w in {id(w): w for w in stale if not w.up}.values():
                old = self._swap(w)
                if old is not None:
                    olds.append(old)
            for w, msg in asks:
                fut, sent = w.asked.get(msg, (None, now))
                if fut is not None and self._stale(w, msg, now):  # up (or stopping): resend
                    w.client.forget(fut)
                if fut is None or (fut.done() and not _late_answer(fut, msg)):
                    fut, sent = w.client.call_async(msg), now
                    w.asked[msg] = (fut, now)
                futs.append((fut, sent))
        for old in olds:  # off the lock: a close joins the client's loop thread
            old.close(discard=True)
        end = time.monotonic() + wait_s
        out: list[tuple[AnyMessage | None, float]] = []
        for (w, msg), (fut, sent) in zip(asks, futs, strict=True):
            try:
                got: AnyMessage | None = fut.result(timeout=max(0.0, end - time.monotonic()))
            except FutureTimeout:
                got = None  # still outstanding: the next ask waits for it
            except (KVPlaneError, CancelledError):  # not sent: asked afresh next time
                got = None
            if fut.done():
                with self._lock:
                    if w.asked.get(msg, (None, 0.0))[0] is fut:
                        del w.asked[msg]
            out.append((got, sent))
        return out

    def _stale(self, w: WorkerHandle, msg: AnyMessage, now: float) -> bool:
        """Under the lock: whether ``w``'s outstanding ``msg`` was sent ``timeout_s`` ago."""
        fut, sent = w.asked.get(msg, (None, now))
        return fut is not None and not fut.done() and now - sent >= self.timeout_s
