"""Request/reply over zmq for the control messages (127.0.0.1 unless told otherwise).

One loop thread per side touches its socket; sends never block; bad frames (``rpc_codec``) are
dropped or answered with an ``ErrorReply``; a server admits connections through its door
(``rpc_auth``: CURVE with a secret, a handshake timeout, a cap on connections) and bounds the
calls it holds (``rpc_admission``). See docs/serving.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import zmq

from kvplane.errors import (
    InvalidArgumentError,
    KVPlaneError,
    RemoteDisconnectError,
    TransferTimeoutError,
)
from kvplane.metrics import MetricsRegistry
from kvplane.pd.door import ListenerDoor
from kvplane.serving.messages import AnyMessage, Envelope, ErrorReply, StatsQuery
from kvplane.serving.rpc_admission import MAX_PENDING, MAX_PENDING_PER_PEER, Admission
from kvplane.serving.rpc_auth import (
    HANDSHAKE_FAILED,
    MAX_CONNECTIONS,
    OrderKeys,
    order_door,
    order_keys,
    secure_client,
)
from kvplane.serving.rpc_codec import Dropped, Refused, decode, encode
from kvplane.validators import require_finite_positive, require_size

log = logging.getLogger(__name__)
DEFAULT_MAX_FRAME = 64 << 20
Reply = Callable[[AnyMessage], None]
Handler = Callable[[AnyMessage, Reply], None]
MAX_HELD = 1024
"""Most frames a loop keeps waiting for its socket to take them (the outbox bound)."""
SERVER_SEND_WAIT_S = 10.0
"""How long a server's reply may wait for its socket (a ROUTER drops rather than waits)."""
SHARED_ANSWERS: tuple[type, ...] = (StatsQuery,)
"""Queries answered from the server's state alone: identical ones waiting together get one
answer (one computation however many arrive)."""
DROPPED, REFUSED = "dropped_", "refused_"
"""Counter prefixes of the frames not served: dropped unanswered, or refused with an answer."""


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """One multipart frame to send, the call it starts (None: a reply) and when it expires."""

    parts: list[bytes]
    call_id: int | None
    expires: float


def _fail(fut: Future[AnyMessage], exc: KVPlaneError) -> None:
    """Resolve ``fut`` with ``exc`` unless it was cancelled (forgotten) already."""
    if fut.set_running_or_notify_cancel():
        fut.set_exception(exc)


