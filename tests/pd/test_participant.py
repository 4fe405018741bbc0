"""Participants: handshakes, epochs, tombstones, leases, timers, dropped peer frames."""

from __future__ import annotations

import pytest

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, RequestId, SessionId, SliceId
from kvplane.metrics import MetricsRegistry
from kvplane.pd.actions import Action, Finished, Release, StartSubmit, Transmit
from kvplane.pd.events import (
    Abort,
    AbortAck,
    Cancel,
    Heartbeat,
    HelloConfirm,
    HelloReply,
    LeaseRenew,
    Outcome,
    SliceReady,
    SliceResult,
    SliceStatus,
    StartTransfer,
    SubmitSkipped,
    SubmitSlice,
    SubmitStarted,
    TransferRequest,
    TransportDone,
)
from kvplane.pd.handshake import PROTOCOL_VERSION, LayoutInfo, PeerProfile
from kvplane.pd.participant import WITHHELD, Participant
from kvplane.pd.states import Ownership, Role, SessionState
from kvplane.pd.timers import Timings
from kvplane.testing.session_pair import sim_profile

T = Timings(deadline_s=5.0, verdict_grace_s=1.0, retransmit_s=0.5, heartbeat_s=1.0, lease_s=3.0)
P, D, D2 = PeerId("prefill"), PeerId("decode"), PeerId("decode2")
START = StartTransfer(request_id=RequestId("r"), dst_block_ids=(0,), prefix_tokens=0, num_tokens=0)


def node(name: PeerId, incarnation: int = 1, **kw: object) -> Participant:
    return Participant(name, sim_profile(), incarnation=incarnation, timings=T, **kw)  # type: ignore[arg-type]


def connect(server: Participant, client: Participant, now: float = 0.0) -> None:
    reply, _ = server.on_hello(client.hello(), now)
    assert client.on_hello_reply(reply, now)[0].compatible


def pump(
    nodes: dict[PeerId, Participant], actions: list[Action], src: PeerId, now: float
) -> list[Action]:
    """Deliver every Transmit (recursively); return the other actions."""
    rest: list[Action] = []
    queue = [(src, a) for a in actions]
    while queue:
        frm, act = queue.pop(0)
        if isinstance(act, Transmit):
            dst = nodes[act.peer_id]
            queue += [(dst.peer_id, a) for a in dst.on_event(frm, act.event, now)]
        else:
            rest.append(act)
    return rest


def one_session(
    prefill: Participant, decode: Participant, sid: str, now: float = 0.0
) -> list[Action]:
    nodes = {P: prefill, decode.peer_id: decode}
    _, acts = decode.open_receiver(SessionId(sid), P, START, now)
    rest = pump(nodes, acts, decode.peer_id, now)
    acts = prefill.send(
        SessionId(sid), SubmitSlice(slice_id=SliceId(0), is_last=True, start=0, end=0), now
    )
    rest += pump(nodes, acts, P, now)
    starts = [a for a in rest if isinstance(a, StartSubmit)]
    for a in starts:
        rest += pump(
            nodes,
            prefill.receive_local(a.session_id, SubmitSkipped(slice_id=a.slice_id), now),
            P,
            now,
        )
    return rest


def test_a_session_completes_and_both_sides_retire_to_tombstones() -> None:
    prefill, decode = node(P), node(D, 1 << 20)
    connect(prefill, decode)
    rest = one_session(prefill, decode, "s1")
    finished = sorted((a.role.value, a.state.value) for a in rest if isinstance(a, Finished))
    assert finished == [("receiver", "success"), ("sender", "success")]
    assert prefill.sessions == {} and decode.sessions == {}
    assert prefill.tombstone(SessionId("s1")).state is SessionState.SUCCESS  # type: ignore[union-attr]
    assert decode.counters["retired"] == prefill.counters["retired"] == 1
    prefill.check_integrity()
    decode.check_integrity()


