"""How the router picks a pair, checked with exact counts on stand-in workers (order servers
that say their TP head ranges, accept or refuse pairings and answer orders at once): the decode
rank round-robin over the ranks something serves, then a prefill rank round-robin over those
that serve it, per decode rank; only over pairings the decode worker accepted (a refused one is
never picked; only refused pairs is refused like nothing serving); forgotten on restart."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack

import pytest

from kvplane.errors import ProtocolError
from kvplane.serving.messages import (
    Ack,
    AnyMessage,
    DecodeOrder,
    ErrorReply,
    InfoQuery,
    PairWith,
    PrefillOrder,
    RequestResult,
    WorkerInfo,
)
from kvplane.serving.router.router import Router
from kvplane.serving.rpc import Reply, RpcServer
from kvplane.testing.cluster import wait_for

Ranges = tuple[tuple[int, int], ...]
FULL: Ranges = ((0, 4), (0, 1))  # a KV pool of 4 heads, all held, and the tail pool


def gqa(a: int, b: int) -> Ranges:
    return ((a, b), (0, 1))


class Stand:
    """A stand-in worker named ``name``: answers info queries with ``heads`` and ``incarnation``
    (none while ``mute``); as a decode worker, pairings with an ``Ack`` naming the prefill peer,
    an ``ErrorReply`` for a peer in ``refuse`` and nothing for one in ``ignore``; acks prefill
    orders and answers decode orders with a success at once. ``orders``: the peer each order
    named, in order; ``seen``: every message type."""

    def __init__(self, role: str, name: str, heads: Ranges) -> None:
        self.role, self.name, self.heads = role, name, heads
        self.incarnation, self.mute = 1, False
        self.refuse: set[str] = set()
        self.ignore: set[str] = set()
        self.orders: list[str] = []
        self.seen: list[str] = []
        self.server = RpcServer("tcp://127.0.0.1:0", self.handle)
        self.address = self.server.address
        self.server.start()

    def handle(self, msg: AnyMessage, reply: Reply) -> None:
        self.seen.append(type(msg).__name__)
        if isinstance(msg, InfoQuery) and not self.mute:
            reply(
                WorkerInfo(
                    role=self.role, peer_id=self.name, pd_address=f"pd-{self.name}",
                    incarnation=self.incarnation, transport="tcp", head_ranges=self.heads,
                )
            )  # fmt: skip
        elif isinstance(msg, PairWith):
            peer = msg.pd_address.removeprefix("pd-")
            if peer in self.refuse:
                reply(ErrorReply(reason=f"pairing with {peer} refused"))
            elif peer not in self.ignore:
                reply(Ack(detail=peer))
        elif isinstance(msg, PrefillOrder):
            self.orders.append(msg.decode_peer)
            reply(Ack(detail="accepted"))
        elif isinstance(msg, DecodeOrder):
            self.orders.append(msg.prefill_peer)
            reply(RequestResult(request_id=msg.request_id, state="success"))

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def _cluster(
    stack: ExitStack, ps: Sequence[Ranges], ds: Sequence[Ranges], probe_s: float = 2.0
) -> tuple[list[Stand], list[Stand], Router]:
    pre = [Stand("prefill", f"p{i}", h) for i, h in enumerate(ps)]
    dec = [Stand("decode", f"d{i}", h) for i, h in enumerate(ds)]
    for w in pre + dec:
        stack.callback(w.close)
    r = Router([w.address for w in pre], [w.address for w in dec], timeout_s=5.0, probe_s=probe_s)
    stack.callback(r.close)
    return pre, dec, r


def _serve(r: Router, pre: list[Stand], dec: list[Stand], n: int, tag: str) -> Counter[str]:
    """Submit ``n`` requests, wait for all; the pairs they ran on (``"p0>d1"``), as both sides
    saw them, after checking nothing is left: no flight, every order on both sides, no cancel."""
    before = {w.name: len(w.orders) for w in pre + dec}
    futs = [r.submit(f"{tag}{i}", [1, 2, 3]) for i in range(n)]
    assert all(f.result(timeout=10).state == "success" for f in futs)
    wait_for(lambda: sum(len(w.orders) for w in pre) - sum(before[w.name] for w in pre) == n)
    by_dec = Counter(f"{p}>{d.name}" for d in dec for p in d.orders[before[d.name] :])
    by_pre = Counter(f"{p.name}>{d}" for p in pre for d in p.orders[before[p.name] :])
    assert by_dec == by_pre and r.flights_live == 0
    assert not any("CancelOrder" in w.seen for w in pre + dec)
    return by_dec


def _shares(pairs: Counter[str], names: Sequence[str], side: int) -> list[int]:
    """Requests per worker of ``names`` (``side`` 0: prefill, 1: decode)."""
    got = Counter({name: 0 for name in names})
    for pair, k in pairs.items():
        got[pair.split(">")[side]] += k
    return [got[name] for name in names]


@pytest.mark.parametrize(
    ("ps", "want"),
    [  # decode ranks (0,2) and (2,4); 12 requests: 6 per decode rank, split over its servers
        ([gqa(0, 4), gqa(0, 2)], {"p0>d0": 3, "p1>d0": 3, "p0>d1": 6}),
        ([gqa(2, 4), gqa(0, 4)], {"p1>d0": 6, "p0>d1": 3, "p1>d1": 3}),
        ([gqa(0, 4), gqa(0, 4)], {"p0>d0": 3, "p1>d0": 3, "p0>d1": 3, "p1>d1": 3}),
    ],
)
def test_every_covering_prefill_rank_gets_an_equal_share_of_each_decode_rank(
    stack: ExitStack, ps: list[Ranges], want: dict[str, int]
) -> None:
    pre, dec, r = _cluster(stack, ps, [gqa(0, 2), gqa(2, 4)])
    r.connect()
    assert _serve(r, pre, dec, 12, "a") == want
    assert _serve(r, pre, dec, 12, "b") == want  # every round alike: the cursors stay in step


def test_a_decode_rank_nothing_covers_leaves_its_share_spread_evenly(stack: ExitStack) -> None:
    pre, dec, r = _cluster(stack, [gqa(0, 2)], [gqa(0, 2), gqa(2, 4), gqa(0, 2)])
    with pytest.raises(ProtocolError, match=re.escape(f"decode worker at {dec[1].address}")):
        r.connect()
    assert r.ready()
    assert _serve(r, pre, dec, 6, "a") == {"p0>d0": 3, "p0>d2": 3}
    assert _shares(_serve(r, pre, dec, 8, "b"), ["d0", "d1", "d2"], 1) == [4, 0, 4]


def test_a_refused_pairing_is_never_picked(stack: ExitStack) -> None:
    pre, dec, r = _cluster(stack, [FULL, FULL], [FULL, FULL])
    dec[0].refuse.add("p0")
    with pytest.raises(ProtocolError, match="cannot pair: pairing with p0 refused"):
        r.connect()
    assert r.ready() and r.decode[0].repair
    pairs = _serve(r, pre, dec, 8, "a")
    assert pairs == {"p1>d0": 4, "p0>d1": 2, "p1>d1": 2}  # d0 only ever on the pair it took
    dec[0].refuse.clear()  # accepted at the next refresh (d0 is re-paired): p0 serves it again
    assert r.refresh() == ["d0"]
    assert _serve(r, pre, dec, 8, "b") == {"p0>d0": 2, "p1>d0": 2, "p0>d1": 2, "p1>d1": 2}


def test_a_prefill_worker_counting_other_pools_never_serves(stack: ExitStack) -> None:
    # p0 says one pool fewer than the decode workers: the handshake would refuse it, so the
    # router never asks (d0 would refuse, d1 a stand-in that would take it) nor sends it work
    three = ((0, 4), (0, 1), (0, 1))
    pre, dec, r = _cluster(stack, [FULL, three], [three, three])
    dec[0].refuse.add("p0")
    r.connect()  # no pairing with p0 was asked for, so none was refused
    assert [d.seen.count("PairWith") for d in dec] == [1, 1]  # p1's pairings only
    assert _serve(r, pre, dec, 6, "a") == {"p1>d0": 3, "p1>d1": 3}


def test_a_pairing_not_answered_yet_is_used_only_while_none_was_accepted(
    stack: ExitStack,
) -> None:
    pre, dec, r = _cluster(stack, [FULL, FULL], [FULL], probe_s=0.2)
    dec[0].ignore.add("p1")  # its handshake is slow: the pairing is still outstanding
    with pytest.raises(ProtocolError, match=r"cannot pair: no answer within 0\.2 s"):
        r.connect()
    assert _serve(r, pre, dec, 4, "a") == {"p0>d0": 4}


def test_only_refused_pairs_are_refused_before_any_order_like_nothing_serving(
    stack: ExitStack,
) -> None:
    pre, dec, r = _cluster(stack, [FULL], [FULL])
    dec[0].refuse.add("p0")
    with pytest.raises(ProtocolError, match="pairing with p0 refused"):
        r.connect()
    assert not r.ready()
    with pytest.raises(ProtocolError, match=re.escape(f"decode {dec[0].address} (KV heads")):
        r.submit("x", [1, 2, 3])
    assert r.flights_live == 0 and pre[0].orders == dec[0].orders == []
    dec[0].refuse.clear()
    r.refresh()  # re-paired: accepted now
    assert r.ready() and _serve(r, pre, dec, 2, "a") == {"p0>d0": 2}


def test_a_restarted_or_returning_worker_serves_only_once_paired_again(
    stack: ExitStack,
) -> None:
    pre, dec, r = _cluster(stack, [FULL, FULL], [FULL], probe_s=0.3)
    r.connect()
    assert _serve(r, pre, dec, 4, "a") == {"p0>d0": 2, "p1>d0": 2}
    pre[0].incarnation = 2  # p0 restarted, and d0 refuses the new p0
    dec[0].refuse.add("p0")
    with pytest.raises(ProtocolError, match="pairing with p0 refused"):
        r.refresh()
    assert _serve(r, pre, dec, 4, "b") == {"p1>d0": 4}
    dec[0].refuse.clear()
    pre[1].mute = True  # p1 leaves: marked down, its pairing forgotten
    assert r.refresh() == ["d0"]  # d0 is re-paired (it needed a repair): p0 accepted
    assert not r.prefill[1].up and _serve(r, pre, dec, 4, "c") == {"p0>d0": 4}
    dec[0].refuse.add("p1")  # p1 returns (same incarnation) and d0 now refuses it
    pre[1].mute = False
    with pytest.raises(ProtocolError, match="pairing with p1 refused"):
        r.refresh()
    assert r.prefill[1].up and _serve(r, pre, dec, 4, "d") == {"p0>d0": 4}
