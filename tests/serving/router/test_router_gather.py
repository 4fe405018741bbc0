"""The router serves a decode worker that no prefill worker covers alone through its gather set:
two TP ranks (or two pipeline stages) of tiny-llama feed one TP1 decode worker (threads, real
sockets), with the tokens of one-process ``generate``; a worker covering it alone is preferred;
a refused member fails the request for all; every pool and ledger balances."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from kvplane.apps.serve import build_worker
from kvplane.apps.serve_config import settle
from kvplane.cli import build_parser
from kvplane.serving.messages import WorkerStats
from kvplane.serving.router.router import Router
from kvplane.serving.worker import Worker
from kvplane.testing.cluster import check_balanced, idle, wait_for
from kvplane.testing.reference import generate_tokens

PROMPT = tuple(range(3, 43))  # 40 tokens: three prefill steps of 16
NEW = 5
COMMON = ["--model", "tiny-llama", "--num-slots", "4", "--insecure", "--step-size", "16"]
RANKS = {"tp": ("--tp-rank", "--tp-size"), "pp": ("--pp-stage", "--pp-size")}


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """The tokens of one-process ``generate``."""
    return generate_tokens(PROMPT, NEW)


def _start(stack: ExitStack, role: str, name: str, *argv: str, blocks: int = 16) -> Worker:
    args = ["serve", role, "--name", name, "--num-blocks", str(blocks), *argv, *COMMON]
    w = build_worker(settle(build_parser().parse_args(args), {}))
    w.start()
    stack.callback(w.close)
    return w


def _ranks(stack: ExitStack, flag: str, blocks: tuple[int, int] = (16, 16)) -> list[Worker]:
    rank, size = RANKS[flag]
    return [
        _start(stack, "prefill", f"p{r}", rank, str(r), size, "2", blocks=blocks[r]) for r in (0, 1)
    ]


def _router(stack: ExitStack, prefill: list[Worker], decode: Worker) -> Router:
    r = Router([w.address for w in prefill], [decode.address], timeout_s=30.0)
    stack.callback(r.close)
    return r


def _peers(w: Worker) -> list[str]:
    """A worker's live PD peers (read on its PD loop)."""
    part = w.participant
    return w.endpoint.call(lambda: sorted(str(x) for x in part.peers.live_peers()))


def _finished(stats: dict[str, WorkerStats], name: str, role: str, state: str) -> int:
    return stats[name].counters.get(f"session_finished_{role}_{state}", 0)


@pytest.mark.parametrize("flag", ["tp", "pp"])
def test_two_prefill_ranks_feed_a_decode_worker_through_the_router(
    stack: ExitStack, flag: str, reference: list[int]
) -> None:
    ranks = _ranks(stack, flag)
    d = _start(stack, "decode", "d")
    r = _router(stack, ranks, d)
    r.connect()  # the decode worker is paired with both members of its gather set
    assert r.ready() and _peers(d) == ["p0", "p1"]
    for i in range(2):
        res = r.generate(f"q{i}", PROMPT, max_new_tokens=NEW)
        assert (res.state, res.reason, list(res.tokens)) == ("success", "", reference)
    assert r.gathered == 2 and r.flights_live == 0
    assert r.metrics.value("router_gathered_requests", suffix="_total") == 2.0
    stats = check_balanced(r)
    assert [_finished(stats, n, "sender", "success") for n in ("p0", "p1")] == [2, 2]
    assert r.refresh() == []  # nothing changed: nothing re-paired, nothing reported


def test_a_worker_covering_alone_is_preferred_and_its_loss_falls_back_to_the_gather(
    stack: ExitStack, reference: list[int]
) -> None:
    whole = _start(stack, "prefill", "w")
    ranks = _ranks(stack, "tp")
    d = _start(stack, "decode", "d")
    r = _router(stack, [whole, *ranks], d)
    r.connect()
    assert _peers(d) == ["w"]  # the ranks are not its partners while w covers it
    res = r.generate("alone", PROMPT, max_new_tokens=NEW)
    assert (res.state, list(res.tokens), r.gathered) == ("success", reference, 0)
    whole.close()
    assert r.refresh() == []  # w is marked down; d is paired with its gather set's members
    assert set(_peers(d)) >= {"p0", "p1"}
    res = r.generate("gathered", PROMPT, max_new_tokens=NEW)
    assert (res.state, res.reason, list(res.tokens), r.gathered) == ("success", "", reference, 1)
    wait_for(lambda: all(idle(s) for s in r.gather_stats()[0].values()), what="idle workers")
    stats, missing = r.gather_stats()
    assert missing == [f"{whole.address} (down)"]
    assert all(idle(s) and s.integrity == "" for s in stats.values()), stats
    assert [_finished(stats, n, "sender", "success") for n in ("p0", "p1")] == [1, 1]


def test_a_member_refusing_its_order_fails_the_request_for_every_member(
    stack: ExitStack,
) -> None:
    ranks = _ranks(stack, "tp", blocks=(16, 4))  # p1's pool holds 64 tokens
    d = _start(stack, "decode", "d")
    r = _router(stack, ranks, d)
    r.connect()
    res = r.generate("big", tuple(range(3, 103)), max_new_tokens=2)  # 100 tokens: 7 blocks
    why = r"(big/[0-9a-f]{8}\.0/0\.[01]: )?prefill refused: request 'big' needs 7 blocks; "
    assert re.fullmatch(why + "the pool has 4", res.reason), res.reason
    assert (res.state, res.tokens) == ("aborted", ())  # nothing partial is decoded
    stats = check_balanced(r)
    assert _finished(stats, "p0", "sender", "success") == 0
    assert r.generate("small", PROMPT, max_new_tokens=NEW).state == "success"