def test_late_frames_meet_the_tombstone_and_never_recreate_a_session() -> None:
    prefill, decode = node(P), node(D, 1 << 20)
    connect(prefill, decode)
    one_session(prefill, decode, "s1")
    epoch = decode.tombstone(SessionId("s1")).epoch  # type: ignore[union-attr]
    assert epoch is not None
    late = SliceReady(session_id="s1", epoch=epoch, slice_id=0, is_last=True, start=0, end=0)
    out = decode.on_event(P, late, 1.0)
    assert [type(a.event) for a in out if isinstance(a, Transmit)] == [SliceResult]
    req = TransferRequest(
        session_id="s1",
        epoch=epoch,
        request_id="r",
        dst_block_ids=(0,),
        prefix_tokens=0,
        num_tokens=0,
    )
    assert prefill.on_event(D, req, 1.0) == [] and prefill.sessions == {}
    assert prefill.on_event(D, TransferRequest(**{**_fields(req), "epoch": epoch - 1}), 1.0) == []
    assert prefill.counters["stale_epoch"] == 1 and prefill.counters["late_frame"] == 1
    newer = TransferRequest(**{**_fields(req), "epoch": epoch + 1})
    prefill.on_event(D, newer, 1.0)
    assert prefill.session(SessionId("s1")) is not None  # a newer incarnation may open
    assert prefill.open_sender(SessionId("s1"), D, 1.0)[0] is prefill.session(SessionId("s1"))


def _fields(ev: TransferRequest) -> dict[str, object]:
    return {f: getattr(ev, f) for f in ev.__struct_fields__}


def test_an_abort_for_an_unknown_session_leaves_a_tombstone_that_blocks_its_request() -> None:
    prefill = node(P)
    decode = node(D, 1 << 20)
    connect(prefill, decode)
    abort = Abort(session_id="x", epoch=5, token=1, outcome=Outcome.ABORTED)
    out = prefill.on_event(D, abort, 0.0)
    assert out == [Transmit(D, AbortAck(session_id="x", epoch=5, token=1, outcome=Outcome.ABORTED))]
    req = TransferRequest(
        session_id="x", epoch=5, request_id="r", dst_block_ids=(), prefix_tokens=0, num_tokens=0
    )
    assert prefill.on_event(D, req, 0.1) == [] and prefill.sessions == {}
    assert prefill.open_sender(SessionId("x"), D, 0.1) == (None, [])


def _sender_before_its_request(
    sid: SessionId, *, is_last: bool
) -> tuple[Participant, Participant, dict[PeerId, Participant], list[Action]]:
    """A prefill order's sender session with one slice of 16 tokens admitted, its receiver
    not opened yet: both participants, the node map and the actions left over."""
    prefill, decode = node(P), node(D, 1 << 20)
    connect(prefill, decode)
    nodes = {P: prefill, D: decode}
    _, acts = prefill.open_sender(sid, D, 0.0)
    acts += prefill.send(sid, SubmitSlice(slice_id=SliceId(0), is_last=is_last, start=0, end=16),
                         0.0)  # fmt: skip
    return prefill, decode, nodes, pump(nodes, acts, P, 0.0)


def test_an_abandoned_receiver_ends_the_waiting_sender_and_frees_its_slices_now() -> None:
    """The decode ends a request before it could open its receiver (cancelled while waiting
    for memory): one Abort ends the sender session the prefill order opened, its admitted
    slices released at once (not at the deadline), both sides left with tombstones."""
    sid = SessionId("w")
    prefill, decode, nodes, acts = _sender_before_its_request(sid, is_last=False)
    assert not [a for a in acts if isinstance(a, StartSubmit)]
    rest = pump(nodes, decode.abandon(sid, P, "client gone"), D, 0.1)
    released = [a for a in rest if isinstance(a, Release)]
    finished = [(a.role, a.state) for a in rest if isinstance(a, Finished)]
    assert [(a.role, a.unit, a.via) for a in released] == [
        (Role.SENDER, 0, Ownership.NOT_SUBMITTED)
    ]
    assert finished == [(Role.SENDER, SessionState.ABORTED)]
    assert prefill.sessions == {} and decode.sessions == {}
    tomb = decode.tombstone(sid)
    assert tomb is not None and tomb.role is Role.RECEIVER and tomb.notice is not None
    assert prefill.tombstone(sid).state is SessionState.ABORTED  # type: ignore[union-attr]
    prefill.check_integrity()
    decode.check_integrity()


