"""The worker processes of one parallel layout that ``kvplane bench pd``'s layout rows time:
the prefill ranks of the layout (one for ``1->1``, two TP ranks or two pipeline stages) and one
decode process, one pipelining mode (:class:`Ranks`), and the layouts themselves
(:data:`LAYOUTS`).

The router does not route a request gathered from several ranks yet, so :class:`Ranks` sends
the orders itself, as the router would: a decode order naming every sender
(:func:`~kvplane.serving.gather_orders.gather_orders`) and one prefill order per rank; a
``1->1`` request gets the plain pair of orders. Owns the processes and clients it starts
(stopped on :meth:`Ranks.close`); derives nothing from timelines beyond
:func:`~.pd_metrics.gather_times`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from kvplane.apps.bench.pd_metrics import gather_times, request_fields
from kvplane.apps.bench.pd_pair import MODE_FLAGS, START_TIMEOUT_S, PairSpec
from kvplane.apps.demo_procs import Child, ProcessGroup, new_secret
from kvplane.errors import KVPlaneError, ProtocolError, TransferTimeoutError
from kvplane.pipeline.trace import events_from_dicts
from kvplane.serving.gather_orders import gather_orders, sender_pieces
from kvplane.serving.messages import (
    Ack,
    AnyMessage,
    DecodeOrder,
    InfoQuery,
    PairWith,
    PrefillOrder,
    RequestResult,
    SenderPiece,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
)
from kvplane.serving.router.gather_sets import gather_set
from kvplane.serving.router.workers import WorkerHandle
from kvplane.serving.rpc import RpcClient
from kvplane.serving.worker_config import SECRET_TRANSPORTS

LAYOUTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "1->1": ((),),
    "tp2->1": tuple(("--tp-rank", str(r), "--tp-size", "2") for r in (0, 1)),
    "pp2->1": tuple(("--pp-stage", str(s), "--pp-size", "2") for s in (0, 1)),
}
"""Per layout row, each prefill rank's ``kvplane serve prefill`` flags (decode: one process
holding every head and layer)."""
BASE_LAYOUT = "1->1"
DECODE = "d"
CALL_TIMEOUT_S = 120.0
"""Seconds an order's answer may take (a request's whole life on a loaded 2-core host)."""


def rank_name(i: int) -> str:
    """The PD peer id of prefill rank ``i`` of a layout."""
    return f"p{i}"


class Ranks:
    """One layout's prefill ranks and decode process in one mode (module docstring).

    All processes start at once; with ``wait=False`` the group is usable only after
    :meth:`connect`, so that several groups can start together."""

    def __init__(
        self, work: Path, spec: PairSpec, layout: str, *, mode: str, wait: bool = True
    ) -> None:
        if layout not in LAYOUTS:
            raise KVPlaneError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
        secure = spec.transport in SECRET_TRANSPORTS
        self.group = ProcessGroup(work, new_secret() if secure else None)
        self.layout = layout
        self.tokens: dict[str, tuple[int, ...]] = {}
        self.clients: dict[str, RpcClient] = {}
        self.senders: tuple[SenderPiece, ...] = ()
        common = [
            "--transport", spec.transport, "--block-size", "16",
            "--num-blocks", str(spec.num_blocks), "--num-slots", "4", *spec.producer,
            "--step-size", str(spec.step), "--slice-timeout", "60", "--deadline", "120",
            "--heartbeat", "1", "--lease", "10", *MODE_FLAGS[mode],
            *([] if secure else ["--insecure"]),
        ]  # fmt: skip
        try:
            roles = [(rank_name(i), "prefill", list(f)) for i, f in enumerate(LAYOUTS[layout])]
            for name, role, flags in [*roles, (DECODE, "decode", [])]:
                (work / name).mkdir(parents=True, exist_ok=True)
                args = ["--name", name, *common, *flags]
                self.group.children[name] = Child(role, args, work / name, self.group.secret)
            if wait:
                self.connect()
        except BaseException:
            self.close()
            raise

    def connect(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait for every process's announce line (at most ``timeout_s``), pair the decode
        process with each rank, and choose the ranks' pieces (``ProtocolError`` when they do
        not tile the decode pool); the group is stopped when this fails."""
        deadline = time.monotonic() + timeout_s
        try:
            for name, child in self.group.children.items():
                info = child.announce(deadline)
                self.clients[name] = RpcClient(
                    str(info["control"]), timeout_s=CALL_TIMEOUT_S, secret=self.group.secret
                )
            ranks = [n for n in self.clients if n != DECODE]
            for name in ranks:
                pd = str(self.group.children[name].info["pd"])
                self._expect(self.clients[DECODE].call(PairWith(pd_address=pd)), "pairing")
            if len(ranks) > 1:
                self.senders = self._pieces(ranks)
        except BaseException:
            self.close()
            raise

    def _pieces(self, ranks: Sequence[str]) -> tuple[SenderPiece, ...]:
        handles = []
        for name in [*ranks, DECODE]:
            info = self.clients[name].call(InfoQuery())
            if not isinstance(info, WorkerInfo):
                raise ProtocolError(f"bench rank {name} answered {info!r} to an info query")
            handles.append(WorkerHandle(name, self.clients[name], info=info, up=True))
        chosen = gather_set(handles[:-1], handles[-1])
        if chosen is None or len(chosen) != len(ranks):
            raise ProtocolError(f"the ranks of layout {self.layout} do not tile its decode pool")
        return sender_pieces([(h.address, piece) for h, piece in chosen])

    @staticmethod
    def _expect(reply: AnyMessage, doing: str) -> None:
        if not isinstance(reply, Ack):
            raise ProtocolError(f"bench {doing}: {reply!r}")

    def run(self, rid: str, tokens: list[int], step: int) -> float:
        """Serve one request; its TTFT (orders sent → first token ready on the decode side),
        ms. Its tokens are kept in :attr:`tokens`. :class:`KVPlaneError` when it did not
        succeed or a rank refused its order."""
        self.group.check(f"serving {rid}")
        base = DecodeOrder(request_id=rid, session_id=f"{rid}/{self.layout}",
                           prefill_peer=rank_name(0), token_ids=tuple(tokens))  # fmt: skip
        if self.senders:
            dec, pre = gather_orders(base, self.senders, decode_peer=DECODE, step_size=step)
        else:
            dec = base
            pre = [PrefillOrder(request_id=rid, session_id=base.session_id, decode_peer=DECODE,
                                token_ids=base.token_ids, step_size=step)]  # fmt: skip
        t0 = time.monotonic()
        result = self.clients[DECODE].call_async(dec)
        acks = [self.clients[o.share.peer if o.share else rank_name(0)].call_async(o) for o in pre]
        for ack in acks:  # a rank answers at once: accepted or refused
            self._expect(_answer(ack, rid), f"prefill order of {rid}")
        res = _answer(result, rid)
        if not isinstance(res, RequestResult) or res.state != "success":
            raise KVPlaneError(f"bench request {rid} of layout {self.layout} ended {res!r}")
        self.tokens[rid] = res.tokens
        return (res.ready_at - t0) * 1e3

    def times(self, rids: Sequence[str]) -> tuple[list[dict[str, float | None]], int]:
        """Per request, :data:`~.pd_metrics.TIME_FIELDS` of the gather's timelines (every
        rank's with the decode side's: :func:`~.pd_metrics.gather_times`), and the events the
        workers left out (when not 0, every field is None)."""
        stats = {}
        for name, client in self.clients.items():
            got = client.call(StatsQuery(timeline=True))
            if not isinstance(got, WorkerStats):
                raise ProtocolError(f"bench rank {name} answered {got!r} to a stats query")
            stats[name] = got
        truncated = sum(s.timeline_truncated for s in stats.values())
        events = {name: events_from_dicts(s.timeline) for name, s in stats.items()}
        out = []
        for rid in rids:
            mine = {name: [e for e in evs if e.request_id == rid] for name, evs in events.items()}
            decode = mine.pop(DECODE)
            times = gather_times([[*evs, *decode] for evs in mine.values()])
            out.append(request_fields(times, truncated=truncated > 0))
        return out, truncated

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.group.stop()


def _answer(fut: Future[AnyMessage], rid: str) -> AnyMessage:
    """``fut``'s reply within :data:`CALL_TIMEOUT_S` (``TransferTimeoutError`` after it)."""
    try:
        return fut.result(timeout=CALL_TIMEOUT_S)
    except FutureTimeout:
        raise TransferTimeoutError(f"bench request {rid}: no answer in time") from None
