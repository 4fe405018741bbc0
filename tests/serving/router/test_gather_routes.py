"""Routes: a decode worker is served by each prefill worker covering its KV alone, else by its
gather set as one route; a route's pairing state is its members' worst; its orders are one
pair of orders, or a gather's decode order and one member order per sender."""

from __future__ import annotations

from concurrent.futures import Future

from kvplane.serving.messages import DecodeOrder, PrefillOrder, SenderPiece, WorkerInfo
from kvplane.serving.router.flights import Flight
from kvplane.serving.router.gather_routes import (
    Route,
    Sender,
    partners,
    route_orders,
    routes,
    why_no_route,
)
from kvplane.serving.router.gather_sets import ANY_TOKENS
from kvplane.serving.router.pairings import Pairing
from kvplane.serving.router.workers import WorkerHandle, serves
from kvplane.transfer.resharding import KVBox, Piece, SenderId

ALL2 = (0, 1)
A = Pairing.ACCEPTED
P = Pairing.PENDING


def worker(
    name: str, heads: tuple[int, int], layers: tuple[int, ...] = ALL2, *, stage: int = 0,
    tp: int = 0, up: bool = True, incarnation: int = 1,
) -> WorkerHandle:  # fmt: skip
    info = WorkerInfo(role="w", peer_id=name, pd_address=f"pd-{name}", incarnation=incarnation,
                      transport="tcp", head_ranges=(heads, (0, 1)), layer_ids=layers,
                      pp_stage=stage, tp_rank=tp)  # fmt: skip
    return WorkerHandle(address=f"tcp://{name}", client=None, info=info, up=up)  # type: ignore[arg-type]


def piece(stage: int, tp: int, heads: tuple[int, int], layers: tuple[int, ...] = ALL2) -> Piece:
    return Piece(SenderId(stage, tp), KVBox(heads, layers, ANY_TOKENS))


def names(rs: list[Route]) -> list[list[tuple[str, Piece | None]]]:
    return [[(s.info.peer_id, s.piece) for s in r.senders] for r in rs]


def test_a_pipeline_stage_alone_serves_no_decode_worker_holding_other_layers() -> None:
    d = worker("d", (0, 2))
    assert d.info is not None
    for layers, ok in (((0,), False), ((1,), False), ((0, 1), True), ((0, 1, 2), True)):
        p = worker("p", (0, 2), layers)
        assert p.info is not None and serves(p.info, d.info) is ok


def test_partners_are_the_covering_workers_else_the_gather_set() -> None:
    whole, t0, t1 = worker("w", (0, 2)), worker("t0", (0, 1)), worker("t1", (1, 2), tp=1)
    d = worker("d", (0, 2))
    assert [p.address for p in partners([t0, whole, t1], d)] == ["tcp://w"]
    assert [p.address for p in partners([t1, t0], d)] == ["tcp://t0", "tcp://t1"]
    s0, s1 = worker("s0", (0, 2), (0,)), worker("s1", (0, 2), (1,), stage=1)
    assert [p.address for p in partners([s1, s0], d)] == ["tcp://s0", "tcp://s1"]
    assert partners([t0], d) == [] and partners([t0, worker("x", (1, 2), up=False)], d) == []


def test_a_gather_route_is_accepted_only_when_every_member_is() -> None:
    t0, t1, d = worker("t0", (0, 1)), worker("t1", (1, 2), tp=1), worker("d", (0, 2))
    gather = [[("t0", piece(0, 0, (0, 1))), ("t1", piece(0, 1, (1, 2)))]]
    cases = [
        ({"t0": A, "t1": A}, gather, []),
        ({"t0": A, "t1": P}, [], gather),
        ({"t0": P, "t1": P}, [], gather),
        ({"t0": A, "t1": Pairing.REFUSED}, [], []),
        ({"t0": Pairing.LOST, "t1": A}, [], []),
        ({"t0": A}, [], []),  # no record for t1
    ]
    for states, accepted, pending in cases:
        got = routes([t1, t0], d, lambda p, st=states: st.get(p.address[6:]))  # type: ignore[misc]
        assert (names(got[0]), names(got[1])) == (accepted, pending), states
        assert all(r.gathered and r.name == "t0" for r in got[0] + got[1])


def test_covering_workers_are_one_route_each_and_no_gather_is_made() -> None:
    w0, w1, t0 = worker("w0", (0, 2)), worker("w1", (0, 2)), worker("t0", (0, 1))
    states = {"w0": A, "w1": P, "t0": A}
    acc, pend = routes([w0, t0, w1], worker("d", (0, 2)), lambda p: states[p.address[6:]])
    assert (names(acc), names(pend)) == ([[("w0", None)]], [[("w1", None)]])
    assert not acc[0].gathered and acc[0].name == "w0"
    assert routes([w0], worker("d", (0, 2), up=False), lambda p: A) == ([], [])