def test_an_abandon_that_beats_the_prefill_order_keeps_the_order_from_opening() -> None:
    prefill, decode = node(P), node(D, 1 << 20)
    connect(prefill, decode)
    pump({P: prefill, D: decode}, decode.abandon(SessionId("early"), P, "gone"), D, 0.0)
    assert prefill.open_sender(SessionId("early"), D, 0.1) == (None, [])
    assert prefill.sessions == {} and decode.counters["abandoned_receivers"] == 1


def _beat(nodes: dict[PeerId, Participant], now: float) -> list[Action]:
    """Tick both nodes at ``now``, delivering their frames; the other actions."""
    out: list[Action] = []
    for n in nodes.values():
        out += pump(nodes, n.tick(now), n.peer_id, now)
    return out


def _late_receiver(
    sid: SessionId, at: float
) -> tuple[Participant, Participant, dict[PeerId, Participant], list[Action]]:
    """The prefill order at 0; decode memory (the receiver's open) only at ``at``, its
    request delivered at once; the nodes and the actions left over."""
    prefill, decode, nodes, _ = _sender_before_its_request(sid, is_last=True)
    for now in range(1, int(at) + 1):
        _beat(nodes, float(now))
    start = StartTransfer(request_id=RequestId("r"), dst_block_ids=(0,), prefix_tokens=0,
                          num_tokens=16)  # fmt: skip
    _, acts = decode.open_receiver(sid, P, start, at)
    return prefill, decode, nodes, pump(nodes, acts, D, at)


def test_a_request_after_the_sender_gave_up_is_answered_so_the_receiver_frees_at_once() -> None:
    """The decode waited for memory past the sender's deadline: the sender failed before it
    knew an epoch, so it had no notice to send. Its tombstone now answers the late request
    with an Abort of that epoch; the receiver ends FAILED and frees its destination at once
    instead of retransmitting until its own deadline."""
    sid = SessionId("late")
    prefill, decode, _, rest = _late_receiver(sid, 8.0)  # the sender's deadline is 6 s
    tomb = prefill.tombstone(sid)
    assert tomb is not None and tomb.epoch is None  # retired before any request came
    assert [(a.role, a.state) for a in rest if isinstance(a, Finished)] == [
        (Role.RECEIVER, SessionState.FAILED)
    ]
    assert [a.role for a in rest if isinstance(a, Release)] == [Role.RECEIVER]
    assert decode.sessions == {}
    with pytest.raises(ProtocolError, match="already ended"):  # abandon never buries over it
        decode.abandon(sid, P, "too late")
    prefill.check_integrity()
    decode.check_integrity()


def test_a_transfer_ending_at_the_senders_first_deadline_ends_the_same_on_both_sides() -> None:
    """The receiver opened 5.9 s after the prefill order (it waited for decode memory); the
    only slice is done at 5.999 and its SliceReady is on the wire when the sender's deadline
    from its open (6 s) passes. Counted from the open, the sender failed while the receiver
    committed SUCCESS; from the request's arrival, that deadline no longer ends it."""
    sid = SessionId("race")
    prefill, decode, nodes, rest = _late_receiver(sid, 5.9)
    (start,) = [a for a in rest if isinstance(a, StartSubmit)]
    prefill.receive_local(sid, SubmitStarted(slice_id=start.slice_id), 5.9)
    done = prefill.receive_local(sid, TransportDone(slice_id=start.slice_id), 5.999)
    in_flight = [a for a in done if isinstance(a, Transmit)]
    assert [type(a.event) for a in in_flight] == [SliceReady]
    fin = [a for a in prefill.tick(6.0) if isinstance(a, Finished)]
    fin += [a for a in pump(nodes, in_flight, P, 6.0005) if isinstance(a, Finished)]
    assert [(a.role, a.state) for a in fin] == [
        (Role.RECEIVER, SessionState.SUCCESS), (Role.SENDER, SessionState.SUCCESS)
    ]  # fmt: skip
    assert prefill.sessions == {} and decode.sessions == {}
    prefill.check_integrity()
    decode.check_integrity()


