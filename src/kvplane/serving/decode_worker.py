"""The decode worker: pre-allocates, receives a request's KV, then decodes from it.

The receiver session decides the outcome and the ledger decides the memory; the received prompt
is marked computed in one place. A sliding-window pool allocates only the blocks of the window
the sender sends (the earlier entries point at the pool's null block). See docs/serving.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq

from kvplane.blocks import BlockTable
from kvplane.errors import KVPlaneError, ProtocolError
from kvplane.ids import PeerId, RequestId, SessionId, TokenRange
from kvplane.metrics import MetricsRegistry
from kvplane.pd.actions import Finished, Release
from kvplane.pd.events import Cancel, StartTransfer
from kvplane.pd.states import Role, SessionState
from kvplane.pipeline.timeline import Mark
from kvplane.serving import worker_requests as book
from kvplane.serving.dials import Dials
from kvplane.serving.gather_orders import member_id, members
from kvplane.serving.gather_wait import GatherWait
from kvplane.serving.messages import (
    NOT_CONNECTED,
    Ack,
    AnyMessage,
    CancelOrder,
    DecodeOrder,
    ErrorReply,
    PairWith,
    RequestResult,
    WorkerStats,
)
from kvplane.serving.pools import prompt_digest
from kvplane.serving.prefill_worker import report_counters
from kvplane.serving.producers.base import DecodeJob, KVDecoder
from kvplane.serving.producers.model import PromptChecker
from kvplane.serving.rpc import Reply
from kvplane.serving.worker import Worker, WorkerHooks
from kvplane.serving.worker_config import WorkerConfig
from kvplane.transports.base import Transport

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Decode:
    order: DecodeOrder
    reply: Reply
    sid: SessionId
    peer: PeerId
    tokens: np.ndarray
    table: BlockTable | None = None
    group_tables: tuple[BlockTable, ...] = ()
    slot: int | None = None
    prefix_tokens: int = 0
    opened: bool = False
    cancelled: str = ""
    outcome: SessionState | None = None
    replied: bool = False
    failed_at: float | None = None
    gather: GatherWait | None = None


class DecodeWorker(Worker):
    """See the module docstring. ``decoder`` consumes received KV (verifier or a real model)."""

    role = "decode"
    kv_role = Role.RECEIVER

    def __init__(
        self,
        config: WorkerConfig,
        decoder: KVDecoder,
        *,
        metrics: MetricsRegistry | None = None,
        transport: Transport | None = None,
        hooks: WorkerHooks | None = None,
    ) -> None:
        super().__init__(config, decoder, metrics=metrics, transport=transport, hooks=hooks)
        self.decoder = decoder
        self.dials = Dials(lambda a, t: self.endpoint.connect(a, timeout_s=t), self._close_dials)
        self._requests: dict[RequestId, _Decode] = {}
        self._by_session: dict[SessionId, _Decode] = {}
        self._waiting: deque[_Decode] = deque()

    def _requests_live(self) -> int:
        return len(self._requests)

    # -- orders ----------------------------------------------------------------------------------
    def _on_order(self, msg: AnyMessage, reply: Reply) -> None:
        if isinstance(msg, DecodeOrder):
            self._accept(msg, reply)
        elif isinstance(msg, CancelOrder):
            detail = self._cancel(RequestId(msg.request_id), msg.reason, msg.session_id)
            reply(Ack(detail=detail))
        else:
            super()._on_order(msg, reply)

    def pair(self, pd_address: str, timeout_s: float = 5.0) -> PeerId:
        """Shake hands with a prefill worker's PD endpoint (any thread but the PD loop), on a
        new connection: the previous one to that address, and those to another address that
        reached the same peer, are closed (:class:`~kvplane.serving.dials.Dials`)."""
        return self.dials.pair(pd_address, timeout_s)

    def _close_dials(self, address: str) -> None:
        """Close every PD connection this worker dialled to ``address`` (none: nothing)."""
        self.endpoint.disconnect(address)

    def _on_message(self, msg: AnyMessage, reply: Reply) -> None:
        if isinstance(msg, PairWith):  # a handshake waits on the network: not on this thread
            threading.Thread(
                target=self._pair_and_reply,
                args=(msg.pd_address, reply),
                name="kvplane-pair",
                daemon=True,
            ).start()
        else:
            if isinstance(msg, DecodeOrder):  # its wait for the worker loop is measured
                self.timeline.record(Mark.ORDER_RECEIVED, msg.request_id)
            super()._on_message(msg, reply)

    def _pair_and_reply(self, address: str, reply: Reply) -> None:
        """Pair and answer, whatever happens (a malformed address is a zmq error)."""
        try:
            reply(Ack(detail=self.pair(address)))
        except (KVPlaneError, zmq.ZMQError) as exc:
            reply(ErrorReply(reason=f"pairing with {address!r} failed: {exc}"[:4000]))
        except Exception as exc:  # a bug: answer, log, keep serving
            self.counters["pair_errors"] += 1
            log.exception("pairing with %r failed", address)
            reply(ErrorReply(reason=f"pairing with {address!r} failed: {exc!r}"[:4000]))

    def _accept(self, order: DecodeOrder, reply: Reply) -> None:
        began = time.monotonic()
        rid = RequestId(order.request_id)
        book.check_new(self._requests, self._by_session, rid, SessionId(order.session_id))
        n, capacity = len(order.token_ids), min(p.capacity for p in self.pools.block_pools)
        need = book.received_need(self.pools, n, 1)
        if isinstance(self.decoder, PromptChecker):
            self.decoder.check_prompt(
                np.asarray(order.token_ids, dtype=np.int64), order.max_new_tokens
            )
            need = book.received_need(self.pools, n, order.max_new_tokens)
        book.check_fits(rid, need, capacity)
        names = [order.prefill_peer, *(s.peer for s in order.senders)]
        live = self.endpoint.call(
            lambda: [self.participant.peers.is_live(PeerId(n)) for n in names]
        )
        for name in (n for n, ok in zip(names, live, strict=True) if not ok):
            raise ProtocolError(f"prefill peer {name!r} {NOT_CONNECTED}")
        for mid in (member_id(order.session_id, s) for s in order.senders):
            book.check_new(self._requests, self._by_session, rid, SessionId(mid))
        req = _Decode(
            order,
            reply,
            SessionId(order.session_id),
            PeerId(order.prefill_peer),
            np.asarray(order.token_ids, dtype=np.int64),
        )
        self._requests[rid] = req
        self._by_session[req.sid] = req
        for mid in (member_id(order.session_id, s) for s in order.senders):
            self._by_session[SessionId(mid)] = req  # the actions name members
        self.timeline.record(Mark.ACCEPT_START, rid, t=began)  # ends when its session opens
        self.timeline.record(Mark.ORDER, rid)
        self._waiting.append(req)
        self._admit_waiting()

    def _cancel(self, rid: RequestId, reason: str, sid: str | None = None) -> str:
        """Cancel request ``rid`` (only while it is bound to session ``sid``, when given)."""
        req = book.find_to_stop(self._requests, rid, sid)
        if req is None:
            return "unknown request"
        if not req.opened:
            req.cancelled = reason
            self._end(req, SessionState.ABORTED, reason)
            for wire_id, peer in self._senders(req):
                with contextlib.suppress(ProtocolError):  # peer gone: its sessions end anyway
                    self.endpoint.abandon(wire_id, peer, reason)  # the prefill frees it now
            return "cancelled before the transfer started"
        try:
            self.endpoint.send(req.sid, Cancel(reason=reason))
        except ProtocolError:
            return "session already ended"
        return "cancelling"

    def _admit_waiting(self) -> None:
        while self._waiting:
            req = self._waiting[0]
            if req.outcome is not None:
                self._waiting.popleft()
                continue
            # each KV cache group gets blocks only for the window the sender sends
            got = book.admit_memory(self.pools, self.config.block_size, req, received=True)
            if got is None:
                return
            self._waiting.popleft()
            (table, _), rid = got, RequestId(req.order.request_id)
            req.prefix_tokens = table.num_cached_tokens
            start = StartTransfer(
                request_id=rid,
                dst_block_ids=book.destination_ids(self.pools, req),
                prefix_tokens=req.prefix_tokens,
                num_tokens=len(req.tokens),
            )
            try:
                self._open(req, start)
            except ProtocolError as exc:  # peer lost or session id reused: fail, free at once
                self._end(req, SessionState.FAILED, str(exc))
                continue
            req.opened = True
            self.timeline.record(Mark.ACCEPT_DONE, rid)

    def _senders(self, req: _Decode) -> list[tuple[SessionId, PeerId]]:
        """Each sender's wire session id and peer (the members of a gathered request)."""
        if not req.order.senders:
            return [(req.sid, req.peer)]
        sid = req.order.session_id
        return [(SessionId(member_id(sid, s)), PeerId(s.peer)) for s in req.order.senders]

    def _open(self, req: _Decode, start: StartTransfer) -> None:
        """Open the receiver session, or the gather of several senders over our KV pool's
        heads × layers (``ProtocolError`` as the endpoint's, nothing opened)."""
        if not req.order.senders:
            self.endpoint.open_receiver(req.sid, req.peer, start)
            return
        kv = self.pools.kv.layout
        heads, layers = kv.head_range, self.pools.layer_ids  # every KV cache group's layers
        gather = self.endpoint.open_gather(
            req.sid, members(req.order.senders), start, heads=heads, layers=layers
        )
        req.gather = GatherWait(gather)

    # -- protocol actions --------------------------------------------------------------------------
    def _on_pd(self, act: object) -> None:
        if isinstance(act, Release) and act.role is Role.RECEIVER:
            req = self._by_session.get(act.session_id)
            if req is None:
                self.counters["release_unknown_session"] += 1
            elif req.gather is not None:
                req.gather.release(act.session_id, act.state)
                self._gather_over(req)
            elif act.state is SessionState.SUCCESS:
                self._deliver(req)
            else:
                self._release(req)
        elif isinstance(act, Finished) and act.role is Role.RECEIVER:
            req = self._by_session.get(act.session_id)
            if req is not None and req.gather is not None:
                self._member_finished(req, act)
                return
            self.rmetrics.finished(act.state.value, act.reason)
            if req is None:
                return
            req.outcome = act.state
            self.timeline.record(Mark.SESSION_END, req.order.request_id, detail=act.state.value)
            if act.state is not SessionState.SUCCESS:
                if req.failed_at is None:
                    req.failed_at = time.monotonic()
                self._answer(req, self._result(req, act.state, act.reason))
            self._maybe_forget(req)

    def _member_finished(self, req: _Decode, act: Finished) -> None:
        """A member of a gathered request ended: its first failure answers the request; the
        last member's end decides the rest (:meth:`_gather_over`)."""
        gather = req.gather
        if gather is None:  # pragma: no cover - called for gathered requests only
            return
        if gather.finish(act.session_id, act.state, act.reason):
            if req.failed_at is None:
                req.failed_at = time.monotonic()
            self._answer(req, self._result(req, act.state, f"{act.session_id}: {act.reason}"))
        if gather.finished:  # the PD loop retired every member: the gather is ours to read
            state = gather.gather.state
            self.rmetrics.finished(state.value, gather.gather.reason)
            self.timeline.record(Mark.SESSION_END, req.order.request_id, detail=state.value)
        self._gather_over(req)

    def _gather_over(self, req: _Decode) -> None:
        """Once every member ended and released: decode from the KV if the gather succeeded,
        else answer its failure (if not yet) and free the memory; nothing partial is used."""
        gather = req.gather
        if gather is None or not gather.done:
            return
        state, reason = gather.verdict()
        req.outcome = state
        if state is SessionState.SUCCESS:
            self._deliver(req)
        else:
            self._answer(req, self._result(req, state, reason))
            self._release(req)

    def _result(self, req: _Decode, state: SessionState, reason: str) -> RequestResult:
        return RequestResult(
            request_id=req.order.request_id,
            state=state.value,
            reason=reason,
            num_tokens=len(req.tokens),
            prefix_tokens=req.prefix_tokens,
        )

    def _deliver(self, req: _Decode) -> None:
        """The KV is ours: check the tail, decode, cache the received blocks, answer, free."""
        if req.table is None or req.slot is None:  # pragma: no cover - opened implies both
            return
        rid = RequestId(req.order.request_id)
        ready = self.timeline.record(Mark.DECODE_READY, rid)
        tail = self.pools.read_tail(req.slot)
        n = len(req.tokens)
        if tail.num_tokens != n or tail.digest != prompt_digest(req.tokens):
            self.counters["prompt_mismatches"] += 1  # other tokens' KV: never cache it
            why = f"the prefill computed another prompt ({tail.num_tokens} tokens, other digest)"
            self._answer(req, self._result(req, SessionState.FAILED, why))
            self._release(req)
            return
        job = DecodeJob(
            rid,
            req.tokens,
            req.table,
            self.pools.blocks,
            tail.first_token,
            req.order.max_new_tokens,
            TokenRange(req.prefix_tokens, n),
            req.slot,
            req.group_tables,
            self.pools.group_blocks,
        )
        left = n - req.table.num_computed_tokens
        cacheable = left > 0 and not self.pools.kv.layout.windowed
        trusted = not self.decoder.verifies  # the digest matched: its KV is the prompt's
        if cacheable and trusted:  # before decode, which may grow the table past the prompt
            req.table.mark_computed(self.pools.blocks, left)
        try:
            out = self.decoder.decode(job, self.pools.kv, self.pools.state)
        except KVPlaneError as exc:  # the request fails; the worker and its memory do not
            self.counters["decode_errors"] += 1
            self._answer(req, self._result(req, SessionState.FAILED, f"decode failed: {exc}"))
            self._release(req)
            return
        self.timeline.record(Mark.DECODE_DONE, rid, detail=str(len(out.tokens)))
        mismatches = out.mismatches
        if cacheable and not trusted and not mismatches:
            req.table.mark_computed(self.pools.blocks, left)  # caches the received blocks
        self._answer(
            req,
            RequestResult(
                request_id=rid,
                state=SessionState.SUCCESS.value,
                tokens=out.tokens,
                num_tokens=n,
                prefix_tokens=req.prefix_tokens,
                mismatches=mismatches,
                ready_at=ready.t,
            ),
        )
        self._release(req)

    def _end(self, req: _Decode, state: SessionState, reason: str) -> None:
        """A request that never reached a session (or no longer can): answer and free now; one
        whose session never opened is counted as finished here (no ``Finished`` will come)."""
        if req.outcome is None and not req.opened:
            self.rmetrics.finished(state.value, reason or req.cancelled)
        req.outcome = req.outcome or state
        self._answer(req, self._result(req, req.outcome, reason or req.cancelled))
        self._release(req)

    def _answer(self, req: _Decode, result: RequestResult) -> None:
        if not req.replied:
            req.replied = True
            req.reply(result)

    def _release(self, req: _Decode) -> None:
        """The ledger released the destination (or it never was the session's): free it. The
        ``RELEASED`` mark and the release latency are recorded only when memory was held."""
        book.free_memory(self, req)
        self._maybe_forget(req)
        self._admit_waiting()

    def _maybe_forget(self, req: _Decode) -> None:
        """Drop the request once it is answered, its memory freed and its session over."""
        if req.replied and req.table is None and req.outcome is not None:
            book.forget(self._requests, self._by_session, req)
            for sid, _ in self._senders(req) if req.gather is not None else ():
                if self._by_session.get(sid) is req:
                    del self._by_session[sid]

    def stats(self, *, timeline: bool = False) -> WorkerStats:
        """The base stats plus the model's attention plans and fallbacks, and the PD
        connections closed for a pairing (``pairing_connections_closed``)."""
        base = super().stats(timeline=timeline)
        extra = report_counters(self.metrics, self.decoder)
        extra["pairing_connections_closed"] = self.dials.closed
        return msgspec.structs.replace(base, counters={**base.counters, **extra})
