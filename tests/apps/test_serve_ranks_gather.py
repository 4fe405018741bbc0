"""Two ``kvplane serve prefill --tp-rank r --tp-size 2`` (or ``--pp-stage s --pp-size 2``)
processes feed one decode process a request's KV as one gather: tokens identical to one-process
``generate``, every worker's pools and ledgers balance; a SIGKILLed rank fails the request
cleanly. The orders go straight to the workers, or through ``kvplane serve router``: there one
rank SIGKILLed mid-transfer (its first slice landed, its last held by a seeded hang of
``kvplane.testing.chaos_serve``) fails that request cleanly, the survivors balance, and once the
router marks the rank down the next request is refused (nothing covers the decode worker)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import pytest

from kvplane.serving.gather_orders import gather_orders, sender_pieces
from kvplane.serving.messages import (
    Ack,
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
from kvplane.serving.router.gather_sets import gather_set
from kvplane.serving.router.workers import WorkerHandle
from kvplane.serving.rpc import RpcClient
from kvplane.testing.cluster import TEST_SECRET, Proc, free_port, idle, wait_for
from kvplane.testing.reference import generate_tokens

PROMPT = tuple(range(5, 50))  # 45 tokens: three prefill steps of 16
NEW = 4
TIMING = ["--heartbeat", "0.25", "--lease", "2", "--in-doubt", "0.2", "--drain", "0.5",
          "--retransmit", "0.05", "--deadline", "8"]  # fmt: skip
"""A lease long enough that a starved but live process on a loaded machine is not lost."""
HANG_SEED = 2
"""``random.Random(2)``'s first draws are 0.96, 0.95, 0.06: with ``--chaos-hang 0.5`` the
rank's first two batches (slices 0 and 1) end and its third (the last slice) hangs."""
StartProcs = Callable[..., list[Proc]]


def _args(name: str, *extra: str) -> list[str]:
    return ["--name", name, "--control", f"tcp://127.0.0.1:{free_port()}", "--pd",
            f"tcp://127.0.0.1:{free_port()}", "--model", "tiny-llama", "--num-blocks", "16",
            "--num-slots", "4", "--step-size", "16", *TIMING, *extra]  # fmt: skip


Orders = Callable[[str, str], tuple[DecodeOrder, list[PrefillOrder]]]
"""``orders(request_id, session_id)``: a gather's decode order and its prefill orders."""


@contextlib.contextmanager
def _deployment(
    procs: list[Proc], start_procs: StartProcs, flag: str = "tp"
) -> Iterator[tuple[list[Proc], dict[str, RpcClient], Orders]]:
    """Two prefill ranks (``flag`` "tp": TP ranks; "pp": pipeline stages) and a decode
    process, paired, with the orders of a request of :data:`PROMPT` over them."""
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

        def orders(request_id: str, session_id: str) -> tuple[DecodeOrder, list[PrefillOrder]]:
            base = DecodeOrder(request_id=request_id, session_id=session_id, prefill_peer="p0",
                               token_ids=PROMPT, max_new_tokens=NEW)  # fmt: skip
            return gather_orders(base, senders, decode_peer="d")

        yield started, clients, orders
    finally:
        for c in clients.values():
            c.close()


def _reference() -> list[int]:
    return generate_tokens(PROMPT, NEW)


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
def test_two_prefill_rank_processes_feed_one_decode_process_then_a_sigkilled_rank_fails_one(
    procs: list[Proc], start_procs: StartProcs, flag: str, shares: dict[str, tuple[object, ...]]
) -> None:
    """Request ``r`` gathered token-exact; then, on the same processes, rank 1 SIGKILLed before
    it is sent request ``k``'s order: its loss fails the whole gather, the survivors balance."""
    with _deployment(procs, start_procs, flag) as (started, clients, orders):
        dec, pre = orders("r", "g")
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
        dec, pre = orders("k", "g2")
        fut = clients["d"].call_async(dec)
        [p0] = [o for o in pre if o.share is not None and o.share.peer == "p0"]
        assert clients["p0"].call(p0) == Ack(detail="accepted")
        started[1].kill()  # rank 1 never sends: its loss must fail the whole gather
        res = fut.result(timeout=60)
        assert isinstance(res, RequestResult)
        lost = str(shares["p1"][0]).replace("g/", "g2/", 1)  # p1's session of request k
        assert (res.state, res.reason, res.tokens) == ("failed", f"{lost}: peer lost", ())
        for name in ("p0", "d"):
            _balanced(clients[name])