def test_a_sender_whose_receiver_never_decides_fails_one_deadline_after_its_request() -> None:
    """The request came at 2 s; from then on only heartbeats get through (every session frame
    is lost, both ways). The first deadline (6 s) passes harmlessly; the verdict deadline, 6 s
    after the request, ends the sender FAILED with its slice's memory released."""
    sid = SessionId("mute")
    prefill, decode, nodes, rest = _late_receiver(sid, 2.0)
    (start,) = [a for a in rest if isinstance(a, StartSubmit)]
    prefill.receive_local(sid, SubmitStarted(slice_id=start.slice_id), 2.0)
    prefill.receive_local(sid, TransportDone(slice_id=start.slice_id), 2.1)
    ended: list[tuple[float, Finished]] = []
    now = 2.0
    while now < 9:
        now = round(now + 0.25, 2)
        for n in (prefill, decode):
            for a in n.tick(now):
                if isinstance(a, Finished):
                    ended.append((now, a))
                elif isinstance(a, Transmit) and isinstance(a.event, Heartbeat):
                    nodes[a.peer_id].on_event(n.peer_id, a.event, now)
    assert [(t, a.role, a.state, a.reason) for t, a in ended] == [
        (7.0, Role.RECEIVER, SessionState.FAILED, "deadline"),
        (8.0, Role.SENDER, SessionState.FAILED, "deadline: no verdict from the receiver"),
    ]
    assert prefill.sessions == {} and prefill.counters["finished_sender_failed"] == 1
    prefill.check_integrity()


def test_evicted_tombstones_raise_the_epoch_floor() -> None:
    prefill, decode = node(P, tombstone_capacity=1), node(D, 100)
    connect(prefill, decode)
    one_session(prefill, decode, "a")
    one_session(prefill, decode, "b")  # evicts a's tombstone: floor = a's epoch (101)
    assert prefill.tombstone(SessionId("a")) is None
    stale = TransferRequest(
        session_id="a", epoch=101, request_id="r", dst_block_ids=(), prefix_tokens=0, num_tokens=0
    )
    assert prefill.on_event(D, stale, 1.0) == [] and prefill.counters["stale_epoch"] == 1


def test_frames_from_unknown_peers_and_bad_frames_are_counted_not_raised() -> None:
    metrics = MetricsRegistry()
    prefill, decode = node(P, metrics=metrics), node(D, 1 << 20)
    assert prefill.on_event(D, Heartbeat(peer_id="decode", seq=1), 0.0) == []
    connect(prefill, decode)
    one_session(prefill, decode, "s")
    bogus = SliceResult(
        session_id="nobody", epoch=7, slice_id=3, is_last=False, start=0, end=1,
        status=SliceStatus.ACCEPTED,
    )  # fmt: skip
    assert prefill.on_event(D, bogus, 0.0) == []
    sender, _ = prefill.open_sender(SessionId("t"), D, 0.0)
    assert sender is not None
    wrong = AbortAck(session_id="t", epoch=9, token=123, outcome=Outcome.ABORTED)
    assert prefill.on_event(D, wrong, 0.0) == []  # an ack for an abort never sent: dropped
    assert prefill.counters["unknown_peer"] == 1 and prefill.counters["protocol_error"] == 1
    assert prefill.counters["unknown_session"] == 1
    assert metrics.value("pd_participant_events", {"event": "protocol_error"}, "_total") == 1.0
    assert sender.state is SessionState.BOOTSTRAPPING