def test_a_gather_route_orders_each_member_its_share_under_its_member_id() -> None:
    s0, s1, d = worker("s0", (0, 2), (0,)), worker("s1", (0, 2), (1,), stage=1), worker("d", (0, 2))
    (route,), _ = routes([s0, s1], d, lambda p: A)
    base = DecodeOrder(request_id="r", session_id="r/x.0", prefill_peer="s0", token_ids=(1, 2),
                       max_new_tokens=3)  # fmt: skip
    dec, pre = route_orders(route, base, step_size=8)
    lead = SenderPiece(peer="s1", stage=1, tp_rank=0, heads=(0, 2), layers=(1,), lead=True)
    other = SenderPiece(peer="s0", stage=0, tp_rank=0, heads=(0, 2), layers=(0,), lead=False)
    want = DecodeOrder(request_id="r", session_id="r/x.0", prefill_peer="s1", token_ids=(1, 2),
                       max_new_tokens=3, senders=(other, lead))  # fmt: skip
    assert dec == want
    assert [(w.address, o) for w, o in pre] == [
        ("tcp://s0", PrefillOrder(request_id="r", session_id="r/x.0/0.0", token_ids=(1, 2),
                                  decode_peer="d", step_size=8, share=other)),
        ("tcp://s1", PrefillOrder(request_id="r", session_id="r/x.0/1.0", token_ids=(1, 2),
                                  decode_peer="d", step_size=8, share=lead)),
    ]  # fmt: skip


def test_a_one_sender_route_orders_one_pair() -> None:
    p, d = worker("p", (0, 2)), worker("d", (0, 2))
    assert p.info is not None and d.info is not None
    route = Route(d, d.info, (Sender(p, p.info),))
    base = DecodeOrder(request_id="r", session_id="s", prefill_peer="?", token_ids=(5,))
    dec, pre = route_orders(route, base, step_size=0)
    assert dec == DecodeOrder(request_id="r", session_id="s", prefill_peer="p", token_ids=(5,))
    assert pre == [(p, PrefillOrder(request_id="r", session_id="s", token_ids=(5,),
                                    decode_peer="d"))]  # fmt: skip


def test_a_flight_is_orphaned_by_its_decode_worker_or_any_member_going() -> None:
    t0, t1, d = worker("t0", (0, 1)), worker("t1", (1, 2), tp=1), worker("d", (0, 2))
    (route,), _ = routes([t0, t1], d, lambda p: A)
    f = Flight("r", "s", route, ("s/0.0", "s/0.1"), Future(), 7, 0.0)
    assert (f.prefills, f.decode, f.decode_incarnation, f.orphaned()) == ((t0, t1), d, 1, "")
    t1.up = False
    assert f.orphaned() == "prefill worker at tcp://t1 is unreachable"
    d.info = worker("d", (0, 2), incarnation=2).info
    assert f.orphaned() == "decode worker restarted"
    d.up = False
    assert f.orphaned() == "decode worker at tcp://d is unreachable"
    got = f.failed("x" * 5000)
    assert (got.request_id, got.state, got.reason, got.num_tokens) == ("r", "failed", "x" * 4000, 7)
    assert f.queued_tokens == 7  # all its prompt tokens weigh on its queues...
    f.uncached_tokens = 3
    assert f.queued_tokens == 3  # ...but those a cache-aware pick predicted it loads


def test_why_no_route_names_the_ranges_and_says_whether_pairings_are_missing() -> None:
    t0, d = worker("t0", (0, 1)), worker("d", (0, 2))
    assert why_no_route([t0, worker("x", (1, 2), up=False)], [d]) == (
        "no prefill worker up holds all the KV heads of a decode worker up (one sender per "
        "session): decode tcp://d (KV heads per pool ((0, 2), (0, 1))); prefill tcp://t0 (KV "
        "heads per pool ((0, 1), (0, 1))); nor do several tile its KV heads x layers (a gather "
        "set)"
    )
    t1 = worker("t1", (1, 2), tp=1)
    assert why_no_route([t0, t1], [d]).startswith(
        "no decode worker up has a vetted route (a prefill worker up holding all its KV heads, "
        "or a gather set of them; refused, lost or not made yet; re-paired at the next "
        "refresh): decode tcp://d (KV heads"
    )


def test_a_not_connected_reason_names_the_members_it_quotes() -> None:
    t0, t1, d = worker("t0", (0, 1)), worker("t1", (1, 2), tp=1), worker("d", (0, 2))
    (route,), _ = routes([t0, t1], d, lambda p: A)
    f = Flight("r", "s", route, ("s/0.0", "s/0.1"), Future(), 7, 0.0)
    assert f.named("prefill peer 't1' is not connected") == [t1]
    assert f.named("prefill peer 't' is not connected") == [t0, t1]  # no member quoted
