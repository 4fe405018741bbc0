"""Two ``kvplane serve prefill --tp-rank r --tp-size 2`` (or ``--pp-stage s --pp-size 2``)
processes feed one decode process a request's KV as one gather: tokens identical to one-process
``generate``, every worker's pools and ledgers balance; a SIGKILLed rank fails the request
cleanly. The orders go straight to the workers (the router's gather routing is not wired yet)."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator

import pytest

from kvplane.cli import main
from kvplane.serving.gather_orders import gather_orders, sender_pieces
from kvplane.serving.messages import (
    Ack,
    DecodeOrder,
    InfoQuery,
    PairWith,
    PrefillOrder,
    RequestResult,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
)
from kvplane.serving.router.gather_sets import gather_set
from kvplane.serving.router.workers import WorkerHandle
from kvplane.serving.rpc import RpcClient
from kvplane.testing.cluster import TEST_SECRET, Proc, free_port, idle, wait_for

PROMPT = tuple(range(5, 50))  # 45 tokens: three prefill steps of 16
NEW = 4
TIMING = ["--heartbeat", "0.25", "--lease", "2", "--in-doubt", "0.2", "--drain", "0.5",
          "--retransmit", "0.05", "--deadline", "8"]  # fmt: skip
"""A lease long enough that a starved but live process on a loaded machine is not lost."""
StartProcs = Callable[..., list[Proc]]


def _args(name: str, *extra: str) -> list[str]:
    return ["--name", name, "--control", f"tcp://127.0.0.1:{free_port()}", "--pd",
            f"tcp://127.0.0.1:{free_port()}", "--model", "tiny-llama", "--num-blocks", "16",
            "--num-slots", "4", "--step-size", "16", *TIMING, *extra]  # fmt: skip


@contextlib.contextmanager
def _deployment(
    procs: list[Proc], start_procs: StartProcs, flag: str = "tp"
) -> Iterator[tuple[list[Proc], dict[str, RpcClient], DecodeOrder, list[PrefillOrder]]]:
    """Two prefill ranks (``flag`` "tp": TP ranks; "pp": pipeline stages) and a decode
    process, paired, with the orders of request ``r``."""
    rank = {"tp": ("--tp-rank", "--tp-size"), "pp": ("--pp-stage", "--pp-size")}[flag]
    ranks = [
        (lambda r=r: Proc("prefill", _args(f"p{r}", rank[0], str(r), rank[1], "2"))) for r in (0, 1)
    ]
    started = start_procs(procs, *ranks, lambda: Proc("decode", _args("d")))
    clients = {str(p.info["name"]): RpcClient(p.control, timeout_s=20, secret=TEST_SECRET)
               for p in started}  # fmt: skip
    try:
        for p in started[:2]:
            assert clients["d"].call(PairWith(pd_address=str(p.info["pd"]))) == Ack(detail=str(
                p.info["name"]))  # fmt: skip
        handles = []
        for name in ("p0", "p1", "d"):
            info = clients[name].call(InfoQuery())
            assert isinstance(info, WorkerInfo)
            handles.append(WorkerHandle(name, clients[name], info=info, up=True))
        chosen = gather_set(handles[:2], handles[2])
        assert chosen is not None
        senders = sender_pieces([(h.address, piece) for h, piece in chosen])
        base = DecodeOrder(request_id="r", session_id="g", prefill_peer="p0", token_ids=PROMPT,
                           max_new_tokens=NEW)  # fmt: skip
        dec, pre = gather_orders(base, senders, decode_peer="d")
        yield started, clients, dec, pre
    finally:
        for c in clients.values():
            c.close()


def _reference() -> list[int]:
    out = io.StringIO()
    ids = ",".join(map(str, PROMPT))
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--model", "tiny-llama", "--prompt-ids", ids,
                     "--max-new-tokens", str(NEW), "--json"]) == 0  # fmt: skip
    tokens: list[int] = json.loads(out.getvalue())["tokens"]
    return tokens


def _balanced(client: RpcClient) -> None:
    def settled() -> bool:
        stats = client.call(StatsQuery())
        return isinstance(stats, WorkerStats) and idle(stats)

    wait_for(settled, what="an idle worker")
    stats = client.call(StatsQuery())
    assert isinstance(stats, WorkerStats) and stats.integrity == ""


@pytest.mark.parametrize(
    ("flag", "shares"),
    [
        ("tp", {"p0": ("g/0.0", (0, 1), (0, 1), True), "p1": ("g/0.1", (1, 2), (0, 1), False)}),
        ("pp", {"p0": ("g/0.0", (0, 2), (0,), False), "p1": ("g/1.0", (0, 2), (1,), True)}),
    ],
)
def test_two_prefill_rank_processes_feed_one_decode_process(
    procs: list[Proc], start_procs: StartProcs, flag: str, shares: dict[str, tuple[object, ...]]
) -> None:
    with _deployment(procs, start_procs, flag) as (_, clients, dec, pre):
        got = {}
        for o in pre:
            assert o.share is not None
            got[o.share.peer] = (o.session_id, o.share.heads, o.share.layers, o.share.lead)
        assert got == shares
        fut = clients["d"].call_async(dec)
        for order in pre:
            assert order.share is not None
            assert clients[order.share.peer].call(order) == Ack(detail="accepted")
        res = fut.result(timeout=60)
        assert isinstance(res, RequestResult)
        assert (res.state, res.reason, list(res.tokens)) == ("success", "", _reference())
        for c in clients.values():
            _balanced(c)


def test_a_sigkilled_rank_fails_the_request_and_the_survivors_balance(
    procs: list[Proc], start_procs: StartProcs
) -> None:
    with _deployment(procs, start_procs) as (started, clients, dec, pre):
        fut = clients["d"].call_async(dec)
        assert clients["p0"].call(pre[0]) == Ack(detail="accepted")
        started[1].kill()  # rank 1 never sends: its loss must fail the whole gather
        res = fut.result(timeout=60)
        assert isinstance(res, RequestResult)
        assert (res.state, res.reason, res.tokens) == ("failed", "g/0.1: peer lost", ())
        for name in ("p0", "d"):
            _balanced(clients[name])