def test_heartbeats_leases_and_peer_loss_fail_only_that_peers_sessions() -> None:
    prefill, d1, d2 = node(P), node(D, 1 << 20), node(D2, 1 << 30)
    connect(prefill, d1)
    connect(prefill, d2)
    for dec in (d1, d2):
        dec.open_receiver(SessionId(f"s-{dec.peer_id}"), P, START, 0.0)
        prefill.open_sender(SessionId(f"s-{dec.peer_id}"), dec.peer_id, 0.0)
    beats = prefill.tick(1.0)
    assert [a for a in beats if isinstance(a, Transmit) and isinstance(a.event, Heartbeat)] == [
        Transmit(D, Heartbeat(peer_id="prefill", seq=1)),
        Transmit(D2, Heartbeat(peer_id="prefill", seq=1)),
    ]
    assert prefill.on_event(D2, Heartbeat(peer_id="decode2", seq=4), 2.5) == [
        Transmit(D2, LeaseRenew(peer_id="prefill", seq=4, lease_ms=3000))
    ]
    lost = prefill.tick(3.0)  # d1's lease (from t=0) expires at 3.0; d2 renewed at 2.5
    states = {(a.session_id, a.state) for a in lost if isinstance(a, Finished)}
    assert states == {(SessionId("s-decode"), SessionState.FAILED)}
    assert prefill.session(SessionId("s-decode2")).state is SessionState.BOOTSTRAPPING  # type: ignore[union-attr]
    assert prefill.counters["peer_lost"] == 1 and prefill.peers.live_peers() == [D2]
    with pytest.raises(ProtocolError, match="not connected"):
        prefill.open_sender(SessionId("new"), D, 3.1)


def test_a_restarted_peer_fails_its_old_sessions_and_verdicts_are_cached() -> None:
    prefill, decode = node(P), node(D, 1 << 20)
    connect(prefill, decode)
    connect(prefill, decode)
    assert prefill.peers.cached_verdicts == 2  # judged at the Hello and again to admit
    prefill.open_sender(SessionId("old"), D, 0.0)
    reborn = node(D, 1 << 21)
    _, out = prefill.on_hello(reborn.hello(), 1.0)
    assert [a.state for a in out if isinstance(a, Finished)] == [SessionState.FAILED]


def test_incompatible_peers_are_refused_both_ways() -> None:
    lay = LayoutInfo(
        kind="gqa",
        dtype="float16",
        layer_ids=(0,),
        total_heads=4,
        head_start=0,
        head_end=4,
        head_dim=64,
    )
    other = Participant(
        D,
        PeerProfile(protocol_version=PROTOCOL_VERSION, model_id="x", layouts=(lay,)),
        incarnation=1,
    )
    prefill = node(P)
    reply, _ = prefill.on_hello(other.hello(), 0.0)
    assert isinstance(reply, HelloReply) and not reply.accepted  # a refusal: no Hello of ours
    assert "model_id: ours 'tiny-mla', theirs 'x'" in reply.reasons
    assert reply.peer_id == "prefill" and reply.nonce == b""
    verdict, _ = other.on_hello_reply(reply, 0.0)
    assert not verdict.compatible and verdict.reasons[0].startswith("peer refused: ")
    assert prefill.counters["incompatible_peer"] == 1 and not prefill.peers.is_live(D)
    assert D not in prefill.peers  # an incompatible peer leaves no record


def test_an_older_incarnation_is_stale_and_never_a_restart() -> None:
    """An older (or replayed) incarnation used to count as a restart (``!=``): it failed the
    live peer's sessions and replaced its record. It is refused and counted; nothing changes."""
    prefill, decode = node(P), node(D, 1 << 20)
    connect(prefill, decode)
    prefill.open_sender(SessionId("live"), D, 0.0)
    for older in (1 << 19, 0):
        reply, out = prefill.on_hello(node(D, older).hello(), 1.0)
        assert isinstance(reply, HelloReply) and not reply.accepted and out == []
        assert "older than" in reply.reasons[0]
    assert prefill.counters["stale_incarnation"] == 2
    assert prefill.session(SessionId("live")).state is SessionState.BOOTSTRAPPING  # type: ignore[union-attr]
    rec = prefill.peers.get(D)
    assert rec is not None and rec.live and rec.hello.incarnation == 1 << 20
    _, out = prefill.on_hello(node(D, (1 << 20) + 1).hello(), 2.0)  # newer: a real restart
    assert [a.state for a in out if isinstance(a, Finished)] == [SessionState.FAILED]
    assert prefill.counters["peer_restarted"] == 1


