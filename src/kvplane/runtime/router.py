"""The router: pairs prefill and decode workers and carries each request to both.

Theory of operation
-------------------
The router knows workers by their order-socket addresses. :meth:`Router.connect` asks each for
its :class:`~kvplane.runtime.messages.WorkerInfo` and tells every decode worker to shake hands
with every prefill worker's PD endpoint (the PD protocol then runs between them directly; the
router never touches KV). :meth:`Router.submit` picks a pair round-robin, mints a session id
that is unique across router restarts, and sends the prefill order and the decode order at
once — the prefill side starts computing while the decode side allocates; whichever PD frame
arrives first opens the session. The decode worker answers when the request ends; that answer
is the request's result. An order a worker refuses fails the request and cancels the other
side. :meth:`Router.refresh` re-pairs workers that restarted (new incarnation).

``kvplane serve router`` wraps a router in an order socket that serves ``Generate`` (and
``CancelOrder``/``StatsQuery``) to clients.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from kvplane.errors import InvalidArgumentError, ProtocolError, TransferTimeoutError
from kvplane.runtime.messages import (
    Ack,
    AnyMessage,
    CancelOrder,
    DecodeOrder,
    ErrorReply,
    Generate,
    InfoQuery,
    PairWith,
    PrefillOrder,
    RequestResult,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
)
from kvplane.runtime.rpc import Reply, RpcClient


@dataclass(slots=True)
class WorkerHandle:
    """A worker as the router sees it."""

    address: str
    client: RpcClient
    info: WorkerInfo | None = None


@dataclass(slots=True)
class _Flight:
    prefill: WorkerHandle
    decode: WorkerHandle
    decode_incarnation: int
    out: Future[RequestResult]
    num_tokens: int


class Router:
    """Pairs workers and serves requests (see the module docstring). Thread-safe."""

    def __init__(self, prefill: list[str], decode: list[str], *, timeout_s: float = 10.0) -> None:
        if not prefill or not decode:
            raise InvalidArgumentError("a router needs at least one prefill and one decode worker")
        self.prefill = [WorkerHandle(a, RpcClient(a, timeout_s=timeout_s)) for a in prefill]
        self.decode = [WorkerHandle(a, RpcClient(a, timeout_s=timeout_s)) for a in decode]
        self.timeout_s = timeout_s
        self._tag = secrets.token_hex(4)
        self._serial = itertools.count()
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()
        self._settle_lock = threading.Lock()

    def close(self) -> None:
        for w in self.prefill + self.decode:
            w.client.close()

    # -- pairing ---------------------------------------------------------------------------------
    def _info(self, w: WorkerHandle) -> WorkerInfo:
        got = w.client.call(InfoQuery())
        if not isinstance(got, WorkerInfo):
            raise ProtocolError(f"worker at {w.address} answered {got!r} to an info query")
        return got

    def connect(self) -> None:
        """Learn every worker and pair every decode worker with every prefill worker."""
        self.refresh(force=True)

    def refresh(self, *, force: bool = False) -> list[str]:
        """Re-learn workers; re-pair those that restarted (or all, with ``force``). Returns the
        peer ids of the workers that were (re-)paired."""
        changed: list[WorkerHandle] = []
        for w in self.prefill + self.decode:
            info = self._info(w)
            if force or w.info is None or w.info.incarnation != info.incarnation:
                changed.append(w)
            w.info = info
        paired = {w.info.peer_id for w in changed if w.info is not None}
        self._fail_orphans()
        for d in self.decode:
            for p in self.prefill:
                if d in changed or p in changed:
                    self._pair(d, p)
        return sorted(paired)

    def _settle(self, out: Future[RequestResult], result: RequestResult) -> None:
        """Resolve ``out`` once (a restart and a late answer may race)."""
        with self._settle_lock:
            if not out.done():
                out.set_result(result)

    def _fail_orphans(self) -> None:
        """Requests whose decode worker restarted will never be answered: fail them now."""
        with self._lock:
            orphans = [
                (rid, f) for rid, f in self._flights.items()
                if f.decode.info is not None and f.decode.info.incarnation != f.decode_incarnation
            ]  # fmt: skip
            for rid, _ in orphans:
                del self._flights[rid]
        for rid, f in orphans:
            lost = RequestResult(
                request_id=rid, state="failed", num_tokens=f.num_tokens,
                reason="decode worker restarted",
            )  # fmt: skip
            self._settle(f.out, lost)

    def _pair(self, d: WorkerHandle, p: WorkerHandle) -> None:
        if p.info is None:  # pragma: no cover - refresh fills every info first
            raise ProtocolError(f"prefill worker at {p.address} is unknown")
        got = d.client.call(PairWith(pd_address=p.info.pd_address))
        if isinstance(got, ErrorReply):
            raise ProtocolError(f"decode worker at {d.address} cannot pair: {got.reason}")

    # -- requests --------------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        token_ids: tuple[int, ...] | list[int],
        *,
        max_new_tokens: int = 1,
        step_size: int = 0,
    ) -> Future[RequestResult]:
        """Start one request; the future resolves to its :class:`RequestResult`."""
        n = next(self._serial)
        p = self.prefill[n % len(self.prefill)]
        d = self.decode[n % len(self.decode)]
        if p.info is None or d.info is None:
            raise ProtocolError("call Router.connect() before submitting requests")
        sid = f"{request_id}/{self._tag}.{n}"
        tokens = tuple(int(t) for t in token_ids)
        out: Future[RequestResult] = Future()
        with self._lock:
            self._flights[request_id] = _Flight(p, d, d.info.incarnation, out, len(tokens))
        pre = p.client.call_async(
            PrefillOrder(
                request_id=request_id,
                session_id=sid,
                decode_peer=d.info.peer_id,
                token_ids=tokens,
                step_size=step_size,
            )
        )
        dec = d.client.call_async(
            DecodeOrder(
                request_id=request_id,
                session_id=sid,
                prefill_peer=p.info.peer_id,
                token_ids=tokens,
                max_new_tokens=max_new_tokens,
            )
        )

        def on_prefill(f: Future[AnyMessage]) -> None:
            got = f.result() if not f.cancelled() else None
            if isinstance(got, ErrorReply):
                d.client.call_async(
                    CancelOrder(request_id=request_id, reason=f"prefill refused: {got.reason}")
                )

        def on_decode(f: Future[AnyMessage]) -> None:
            with self._lock:
                self._flights.pop(request_id, None)
            got = f.result() if not f.cancelled() else None
            if isinstance(got, RequestResult):
                out.set_result(got)
                return
            reason = got.reason if isinstance(got, ErrorReply) else f"unexpected reply {got!r}"
            p.client.call_async(CancelOrder(request_id=request_id, reason=reason))
            out.set_result(
                RequestResult(
                    request_id=request_id, state="failed", reason=reason, num_tokens=len(tokens)
                )
            )

        pre.add_done_callback(on_prefill)
        dec.add_done_callback(on_decode)
        return out

    def generate(
        self, request_id: str, token_ids: tuple[int, ...] | list[int], **kw: int
    ) -> RequestResult:
        """:meth:`submit` and wait (``TransferTimeoutError`` after ``timeout_s``)."""
        fut = self.submit(request_id, token_ids, **kw)
        try:
            return fut.result(timeout=self.timeout_s)
        except TimeoutError:
            raise TransferTimeoutError(f"request {request_id!r} did not end in time") from None

    def cancel(self, request_id: str, *, side: str = "decode", reason: str = "cancelled") -> bool:
        """Cancel a request on its decode or prefill worker; False if it is not in flight."""
        if side not in ("decode", "prefill"):
            raise InvalidArgumentError(f"side must be 'decode' or 'prefill', got {side!r}")
        with self._lock:
            flight = self._flights.get(request_id)
        if flight is None:
            return False
        w = flight.decode if side == "decode" else flight.prefill
        w.client.call_async(CancelOrder(request_id=request_id, reason=reason))
        return True

    def stats(self, *, timeline: bool = False) -> dict[str, WorkerStats]:
        out = {}
        for w in self.prefill + self.decode:
            got = w.client.call(StatsQuery(timeline=timeline))
            if isinstance(got, WorkerStats):
                out[got.peer_id] = got
        return out

    # -- serving clients -------------------------------------------------------------------------
    def handle(self, msg: AnyMessage, reply: Reply) -> None:
        """Order-socket handler of ``kvplane serve router``."""
        if isinstance(msg, Generate):
            fut = self.submit(
                msg.request_id,
                msg.token_ids,
                max_new_tokens=msg.max_new_tokens,
                step_size=msg.step_size,
            )
            fut.add_done_callback(lambda f: reply(f.result()))
        elif isinstance(msg, CancelOrder):
            ok = self.cancel(msg.request_id, reason=msg.reason)
            reply(Ack(detail="cancelling" if ok else "unknown request"))
        elif isinstance(msg, InfoQuery):
            reply(
                WorkerInfo(
                    role="router", peer_id="router", pd_address="", incarnation=0, transport=""
                )
            )
        else:
            reply(ErrorReply(reason=f"the router does not take {type(msg).__name__}"))
