"""Healing of PD pairs without a restart: the router re-pairs a pair either worker reports
unpaired (census or a request's refusal), one pairing at a time, with backoff."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvplane.errors import InvalidArgumentError, ProtocolError
from kvplane.serving.messages import (
    Ack,
    AnyMessage,
    DecodeOrder,
    ErrorReply,
    InfoQuery,
    PairWith,
    PrefillOrder,
    WorkerInfo,
)
from kvplane.serving.router.healing import RepairBackoff, lacks, says_paired
from kvplane.serving.router.router import Router
from kvplane.serving.rpc import Reply, RpcServer
from kvplane.testing.cluster import wait_for


class Reporting:
    """An order server that answers info queries as ``role`` listing ``peers`` as its live PD
    peers, accepts pairings and prefill orders, and refuses decode orders with ``refusal``."""

    def __init__(self, role: str, peers: tuple[str, ...] | None) -> None:
        self.role, self.peers, self.refusal = role, peers, "no"
        self.seen: list[str] = []
        self.server = RpcServer("tcp://127.0.0.1:0", self.handle)
        self.address = self.server.address
        self.server.start()

    def handle(self, msg: AnyMessage, reply: Reply) -> None:
        self.seen.append(type(msg).__name__)
        if isinstance(msg, InfoQuery):
            reply(_info(self.role, self.peers))
        elif isinstance(msg, PairWith | PrefillOrder):
            reply(Ack(detail="ok"))
        elif isinstance(msg, DecodeOrder):
            reply(ErrorReply(reason=self.refusal))

    def pairings(self) -> int:
        return self.seen.count("PairWith")

    def close(self) -> None:
        self.server.close()


def _info(role: str, peers: tuple[str, ...] | None) -> WorkerInfo:
    return WorkerInfo(
        role=role, peer_id=role, pd_address=f"tcp://127.0.0.1:1/{role}", incarnation=1,
        transport="tcp", peers=peers,
    )  # fmt: skip


@pytest.fixture
def pair() -> Iterator[tuple[Reporting, Reporting, Router]]:
    pre, dec = Reporting("prefill", ("decode",)), Reporting("decode", ("prefill",))
    r = Router([pre.address], [dec.address], timeout_s=5.0, probe_s=2.0)
    r.connect()
    yield pre, dec, r
    r.close()
    pre.close()
    dec.close()


def test_a_pair_either_side_reports_unpaired_is_re_paired_with_backoff(
    pair: tuple[Reporting, Reporting, Router],
) -> None:
    pre, dec, r = pair
    r.refresh()
    assert dec.pairings() == 1 and r.ready()  # reported paired: not asked again
    pre.peers = ()  # the prefill side lost its decode peer; the decode side did not say
    r.refresh()
    assert dec.pairings() == 2 and r.ready()  # re-paired at once, accepted
    r.refresh()  # still unpaired after the re-pair: lost, and the next one waits
    assert dec.pairings() == 2 and not r.ready()
    with pytest.raises(ProtocolError, match="lost"):
        r.submit("x", [1, 2, 3])
    time.sleep(1.1)  # RepairBackoff's first wait
    r.refresh()
    assert dec.pairings() == 3
    r.refresh()
    assert dec.pairings() == 3 and not r.ready()  # the second wait is twice as long
    pre.peers = ("decode",)
    r.refresh()  # reported paired again: vetted, no re-pair, backoff reset
    assert dec.pairings() == 3 and r.ready()
    dec.peers = ("someone-else",)
    r.refresh()
    assert dec.pairings() == 4  # a new break is re-paired at once


def test_a_worker_that_does_not_say_is_never_re_paired_for_it(
    pair: tuple[Reporting, Reporting, Router],
) -> None:
    pre, dec, r = pair
    pre.peers = dec.peers = None
    for _ in range(3):
        r.refresh()
    assert dec.pairings() == 1 and r.ready()


def test_a_decode_refusal_for_a_peer_not_connected_re_pairs_at_once(
    pair: tuple[Reporting, Reporting, Router],
) -> None:
    _, dec, r = pair
    dec.refusal, dec.peers = "prefill peer 'prefill' is not connected", ()
    got = r.submit("a", [1, 2, 3]).result(timeout=5)
    assert got.state == "failed" and got.reason.startswith(dec.refusal)  # fast, with the reason
    assert "re-pairs" in got.reason
    assert not r.ready()  # the pair is lost until re-paired: later requests avoid it
    r.refresh()
    assert dec.pairings() == 2 and r.ready()


def test_a_router_with_refresh_re_pairs_a_broken_pair_by_itself() -> None:
    pre, dec = Reporting("prefill", ("decode",)), Reporting("decode", ("prefill",))
    r = Router([pre.address], [dec.address], timeout_s=5.0, probe_s=1.0, refresh_s=0.1)
    try:
        r.connect()
        paired = dec.pairings()
        dec.peers = ()
        wait_for(lambda: dec.pairings() > paired, timeout_s=5.0, what="a re-pair")
        time.sleep(1.0)  # reported unpaired all along: backoff (1 s, 2 s, ...), not a storm
        assert dec.pairings() <= paired + 2, dec.seen
    finally:
        r.close()
        pre.close()
        dec.close()


def test_repair_backoff_doubles_up_to_its_cap_and_resets_when_healed() -> None:
    b: RepairBackoff[str] = RepairBackoff(first_s=1.0, max_s=3.0)
    assert b.due("k", 0.0) and b.tries("k") == 0
    waits = []
    now = 0.0
    for _ in range(4):
        b.tried("k", now)
        nxt = now
        while not b.due("k", nxt):
            nxt += 0.5
        waits.append(nxt - now)
        now = nxt
    assert waits == [1.0, 2.0, 3.0, 3.0] and b.tries("k") == 4
    b.healed("k")
    assert b.due("k", now) and b.tries("k") == 0
    b.tried("a", 0.0)
    b.tried("b", 0.0)
    b.drop(lambda k: k == "a")
    assert len(b) == 1 and b.due("a", 0.0) and not b.due("b", 0.0)
    with pytest.raises(InvalidArgumentError):
        RepairBackoff(first_s=2.0, max_s=1.0)


def test_lacks_and_says_paired_read_the_reported_peers() -> None:
    d, p = _info("decode", ("prefill",)), _info("prefill", ())
    assert says_paired(d, p) and not lacks(d, p)
    assert lacks(p, d) and not says_paired(p, d)
    silent = _info("prefill", None)
    assert not lacks(silent, d) and not says_paired(silent, d)