def test_a_refusal_withholds_its_reasons_from_a_peer_without_the_secret() -> None:
    lay = LayoutInfo(kind="gqa", dtype="float16", layer_ids=(0,), total_heads=4,
                     head_start=0, head_end=4, head_dim=64)  # fmt: skip
    other = Participant(D, PeerProfile(protocol_version=PROTOCOL_VERSION, model_id="x",
                                       layouts=(lay,)), incarnation=1)  # fmt: skip
    reply, verdict = node(P).answer(other.hello(b"n" * 16), nonce=b"m" * 16, disclose=False)
    assert reply.reasons == (WITHHELD,) and reply.peer_id == "" and not reply.accepted
    assert reply.echo == b"n" * 16 and "tiny-mla" in "; ".join(verdict.reasons)
    assert "tiny-mla" not in repr(reply)


def test_an_acceptance_carries_our_nonce_and_only_the_acknowledgement_our_hello() -> None:
    """Protocol 3: the reply to an unconfirmed Hello carried our whole Hello (profile,
    transport advert); now only our nonce. Our Hello goes out in ``welcome``, once confirmed."""
    prefill = Participant(P, sim_profile(), incarnation=1, timings=T, transport="tcp",
                          transport_metadata=b"\x00ADVERT")  # fmt: skip
    decode = node(D, 1 << 20)
    reply, verdict = prefill.answer(decode.hello(b"a" * 16), nonce=b"b" * 16)
    assert verdict.compatible and reply == HelloReply(
        accepted=True, echo=b"a" * 16, nonce=b"b" * 16
    )
    assert decode.check_reply(reply, nonce=b"a" * 16).compatible and P not in prefill.peers
    ack = prefill.welcome(decode.hello(b"a" * 16), b"b" * 16)
    assert ack == HelloConfirm(echo=b"a" * 16, hello=prefill.hello(b"b" * 16))
    assert ack.hello is not None and ack.hello.transport_metadata == b"\x00ADVERT"
    verdict, _ = decode.on_hello_reply(reply, 0.0, nonce=b"a" * 16)  # no Hello: nobody admitted
    assert not verdict.compatible and not decode.peers.is_live(P)
    verdict, _ = decode.on_hello_reply(ack, 0.0, nonce=b"a" * 16)
    assert verdict.compatible and decode.peers.is_live(P)


def test_a_reply_to_another_hello_is_refused() -> None:
    prefill, decode = node(P), node(D, 1 << 20)
    reply, _ = prefill.answer(decode.hello(b"a" * 16), nonce=b"b" * 16)
    assert reply.accepted
    verdict, _ = decode.on_hello_reply(reply, 0.0, nonce=b"c" * 16)
    assert not verdict.compatible and decode.counters["stale_reply"] == 1
    assert not decode.peers.is_live(P) and P not in prefill.peers  # answer() admits no one


def test_the_peer_table_is_capped_and_dead_peers_are_pruned() -> None:
    prefill = node(P, peer_capacity=2)
    d1, d2, d3 = node(D, 5), node(D2, 5), node(PeerId("decode3"), 5)
    connect(prefill, d1, 0.0)
    connect(prefill, d2, 0.0)
    reply, _ = prefill.on_hello(d3.hello(), 0.0)  # both live: refused, counted, not stored
    assert not reply.accepted and "peer table full" in reply.reasons[0]
    assert prefill.counters["peer_table_full"] == 1 and len(prefill.peers) == 2
    prefill.on_event(D2, Heartbeat(peer_id="decode2", seq=1), 2.5)
    prefill.tick(3.0)  # d1's lease ran out: dead, so the next new peer evicts it
    connect(prefill, d3, 3.0)
    assert sorted(map(str, prefill.peers.live_peers())) == ["decode2", "decode3"]
    assert len(prefill.peers) == 2 and prefill.peers.pruned == 1
    reply, _ = prefill.on_hello(node(D, 4).hello(), 3.5)  # pruned, its incarnation is a floor
    assert not reply.accepted and prefill.counters["stale_incarnation"] == 1
    assert D not in prefill.peers
    prefill.tick(100.0)  # every lease expired; dead for retain_s: pruned
    prefill.tick(100.0 + prefill.peers.retain_s)
    assert len(prefill.peers) == 0 and prefill.peers.pruned == 3