class _Loop:
    """One socket, one loop thread, a queue of outgoing multipart frames and a wake-up socket."""

    def __init__(
        self,
        kind: int,
        name: str,
        max_frame: int,
        send_wait_s: float,
        *,
        secret: bytes | None,
        metrics: MetricsRegistry | None = None,
    ) -> None:
        self.max_frame = require_size("max_frame", max_frame, min=1)
        self.send_wait_s = require_finite_positive("timeout_s", send_wait_s, InvalidArgumentError)
        self.keys: OrderKeys | None = None if secret is None else order_keys(secret)
        self.counters: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._drops = None if metrics is None else metrics.counter(
            "order_socket_drops", "Order-socket frames dropped or refused, by reason", ["reason"]
        )  # fmt: skip
        self._ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame + 4096)
        self._door: ListenerDoor | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        wake = f"inproc://rpc-wake-{id(self)}"
        self._pull: zmq.Socket[bytes] = self._ctx.socket(zmq.PULL)
        self._pull.bind(wake)
        self._push: zmq.Socket[bytes] = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(wake)
        self._push_lock = threading.Lock()
        self._out: queue.SimpleQueue[_Outgoing] = queue.SimpleQueue()
        self._held: deque[_Outgoing] = deque()  # the loop thread's own
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False

    def _watch_handshakes(self) -> None:
        """Count every handshake refused (``refused_unauthenticated``), from the socket's
        monitor; call before the socket connects (a server's door watches its own)."""
        self._monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED)

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to counter ``key`` (any thread); a drop or refusal also goes to the
        ``order_socket_drops`` metric, labelled with the reason (the key less its prefix)."""
        with self._count_lock:
            self.counters[key] += n
        if self._drops is not None and key.startswith((DROPPED, REFUSED)):
            self._drops.labels(key.split("_", 1)[1]).inc(n)

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters (any thread)."""
        with self._count_lock:
            return dict(self.counters)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def _send_later(self, parts: list[bytes], call_id: int | None = None) -> None:
        self._out.put(_Outgoing(parts, call_id, time.monotonic() + self.send_wait_s))
        self._wake()

    def _wake(self) -> None:
        """Wake the loop from its poll now (any thread; a no-op once the waker is closed)."""
        with self._push_lock, contextlib.suppress(zmq.ZMQError):
            self._push.send(b"", zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                waiting = bool(self._held)
                poller.modify(self.sock, zmq.POLLIN | (zmq.POLLOUT if waiting else 0))
                ready = dict(poller.poll(10 if waiting else 50))
                if self._pull in ready:
                    with contextlib.suppress(zmq.Again):
                        while True:
                            self._pull.recv(zmq.NOBLOCK)
                self._flush()
                if self._monitor is not None and self._monitor in ready:
                    self._refused_handshakes(self._monitor)
                if int(ready.get(self.sock, 0)) & zmq.POLLIN:
                    with contextlib.suppress(zmq.Again):
                        for _ in range(64):
                            self._on_frames(self.sock.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                self.count("socket_errors")
                log.exception("rpc loop socket error (the loop keeps serving)")
            except Exception:
                self.count("loop_errors")
                log.exception("rpc loop error (the loop keeps serving)")
        with contextlib.suppress(zmq.ZMQError):  # closing: hand over the last replies
            self._flush()

    def _refused_handshakes(self, monitor: zmq.Socket[bytes]) -> None:
        """Count the handshake failures ``monitor`` reported (loop thread)."""
        n = 0
        with contextlib.suppress(zmq.Again):
            while True:
                monitor.recv_multipart(zmq.NOBLOCK)
                n += 1
        if n:
            self.count(REFUSED + "unauthenticated", n)

    def _flush(self) -> None:
        """Hand the socket what it takes now, without blocking; keep the rest, in order, in the
        bounded outbox until it expires (see the module docstring). Loop thread only."""
        while self._held and self._offer(self._held[0]):
            self._held.popleft()
        while not self._out.empty():
            item = self._out.get_nowait()
            if self._held or not self._offer(item):
                if len(self._held) >= MAX_HELD:
                    self._unsent(item, f"{MAX_HELD} frames already wait to be sent")
                else:
                    self._held.append(item)
        now = time.monotonic()
        while self._held and self._held[0].expires <= now:
            self._unsent(self._held.popleft(), f"not sent within {self.send_wait_s:g} s")

    def _offer(self, item: _Outgoing) -> bool:
        """Whether ``item`` is done with: sent now, or forgotten (not sent, counted); False if
        the socket cannot take it now."""
        if not self._wanted(item):
            self.count("unsent_forgotten")
            return True
        try:
            self.sock.send_multipart(item.parts, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _wanted(self, item: _Outgoing) -> bool:
        """Whether a frame waiting in the outbox should still be sent."""
        return True

    def _unsent(self, item: _Outgoing, why: str) -> None:
        """A frame the socket did not take: dropped and counted."""
        self.count("unsent")

    def _on_frames(self, parts: list[bytes]) -> None:
        raise NotImplementedError

    def _decode(self, payload: bytes) -> Envelope | Refused | None:
        """The envelope; a :class:`Refused` (counted) to answer; None (counted) to drop."""
        got = decode(payload, self.max_frame)
        if isinstance(got, Dropped):
            self.count(DROPPED + got.kind)
            return None
        if isinstance(got, Refused):
            self.count(REFUSED + got.kind)
        return got

    def close(self, linger_ms: int = 500) -> None:
        """Stop the loop and close the socket; frames already handed to zmq may still leave
        for ``linger_ms`` (bounded)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake()  # the loop sees the stop now, not at the end of its poll
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        with self._push_lock:
            self._push.close(linger=0)
        self._pull.close(linger=0)
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self._monitor.close(linger=0)
        self.sock.close(linger=linger_ms)
        if self._door is not None:  # after the socket: it answers ZAP until then
            self._door.close()
        self._ctx.term()


class RpcServer(_Loop):
    """Serves one handler on a ROUTER bound at ``bind`` (see the module docstring).

    ``secret``: the cluster secret; only clients holding it are served (CURVE), None serves
    anyone (explicit insecure mode). ``metrics``: where drops are counted
    (``order_socket_drops``). ``max_pending``, ``max_pending_per_peer``: the most calls held
    unanswered in all and per connection; beyond, a call is refused with an ``ErrorReply``
    (:class:`~kvplane.serving.rpc_admission.Admission`). ``max_connections``: the most
    inbound connections held; a newcomer past it evicts the oldest one that has not proven
    the secret (``rpc_auth.order_door``).
    """

    def __init__(
        self,
        bind: str,
        handler: Handler,
        *,
        name: str = "kvplane-rpc",
        max_frame: int = DEFAULT_MAX_FRAME,
        secret: bytes | None = None,
        metrics: MetricsRegistry | None = None,
        max_pending: int = MAX_PENDING,
        max_pending_per_peer: int = MAX_PENDING_PER_PEER,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.admission = Admission(
            max_pending=max_pending, max_pending_per_peer=max_pending_per_peer,
            shared=SHARED_ANSWERS,
        )  # fmt: skip
        super().__init__(
            zmq.ROUTER, name, max_frame, SERVER_SEND_WAIT_S, secret=secret, metrics=metrics
        )
        self._handler = handler
        try:
            self._door = order_door(
                self._ctx, secret=secret, max_connections=max_connections, name=name,
                count=self.count,
            )  # fmt: skip
            self._door.guard(self.sock)
            self.sock.bind(bind)
        except (zmq.ZMQError, KVPlaneError):
            self.close(0)  # nothing left open (an address in use, a bad address or bound)
            raise
        self.address: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._door.start(self.address)  # the door admits before the loop starts

    def snapshot(self) -> dict[str, int]:
        """The counters and ``connections_open`` (any thread)."""
        out = super().snapshot()
        if self._door is not None:
            out["connections_open"] = self._door.connections_open
        return out

    def _answer(self, identity: bytes, call_id: int, msg: AnyMessage) -> None:
        """Send ``msg`` as the answer to call ``call_id`` of connection ``identity`` (any
        thread); one too large for a frame is replaced by an ``ErrorReply`` naming its size."""
        frame = encode(call_id, msg)
        if len(frame) > self.max_frame:
            self.count("replies_oversized")
            reason = (
                f"the {type(msg).__name__} reply ({len(frame)} bytes) exceeds the "
                f"{self.max_frame}-byte frame limit"
            )
            frame = encode(call_id, ErrorReply(reason=reason))
        self._send_later([identity, frame])

    def _reply_once(self, identity: bytes, call_id: int) -> Reply:
        """The reply of an admitted call: the first answer goes out and gives its slot back;
        any later one is dropped (counted in ``replies_repeated``)."""
        answered = False

        def reply(msg: AnyMessage) -> None:
            nonlocal answered
            with self._count_lock:  # one answer wins, even from two threads
                first, answered = not answered, True
            if not first:
                self.count("replies_repeated")
                return
            self.admission.release(identity)
            self._answer(identity, call_id, msg)

        return reply

    def _on_frames(self, parts: list[bytes]) -> None:
        if len(parts) != 2:
            self.count(DROPPED + "bad_parts")
            return
        identity, payload = parts
        env = self._decode(payload)
        if env is None:
            return
        if isinstance(env, Refused):
            self._answer(identity, env.call_id, ErrorReply(reason=env.reason))
            return
        busy = self.admission.admit(identity)
        if busy is not None:
            self.count(REFUSED + "over_bound")
            self._answer(identity, env.call_id, ErrorReply(reason=busy))
            return
        self.count("calls")
        reply = self.admission.join(env.body, self._reply_once(identity, env.call_id))
        if reply is None:  # an identical query already waits: its answer is this one's
            self.count("calls_shared")
            return
        try:
            self._handler(env.body, reply)
        except KVPlaneError as exc:
            self.count("handler_errors")
            reply(ErrorReply(reason=str(exc)[:4000]))
        except Exception as exc:  # a bug in a handler: answer it, log it, keep serving
            self.count("handler_errors")
            log.exception("rpc handler error")
            reply(ErrorReply(reason=f"internal error: {type(exc).__name__}: {exc}"[:4000]))


class RpcClient(_Loop):
    """Calls a server at ``address``; thread-safe (any thread may call). ``timeout_s``: how
    long :meth:`call` waits, and how long a frame may wait to be sent (module docstring).
    ``secret``: the cluster secret (CURVE: the server must hold it too); None: plain."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        secret: bytes | None = None,
    ) -> None:
        super().__init__(zmq.DEALER, "kvplane-rpc-client", max_frame, timeout_s, secret=secret)
        self.address = address
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._futures: dict[int, Future[AnyMessage]] = {}
        self._lock = threading.Lock()
        self._client_closed = False
        try:
            if self.keys is not None:
                secure_client(self.sock, self.keys)
                self._watch_handshakes()
            self.sock.connect(address)
        except zmq.ZMQError:
            self.close(0)  # nothing left open (a bad address)
            raise
        self.start()

    def close(self, linger_ms: int = 500, *, discard: bool = False) -> None:
        """Close (``discard``: drop every frame not yet sent, at once) and resolve the calls
        still waiting with ``RemoteDisconnectError``."""
        with self._lock:
            self._client_closed = True
            waiting = list(self._futures.values())
            self._futures.clear()
        super().close(0 if discard else linger_ms)
        for fut in waiting:
            _fail(fut, RemoteDisconnectError(f"the client of {self.address} is closed"))

    def call_async(self, msg: AnyMessage) -> Future[AnyMessage]:
        """Send ``msg``; its reply resolves the future. It fails with ``TransferTimeoutError``
        when the frame is not sent in time, with ``RemoteDisconnectError`` when the client is
        closed (see the module docstring); it never resolves when the server took the frame
        and died."""
        return self._start(msg)[1]

    def _start(self, msg: AnyMessage) -> tuple[int, Future[AnyMessage]]:
        fut: Future[AnyMessage] = Future()
        call_id = next(self._ids)
        with self._lock:
            closed = self._client_closed
            if not closed:
                self._futures[call_id] = fut
        if closed:
            _fail(fut, RemoteDisconnectError(f"the client of {self.address} is closed"))
        else:
            self._send_later([encode(call_id, msg)], call_id)
        return call_id, fut

    def forget(self, fut: Future[AnyMessage]) -> None:
        """Stop waiting for ``fut`` (its late reply is counted and dropped); a frame of it that
        still waits in the outbox is not sent."""
        with self._lock:
            for call_id, known in list(self._futures.items()):
                if known is fut:
                    del self._futures[call_id]
        fut.cancel()

    def call(self, msg: AnyMessage, timeout_s: float | None = None) -> AnyMessage:
        """Send ``msg`` and wait for its reply (``TransferTimeoutError`` after the timeout)."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        call_id, fut = self._start(msg)
        try:
            return fut.result(timeout=wait)
        except FutureTimeout:
            with self._lock:
                self._futures.pop(call_id, None)
            fut.cancel()
            raise TransferTimeoutError(
                f"no reply from {self.address} to {type(msg).__name__} within {wait} s"
            ) from None

    def _wanted(self, item: _Outgoing) -> bool:
        with self._lock:
            return item.call_id is None or item.call_id in self._futures

    def _unsent(self, item: _Outgoing, why: str) -> None:
        self.count("unsent")
        with self._lock:
            fut = None if item.call_id is None else self._futures.pop(item.call_id, None)
        if fut is not None:
            _fail(fut, TransferTimeoutError(f"no call to {self.address}: {why}"))

    def _on_frames(self, parts: list[bytes]) -> None:
        if len(parts) != 1:
            self.count(DROPPED + "bad_parts")
            return
        env = self._decode(parts[0])
        if env is None:
            return
        with self._lock:
            fut = self._futures.pop(env.call_id, None)
        body = env.body if isinstance(env, Envelope) else ErrorReply(reason=env.reason)
        if fut is None:
            self.count("late_replies")
        elif not fut.cancelled():
            fut.set_result(body)
