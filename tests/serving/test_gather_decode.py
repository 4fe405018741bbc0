"""A decode worker gathering one request from two real TP prefill ranks (threads, real sockets):
tokens identical to one-process ``generate``; a refused sender fails the request for all and
every worker's pools and ledgers balance."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.gather_orders import gather_orders
from kvplane.serving.messages import (
    Ack,
    CancelOrder,
    DecodeOrder,
    PrefillOrder,
    RequestResult,
    SenderPiece,
)
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.rpc import RpcClient
from kvplane.serving.worker import Worker
from kvplane.testing.cluster import wait_for
from kvplane.testing.gather_run import gather_pieces, start_gather
from kvplane.testing.reference import generate_tokens

PROMPT = tuple(range(3, 43))  # 40 tokens: three prefill steps of 16
NEW = 5
COMMON = ["--model", "tiny-llama", "--num-blocks", "16", "--num-slots", "4", "--insecure",
          "--step-size", "16"]  # fmt: skip


@contextmanager
def _ranks() -> Iterator[tuple[list[PrefillWorker], DecodeWorker]]:
    with ExitStack() as stack:
        ranks = [("prefill", "--name", f"p{r}", "--tp-rank", str(r), "--tp-size", "2", *COMMON)
                 for r in (0, 1)]  # fmt: skip
        yield start_gather(stack, ranks, ("decode", "--name", "d", *COMMON))


def _reference() -> list[int]:
    """The tokens of one-process ``generate``."""
    return generate_tokens(PROMPT, NEW, step_size=16)


def _orders(senders: tuple[SenderPiece, ...], sid: str) -> tuple[DecodeOrder, list[PrefillOrder]]:
    base = DecodeOrder(request_id="r", session_id=sid, prefill_peer="p0", token_ids=PROMPT,
                       max_new_tokens=NEW)  # fmt: skip
    return gather_orders(base, senders, decode_peer="d")


def _client(stack: ExitStack, w: Worker) -> RpcClient:
    return stack.enter_context(contextlib.closing(RpcClient(w.address)))


def _balanced(workers: list[Worker]) -> None:
    for w in workers:
        wait_for(lambda w=w: w.stats().used_blocks == 0 and w.stats().sessions_live == 0,
                 what=f"{w.config.name} idle")  # fmt: skip
        assert w.stats().integrity == ""


def test_two_tp_ranks_feed_one_decode_rank_with_the_one_process_tokens() -> None:
    with _ranks() as (ranks, d):
        senders = gather_pieces(ranks, d)
        assert [(s.peer, s.heads, s.layers, s.lead) for s in senders] == [
            ("p0", (0, 1), (0, 1), True), ("p1", (1, 2), (0, 1), False)
        ]  # fmt: skip
        dec, pre = _orders(senders, "g1")
        with ExitStack() as stack:
            clients = [_client(stack, w) for w in [d, *ranks]]
            fut = clients[0].call_async(dec)
            wait_for(lambda: "r" in d._requests, what="the decode order")  # type: ignore[attr-defined]
            for c, order in zip(clients[1:], pre, strict=True):
                assert c.call(order) == Ack(detail="accepted")
            res = fut.result(timeout=60)
        assert isinstance(res, RequestResult)
        assert (res.state, res.reason) == ("success", "")
        assert list(res.tokens) == _reference()
        _balanced([d, *ranks])


def test_a_cancel_while_one_sender_has_no_order_ends_every_member_undecoded() -> None:
    with _ranks() as (ranks, d):
        dec, pre = _orders(gather_pieces(ranks, d), "g2")
        with ExitStack() as stack:
            clients = [_client(stack, w) for w in [d, *ranks]]
            fut = clients[0].call_async(dec)
            wait_for(lambda: "r" in d._requests, what="the decode order")  # type: ignore[attr-defined]
            assert clients[1].call(pre[0]) == Ack(detail="accepted")
            # rank 1 never gets its order: a cancel on the decode side ends every member
            cancel = CancelOrder(request_id="r", reason="test")
            assert clients[0].call(cancel) == Ack(detail="cancelling")
            res = fut.result(timeout=60)
        assert isinstance(res, RequestResult) and res.state == "aborted" and res.tokens == ()
        _balanced([d, *ranks])