def _tp(name: PeerId, heads: tuple[int, int], role: Role | None) -> Participant:
    lay = LayoutInfo(kind="gqa", dtype="float16", layer_ids=(0,), total_heads=4,
                     head_start=heads[0], head_end=heads[1], head_dim=64)  # fmt: skip
    prof = PeerProfile(protocol_version=PROTOCOL_VERSION, model_id="x", layouts=(lay,))
    return Participant(name, prof, incarnation=1, timings=T, kv_role=role)


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_a_decode_rank_whose_heads_the_prefill_lacks_is_refused_at_the_handshake(
    first: str,
) -> None:
    """Whichever side says Hello first, the pairing is refused with the reason before any
    session can open (it used to pair, and every request failed at its first slice)."""
    prefill, decode = _tp(P, (0, 2), Role.SENDER), _tp(D, (1, 3), Role.RECEIVER)
    server, client = (prefill, decode) if first == "decode" else (decode, prefill)
    reply, _ = server.on_hello(client.hello(), 0.0)
    why = (
        "pool 0 KV heads: the receiver's (1, 3) are not all in the sender's (0, 2): "
        "one sender cannot fill them"
    )
    assert not reply.accepted and reply.reasons == (why,)
    verdict, _ = client.on_hello_reply(reply, 0.0)
    assert not verdict.compatible and verdict.reasons == (f"peer refused: {why}",)
    assert not prefill.peers.is_live(D) and not decode.peers.is_live(P)
    assert server.counters["incompatible_peer"] == client.counters["refused_by_peer"] == 1
    with pytest.raises(ProtocolError):
        decode.open_receiver(SessionId("s"), P, START, 0.0)


def test_covered_head_ranges_and_mla_pair() -> None:
    connect(_tp(P, (0, 4), Role.SENDER), _tp(D, (1, 3), Role.RECEIVER))
    connect(_tp(D, (2, 4), Role.RECEIVER), _tp(P, (2, 4), Role.SENDER))
    connect(_tp(P, (0, 2), None), _tp(D, (1, 3), None))  # no role: left to the slice planner
    connect(node(P, kv_role=Role.SENDER), node(D, 1 << 20, kv_role=Role.RECEIVER))  # MLA


def test_timers_arrive_through_tick_and_evidence_for_retired_sessions_is_dropped() -> None:
    prefill, decode = node(P), node(D, 1 << 20)
    connect(prefill, decode)
    decode.open_receiver(SessionId("s"), P, START, 0.0)
    assert decode.next_deadline() == 0.5  # the request's retransmit timer
    assert [type(a.event) for a in decode.tick(0.5) if isinstance(a, Transmit)] == [TransferRequest]
    out = decode.tick(5.0)  # deadline: FAILED, Abort to the sender
    assert any(isinstance(a, Finished) and a.state is SessionState.FAILED for a in out)
    assert decode.receive_local(SessionId("gone"), TransportDone(slice_id=SliceId(0)), 5.0) == []
    assert decode.counters["late_evidence"] == 1


def test_submittable_tracks_cancellation() -> None:
    prefill, decode = node(P), node(D, 1 << 20)
    connect(prefill, decode)
    nodes = {P: prefill, D: decode}
    _, acts = decode.open_receiver(SessionId("s"), P, START, 0.0)
    pump(nodes, acts, D, 0.0)
    out = prefill.send(
        SessionId("s"), SubmitSlice(slice_id=SliceId(0), is_last=True, start=0, end=0), 0.0
    )
    assert [type(a) for a in out] == [StartSubmit]
    assert prefill.submittable(SessionId("s"), 0)
    rest = pump(nodes, decode.send(SessionId("s"), Cancel(), 0.1), D, 0.1)
    assert not prefill.submittable(SessionId("s"), 0)
    assert (
        Release(SessionId("s"), D, Role.SENDER, 0, Ownership.NOT_SUBMITTED, SessionState.ABORTED)
        in rest
    )


def test_no_session_token_is_the_tombstones_token() -> None:
    """A tombstone's Abort carries TOMB_TOKEN; the participant's tokens start after it."""
    from kvplane.pd.tombstones import TOMB_TOKEN

    p = node(P)
    assert [p._token() for _ in range(3)] == [TOMB_TOKEN + 1, TOMB_TOKEN + 2, TOMB_TOKEN + 3]
