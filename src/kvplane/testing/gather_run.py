"""One gather request run in-process: TP/PP prefill ranks feeding one decode worker.

For tests: :func:`start_gather` starts the workers from ``kvplane serve`` arguments in this
process, :func:`gather_pieces` picks the senders as the router's gather does (from the
workers' own reports), :func:`run_gather` sends one request through them over the workers'
order sockets and returns its result. Never imported by production modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import ExitStack

from kvplane.apps.serve import build_worker
from kvplane.apps.serve_config import settle
from kvplane.cli import build_parser
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.gather_orders import gather_orders, sender_pieces
from kvplane.serving.messages import Ack, AnyMessage, DecodeOrder, SenderPiece
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.router.gather_sets import gather_set
from kvplane.serving.router.workers import WorkerHandle
from kvplane.serving.rpc import RpcClient
from kvplane.serving.worker import Worker
from kvplane.testing.cluster import wait_for


def serve_in_process(*argv: str) -> Worker:
    """The worker ``kvplane serve ARGV`` builds (no environment, no config file), started."""
    worker = build_worker(settle(build_parser().parse_args(["serve", *argv]), {}))
    worker.start()
    return worker


def start_gather(
    stack: ExitStack, ranks: Sequence[Sequence[str]], decode: Sequence[str]
) -> tuple[list[PrefillWorker], DecodeWorker]:
    """Prefill rank workers from each of ``ranks``' serve argv and a decode worker from
    ``decode``'s, started in this process, closed by ``stack``; the decode worker is paired
    with every rank."""
    started = []
    for argv in ranks:
        w = serve_in_process(*argv)
        stack.callback(w.close)
        assert isinstance(w, PrefillWorker)
        started.append(w)
    d = serve_in_process(*decode)
    stack.callback(d.close)
    assert isinstance(d, DecodeWorker)
    for p in started:
        d.pair(p.info().pd_address)
    return started, d


def gather_pieces(ranks: Sequence[PrefillWorker], d: DecodeWorker) -> tuple[SenderPiece, ...]:
    """The senders of decode worker ``d`` among ``ranks``, as the router's gather picks them;
    ``AssertionError`` when the ranks do not cover ``d``."""
    with ExitStack() as stack:
        handles = []
        for w in [*ranks, d]:
            client = stack.enter_context(contextlib.closing(RpcClient(w.address)))
            handles.append(WorkerHandle(w.address, client, info=w.info(), up=True))
    chosen = gather_set(handles[: len(ranks)], handles[len(ranks)])
    assert chosen is not None, "the ranks do not cover the decode worker"
    names = {w.address: w.config.name for w in ranks}
    return sender_pieces([(names[h.address], piece) for h, piece in chosen])


def run_gather(
    ranks: Sequence[PrefillWorker],
    d: DecodeWorker,
    prompt: tuple[int, ...],
    max_new_tokens: int,
    *,
    session_id: str = "g",
    timeout_s: float = 60.0,
) -> AnyMessage:
    """Request ``r`` of ``prompt`` through ``ranks`` into ``d``: the decode order first (``d``
    must hold it before any sender dials), then each rank's order, each acknowledged as
    accepted; returns ``d``'s answer (a ``RequestResult`` on success)."""
    base = DecodeOrder(request_id="r", session_id=session_id, prefill_peer="p0",
                       token_ids=prompt, max_new_tokens=max_new_tokens)  # fmt: skip
    dec, pre = gather_orders(base, gather_pieces(ranks, d), decode_peer="d")
    with ExitStack() as stack:
        clients = [stack.enter_context(contextlib.closing(RpcClient(w.address)))
                   for w in [d, *ranks]]  # fmt: skip
        fut = clients[0].call_async(dec)
        wait_for(lambda: "r" in d._requests, what="the decode order")
        for c, order in zip(clients[1:], pre, strict=True):
            assert c.call(order) == Ack(detail="accepted")
        return fut.result(timeout=timeout_s)