@contextlib.contextmanager
def _routed(
    procs: list[Proc], start_procs: StartProcs, *chaos: str
) -> Iterator[tuple[list[Proc], dict[str, RpcClient], RpcClient]]:
    """TP ranks p0 and p1 (p1 under ``chaos_serve`` with ``chaos`` flags, when given) and a
    decode process d, with ``kvplane serve router`` over them: the processes, a client of
    each worker by name, and the router's client."""

    def rank(r: int, *flags: str) -> Callable[[], Proc]:
        args = _args(f"p{r}", "--tp-rank", str(r), "--tp-size", "2", *flags)
        entry = ("kvplane.testing.chaos_serve",) if flags else ("kvplane", "serve")
        return lambda: Proc("prefill", args, entry=entry)

    started = start_procs(procs, rank(0), rank(1, *chaos), lambda: Proc("decode", _args("d")))
    flags = [f for p in started[:2] for f in ("--prefill", p.control)]
    procs.append(Proc("router", ["--control", f"tcp://127.0.0.1:{free_port()}", *flags,
                                 "--decode", started[2].control, "--refresh", "0.25"]))  # fmt: skip
    clients = {name: RpcClient(p.control, timeout_s=20, secret=TEST_SECRET)
               for name, p in zip(("p0", "p1", "d"), started, strict=True)}  # fmt: skip
    router = RpcClient(procs[-1].control, timeout_s=60, secret=TEST_SECRET)
    try:
        yield started, clients, router
    finally:
        for c in clients.values():
            c.close(discard=True)
        router.close()


def _stats(client: RpcClient, timeline: bool = False) -> WorkerStats:
    got = client.call(StatsQuery(timeline=timeline))
    assert isinstance(got, WorkerStats)
    return got


def test_a_request_through_the_router_is_gathered_token_exact(
    procs: list[Proc], start_procs: StartProcs
) -> None:
    with _routed(procs, start_procs) as (_, clients, router):
        got = router.call(Generate(request_id="r", token_ids=PROMPT, max_new_tokens=NEW))
        assert isinstance(got, RequestResult)
        assert (got.state, got.reason, list(got.tokens)) == ("success", "", _reference())
        stats = _stats(router)
        assert (stats.counters["router_gathered"], stats.counters["router_workers_up"]) == (1, 3)
        for c in clients.values():
            _balanced(c)


def _slices_done(client: RpcClient, request_id: str) -> set[int]:
    """The slices of ``request_id`` that the worker's transfers ended (its timeline)."""
    events = _stats(client, timeline=True).timeline
    return {
        int(e["slice_id"])
        for e in events
        if e.get("mark") == "slice_done" and e.get("request_id") == request_id
    }


def test_a_rank_sigkilled_mid_transfer_through_the_router_fails_it_and_the_next_is_refused(
    procs: list[Proc], start_procs: StartProcs
) -> None:
    hang = ("--chaos-seed", str(HANG_SEED), "--chaos-hang", "0.5")
    with _routed(procs, start_procs, *hang) as (started, clients, router):
        fut = router.call_async(Generate(request_id="v", token_ids=PROMPT, max_new_tokens=NEW))
        wait_for(lambda: bool(_slices_done(clients["p1"], "v")), what="p1's first slice")
        done = _slices_done(clients["p1"], "v")
        assert 0 in done and done <= {0, 1}  # its last slice (2) hangs: the kill is mid-transfer
        started[1].kill()
        got = fut.result(timeout=60)
        assert isinstance(got, RequestResult)
        p1, p0 = started[1].control, started[0].control
        lost = rf"prefill worker at {re.escape(p1)} is unreachable"  # the router saw it first
        lost += r"|v/[0-9a-f]{8}\.0/0\.1: peer lost"  # the decode worker's lease ran out first
        assert re.fullmatch(lost, got.reason), got.reason
        assert (got.state, got.tokens) == ("failed", ())  # nothing partial is decoded
        for name in ("p0", "d"):
            _balanced(clients[name])
        down = lambda: _stats(router).counters["router_workers_down"] == 1  # noqa: E731
        wait_for(down, timeout_s=60, what="the router marking p1 down")
        refused = router.call(Generate(request_id="next", token_ids=PROMPT))
        assert isinstance(refused, ErrorReply)
        assert refused.reason.startswith("no prefill worker up holds all the KV heads of a decode")
        assert refused.reason.endswith("nor do several tile its KV heads x layers (a gather set)")
        assert p1 not in refused.reason and p0 in refused.reason
