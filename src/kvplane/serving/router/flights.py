"""The router's record of one request in flight, and the cancels it sends its workers.

:class:`Flight` holds the request's :class:`~kvplane.serving.router.gather_routes.Route`
(its decode worker and one prefill worker, or a gather set's several), the session id each
of them knows it by, its orders' futures, its result future and its deadline. It decides
nothing: the router settles, fails and cancels flights through it. See docs/serving.md.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvplane.serving.messages import AnyMessage, CancelOrder, RequestResult
from kvplane.serving.router.gather_routes import Route
from kvplane.serving.router.workers import WorkerHandle
from kvplane.serving.rpc import RpcClient


@dataclass(slots=True, eq=False)
class Flight:
    """A request submitted and not yet settled. ``session_id``: the request's (the decode
    worker's) session; ``sessions``: per sender of ``route``, in order, the session id it
    knows the request by (a gather member's id, or ``session_id``)."""

    request_id: str
    session_id: str
    route: Route
    sessions: tuple[str, ...]
    out: Future[RequestResult]
    num_tokens: int
    deadline: float
    orders: list[tuple[RpcClient, Future[AnyMessage]]] = field(default_factory=list)
    """Each order's future with the client it went out on (a recycled worker has another)."""
    uncached_tokens: int | None = None
    """Prompt tokens its prefill worker was predicted to compute, not load, when picked (the
    load cache-aware routing counts); None: all of ``num_tokens``."""
    decode_sent: bool = False
    """Its decode order is queued on the decode worker's client: a cancel may follow it."""
    held_cancel: str | None = None
    """The reason of a decode cancel asked for before its order was queued (sent after it)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def queued_tokens(self) -> int:
        """What the request weighs in its prefill workers' queues (tokens to compute)."""
        return self.num_tokens if self.uncached_tokens is None else self.uncached_tokens

    @property
    def decode(self) -> WorkerHandle:
        return self.route.decode

    @property
    def decode_incarnation(self) -> int:
        """The decode worker's incarnation when the request was picked."""
        return self.route.decode_info.incarnation

    @property
    def prefills(self) -> tuple[WorkerHandle, ...]:
        """The prefill workers that feed the request (several for a gather), in order."""
        return tuple(s.worker for s in self.route.senders)

    def named(self, reason: str) -> list[WorkerHandle]:
        """The prefill workers whose peer ids (quoted) ``reason`` names; all when it names
        none (a worker's refusal names the peer it is not connected to)."""
        senders = self.route.senders
        return [s.worker for s in senders if repr(s.info.peer_id) in reason] or list(self.prefills)

    def failed(self, reason: str) -> RequestResult:
        """The request's failed result, for ``reason`` (cut to the wire's limit)."""
        return RequestResult(
            request_id=self.request_id, state="failed", reason=reason[:4000],
            num_tokens=self.num_tokens,
        )  # fmt: skip

    def orphaned(self) -> str:
        """Why the request cannot end well now that its workers changed: its decode worker is
        down or restarted, or a prefill worker of it is down (a gather's lost member fails
        the request for all); empty while none did."""
        d = self.decode
        if not d.up:
            return f"decode worker at {d.address} is unreachable"
        if d.info is not None and d.info.incarnation != self.decode_incarnation:
            return "decode worker restarted"
        for p in self.prefills:
            if not p.up:
                return f"prefill worker at {p.address} is unreachable"
        return ""

    def cancel_decode(self, reason: str) -> None:
        """Send the decode worker a cancel, keyed by the request's session (never answered to
        anyone); a gather's decode side ends every member, so every sender hears of it. Asked
        before the decode order is queued (a prefill refused at once), it is held and goes out
        right after the order (:meth:`decode_queued`), which it would otherwise overtake: the
        decode worker would answer "unknown request", then wait for the KV until its deadline."""
        with self._lock:
            if not self.decode_sent:
                self.held_cancel = self.held_cancel or reason
                return
        _cancel(self.decode, self.request_id, self.session_id, reason)

    def decode_queued(self) -> None:
        """The decode order is queued on the decode client: send the cancel held until now."""
        with self._lock:
            self.decode_sent = True
            reason, self.held_cancel = self.held_cancel, None
        if reason is not None:
            _cancel(self.decode, self.request_id, self.session_id, reason)

    def cancel_prefills(self, reason: str, *, up_only: bool = False) -> None:
        """Send each prefill worker of the request (``up_only``: each one up) a cancel, keyed
        by the session it knows the request by."""
        for w, sid in zip(self.prefills, self.sessions, strict=True):
            if w.up or not up_only:
                _cancel(w, self.request_id, sid, reason)


def _cancel(w: WorkerHandle, request_id: str, session_id: str, reason: str) -> None:
    """Send ``w`` a cancel of ``request_id`` while it is bound to ``session_id``."""
    w.client.call_async(
        CancelOrder(request_id=request_id, reason=reason[:4000], session_id=session_id)
    )
