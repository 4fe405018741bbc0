"""A hostile local process against the PD endpoint, on real sockets (and one real ``kvplane
serve`` process): refusals that carry nothing of ours, replayed and older ``Hello`` s that change
nothing, a flood of ``Hello`` s that stores no peer and logs a few lines, replayed frames."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvplane.curve_auth import secure_client
from kvplane.errors import IncompatiblePeerError
from kvplane.ids import PeerId, RequestId, SessionId, SliceId
from kvplane.pd.actions import Action, Finished, StartSubmit
from kvplane.pd.codec import Codec
from kvplane.pd.door import pd_keys
from kvplane.pd.endpoint import ControlClient, Endpoint
from kvplane.pd.events import (
    AnyWireEvent,
    Heartbeat,
    Hello,
    HelloReply,
    LeaseRenew,
    Probe,
    ProbeReply,
    StartTransfer,
    SubmitAccepted,
    SubmitSlice,
    SubmitStarted,
    TransportDone,
)
from kvplane.pd.handshake import PROTOCOL_VERSION, LayoutInfo, PeerProfile
from kvplane.pd.participant import Participant
from kvplane.pd.states import SessionState
from kvplane.testing.session_pair import sim_profile

SECRET = b"endpoint-attack-test-secret"
ADVERT = b"\x00REGIONS-AND-TRANSPORT-ADDRESS"


def _llama(model: str = "llama") -> PeerProfile:
    lay = LayoutInfo(kind="gqa", dtype="float16", layer_ids=(0, 1), total_heads=8,
                     head_start=0, head_end=8, head_dim=128)  # fmt: skip
    return PeerProfile(protocol_version=PROTOCOL_VERSION, model_id=model, layouts=(lay,))


def _fresh(hello: Hello, **changes: object) -> Hello:
    """``hello`` as a capture of the wire carries it: with some nonce (when Hellos have one)."""
    if "nonce" in Hello.__struct_fields__:
        changes["nonce"] = os.urandom(16)
    return msgspec.structs.replace(hello, **changes)


class Raw:
    """A DEALER that speaks handshake frames to an endpoint, as a hostile process would."""

    def __init__(self, address: str, secret: bytes | None, curve: bytes | None = None) -> None:
        """``curve``: the secret its CURVE keys are derived from (default: ``secret``)."""
        self.codec = Codec(secret=secret)
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 5000)  # a refused DEALER has no pipe to queue into
        if (curve or secret) is not None:
            secure_client(self.sock, pd_keys(curve or secret))  # type: ignore[arg-type]
        self.sock.connect(address)

    def send(self, event: AnyWireEvent) -> None:
        self.sock.send(self.codec.encode(event))

    def recv_frame(self, timeout_s: float = 5.0) -> bytes | None:
        return self.sock.recv() if self.sock.poll(int(timeout_s * 1000)) else None

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.mark.parametrize("secret", [SECRET, None])
def test_an_incompatible_hello_is_answered_with_nothing_of_ours(secret: bytes | None) -> None:
    """It used to be answered with the endpoint's own Hello: transport advert, regions, all
    layouts. Now: a minimal refusal, counted; reasons only to a holder of the secret."""
    target = Participant(PeerId("prefill"), sim_profile(), incarnation=7, transport="tcp",
                         transport_metadata=ADVERT)  # fmt: skip
    with Endpoint(target, secret=secret) as ep:
        ep.start()
        raw = Raw(ep.address, secret)
        try:
            raw.send(_fresh(Participant(PeerId("intruder"), _llama(), incarnation=1).hello()))
            frame = raw.recv_frame()
            assert frame is not None
            reply = raw.codec.decode(frame)
            assert isinstance(reply, HelloReply) and not reply.accepted and ADVERT not in frame
            if secret is None:  # not even the reasons, which name our layout
                assert sim_profile().model_id.encode() not in frame
                assert b"prefill" not in frame
            stranger = Raw(ep.address, b"not-the-cluster-secret")  # refused by CURVE: silence
            with contextlib.suppress(zmq.Again):
                stranger.send(
                    _fresh(Participant(PeerId("x"), sim_profile(), incarnation=1).hello())
                )
            assert stranger.recv_frame(0.5) is None
            deadline = time.monotonic() + 5.0  # the door counts the refusal on its own thread
            while not ep.snapshot().get("refused_handshakes") and time.monotonic() < deadline:
                time.sleep(0.01)
            stranger.close()
        finally:
            raw.close()
        snap = ep.snapshot()
        assert snap["handshakes_refused"] == 1
        assert snap["refused_handshakes"] >= 1 and snap.get("dropped_unauthenticated", 0) == 0


class Worker:
    def __init__(self, name: str, incarnation: int) -> None:
        self.actions: list[Action] = []
        self.finished = threading.Event()
        self.ep = Endpoint(Participant(PeerId(name), sim_profile(), incarnation=incarnation),
                           secret=SECRET, on_action=self.on_action)  # fmt: skip

    def on_action(self, act: Action) -> None:
        self.actions.append(act)
        if isinstance(act, StartSubmit):
            for cls in (SubmitStarted, SubmitAccepted, TransportDone):
                self.ep.receive_local(act.session_id, cls(slice_id=act.slice_id))
        if isinstance(act, Finished):
            self.finished.set()


@pytest.fixture
def pair() -> Iterator[tuple[Worker, Worker]]:
    prefill, decode = Worker("prefill", 1), Worker("decode", 1 << 30)
    prefill.ep.start()
    decode.ep.start()
    yield prefill, decode
    decode.ep.close()
    prefill.ep.close()


@pytest.mark.parametrize("replay", ["same", "older"])
def test_a_replayed_or_older_hello_neither_rebinds_nor_restarts(
    pair: tuple[Worker, Worker], replay: str
) -> None:
    """A copy of the decode worker's Hello (a replay, or one of an older incarnation) sent to
    the prefill endpoint by another process: it used to rebind the route to the replayer (the
    session's frames then went nowhere) or count as a restart (its sessions failed)."""
    prefill, decode = pair
    peer = decode.ep.connect(prefill.ep.address)
    sid = SessionId("s1")
    assert prefill.ep.open_sender(sid, PeerId("decode"))
    prefill.ep.send(sid, SubmitSlice(slice_id=SliceId(0), is_last=False, start=0, end=32))
    captured = decode.ep.participant.hello()
    older = captured.incarnation - (1 if replay == "older" else 0)
    raw = Raw(prefill.ep.address, SECRET)
    try:
        raw.send(_fresh(captured, incarnation=older))
        assert raw.recv_frame() is not None  # answered (or refused), and then nothing
        start = StartTransfer(
            request_id=RequestId("r"), dst_block_ids=(3, 4), prefix_tokens=0, num_tokens=64
        )
        decode.ep.open_receiver(sid, peer, start)
        prefill.ep.send(sid, SubmitSlice(slice_id=SliceId(1), is_last=True, start=32, end=64))
        assert decode.finished.wait(5.0) and prefill.finished.wait(5.0)
    finally:
        raw.close()
    done = [a.state for w in pair for a in w.actions if isinstance(a, Finished)]
    assert done == [SessionState.SUCCESS, SessionState.SUCCESS]
    snap = prefill.ep.snapshot()
    assert snap["handshakes_accepted"] == 1 and snap.get("session_peer_restarted", 0) == 0
    assert snap.get("session_stale_incarnation", 0) == (1 if replay == "older" else 0)


def test_a_flood_of_hellos_stores_no_peer_and_logs_a_few_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """300 incompatible and 300 compatible (never confirmed) Hellos from distinct peer ids used
    to leave 600 peer records (300 live) and 300 warning lines."""
    bad = Participant(PeerId("x"), _llama(), incarnation=1).hello()
    good = Participant(PeerId("c"), sim_profile(), incarnation=1).hello()
    with Endpoint(Participant(PeerId("target"), sim_profile(), incarnation=1), secret=SECRET) as ep:
        ep.start()
        raw = Raw(ep.address, SECRET)
        try:
            with caplog.at_level(logging.WARNING, logger="kvplane.pd.endpoint"):
                for i in range(300):
                    raw.send(_fresh(bad, peer_id=f"x{i}"))
                    raw.send(_fresh(good, peer_id=f"c{i}"))
                replies = [raw.recv_frame() for _ in range(600)]
        finally:
            raw.close()
        assert all(r is not None for r in replies)
        stored = ep.call(lambda: len(ep.participant.peers._peers))
        snap = ep.snapshot()
    assert stored == 0
    assert snap["handshakes_refused"] == 300 and snap.get("handshakes_pending", 0) <= 32
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 6, len(warnings)


def test_frames_replayed_on_an_association_or_moved_to_another_connection_are_dropped() -> None:
    with Endpoint(Participant(PeerId("target"), sim_profile(), incarnation=1), secret=SECRET) as ep:
        ep.start()
        client = ControlClient(ep.address, secret=SECRET, timeout_s=2.0)
        other = ControlClient(ep.address, secret=SECRET, timeout_s=2.0)
        try:
            me = Participant(PeerId("client"), sim_profile(), incarnation=1)
            assert client.handshake(me.hello()).accepted
            assert client.assoc is not None
            frame = client.codec.encode(Heartbeat(peer_id="client", seq=77), client.assoc)
            client.send_raw(frame)
            client.send_raw(frame)  # the replay
            other.send_raw(frame)  # the same frame from another connection
            renewals = []
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                try:
                    got = client.recv()
                except Exception:
                    break
                if isinstance(got, LeaseRenew) and got.seq == 77:
                    renewals.append(got)
            counters = client.probe(5).counters
        finally:
            client.close()
            other.close()
    assert len(renewals) == 1
    assert counters["dropped_replayed"] == 1 and counters["dropped_unauthenticated"] == 1
    assert counters["handshakes_accepted"] == 1


# -- a real ``kvplane serve`` process ------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_serve_process_refuses_with_nothing_of_ours_and_logs_a_few_lines() -> None:
    """``kvplane serve prefill`` with a secret: a Hello flood from 200 distinct incompatible
    peers gets minimal refusals and a bounded number of log lines (one 600-byte line each
    before), and the worker still answers its probe."""
    secret = secrets.token_hex(32).encode()
    env = dict(os.environ, KVPLANE_SECRET=secret.decode(), PYTHONUNBUFFERED="1")
    args = ["--name", "prefill", "--control", f"tcp://127.0.0.1:{_port()}"]
    args += ["--pd", f"tcp://127.0.0.1:{_port()}", "--layout", "mla", "--layers", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvplane", "serve", "prefill", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        info = msgspec.json.decode(line)
        raw = Raw(str(info["pd"]), secret)
        try:
            bad = Participant(PeerId("x"), _llama(), incarnation=1).hello()
            for i in range(200):
                raw.send(_fresh(bad, peer_id=f"intruder-{i}"))
            for _ in range(200):
                frame = raw.recv_frame(10.0)
                assert frame is not None
                reply = raw.codec.decode(frame)
                assert isinstance(reply, HelloReply) and not reply.accepted
                assert str(info["pd"]).encode() not in frame
        finally:
            raw.close()
        probe = ControlClient(str(info["pd"]), secret=secret)
        try:
            counters = probe.probe(9).counters
        finally:
            probe.close()
        assert counters["handshakes_refused"] == 200
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate(timeout=10)
    refusals = [ln for ln in err.splitlines() if "intruder-" in ln]
    assert 1 <= len(refusals) <= 6, refusals[:8]


# -- replayed handshake frames and probes (protocol 3) -------------------------------------------
def _advertiser(name: str = "prefill") -> Participant:
    return Participant(PeerId(name), sim_profile(), incarnation=7, transport="tcp",
                       transport_metadata=ADVERT)  # fmt: skip


@pytest.mark.parametrize("secret", [SECRET, None])
def test_a_replayed_hello_is_answered_once_and_without_our_advert(secret: bytes | None) -> None:
    """A captured Hello replayed 100 times used to get 100 full replies, each carrying our
    Hello: layouts, regions, transport address. Now the first copy gets our nonce alone and
    the other 99 nothing (``dropped_replayed_hello``)."""
    captured = Raw.__new__(Raw)
    captured.codec = Codec(secret=secret)
    hello = Participant(PeerId("decode"), sim_profile(), incarnation=1).hello(os.urandom(16))
    frame = captured.codec.encode(hello)
    with Endpoint(_advertiser(), secret=secret) as ep:
        ep.start()
        raw = Raw(ep.address, secret)
        try:
            for _ in range(100):
                raw.sock.send(frame)
            replies = []
            while (got := raw.recv_frame(1.0)) is not None:
                replies.append(got)
        finally:
            raw.close()
        snap = ep.snapshot()
    assert len(replies) == 1 and snap["dropped_replayed_hello"] == 99
    reply = raw.codec.decode(replies[0])
    assert isinstance(reply, HelloReply) and reply.accepted and len(reply.nonce) == 16
    assert ADVERT not in replies[0] and sim_profile().model_id.encode() not in replies[0]
    assert snap["handshakes_pending"] == 1 and snap["peers_stored"] == 0


@pytest.mark.parametrize("secret", [SECRET, None])
def test_replayed_hellos_never_evict_a_genuine_handshake_in_progress(secret: bytes | None) -> None:
    """Between a genuine peer's Hello and its confirm, captured Hellos of 40 other peer ids
    arrive on 40 connections. Before, the 32nd evicted the genuine greeting (32 slots, oldest
    dropped first): its confirm was dropped and the handshake failed. Now each peer id (and
    connection) has one slot, newcomers are turned away when all are taken, and the genuine
    handshake completes; only then does the endpoint's Hello (with its advert) go out,
    sealed on the association."""
    captures = Codec(secret=secret)
    frames = [
        captures.encode(
            Participant(PeerId(f"ghost-{i}"), sim_profile(), incarnation=1).hello(os.urandom(16))
        )
        for i in range(40)
    ]
    with Endpoint(_advertiser(), secret=secret) as ep:
        ep.start()
        genuine = ControlClient(ep.address, secret=secret)
        raws = [Raw(ep.address, secret) for _ in frames]
        try:
            me = Participant(PeerId("decode"), sim_profile(), incarnation=1)
            ours, reply = genuine.greet(me.hello())
            assert reply.accepted
            for raw, frame in zip(raws, frames, strict=True):
                raw.sock.send(frame)
            answers = [raw.recv_frame(5.0) for raw in raws]
            assert all(a is not None and ADVERT not in a for a in answers)
            theirs = genuine.confirm(ours, reply)
            assert theirs.transport_metadata == ADVERT and theirs.peer_id == "prefill"
        finally:
            for raw in raws:
                raw.close()
            genuine.close()
        snap = ep.snapshot()
        live = ep.call(ep.participant.peers.live_peers)
    assert live == ["decode"] and snap["handshakes_accepted"] == 1
    assert snap["handshakes_busy"] == 9 and snap["handshakes_pending"] == 31  # 32 slots


def test_a_captured_probe_replayed_without_keys_gets_nothing() -> None:
    """Probes are handshake frames (sequence 0): a captured one replays. It used to be
    answered to anyone who replayed it (peer id and every counter); now a peer without the
    cluster's CURVE keys is refused before its frame is read. A replayed ProbeReply changes
    nothing (a frame from no peer: dropped and counted)."""
    codec = Codec(secret=SECRET)
    probe = codec.encode(Probe(nonce=42))
    with Endpoint(_advertiser(), secret=SECRET) as ep:
        ep.start()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        thief = ctx.socket(zmq.DEALER)
        thief.setsockopt(zmq.LINGER, 0)
        thief.setsockopt(zmq.SNDTIMEO, 1000)
        thief.connect(ep.address)
        member = Raw(ep.address, SECRET)
        try:
            with contextlib.suppress(zmq.Again):  # refused already: nowhere to send
                thief.send(probe)
            assert thief.poll(1000) == 0
            member.sock.send(probe)  # a member may probe, even with a captured frame
            answer = member.recv_frame()
            assert answer is not None and isinstance(codec.decode(answer), ProbeReply)
            member.sock.send(answer)  # the reply replayed to the endpoint
            member.sock.send(probe)
            assert member.recv_frame() is not None  # served after it
        finally:
            thief.close(linger=0)
            ctx.term()
            member.close()
        snap = ep.snapshot()
    assert snap["probes"] == 2 and snap["dropped_unknown_peer"] == 1
    assert snap["refused_handshakes"] >= 1 and snap["peers_stored"] == 0
    assert snap["sessions_live"] == 0 and snap["handshakes_pending"] == 0


def test_a_hello_flood_leaves_a_live_pair_alone(pair: tuple[Worker, Worker]) -> None:
    """300 Hellos of distinct peer ids and 50 fresh copies of the decode worker's own Hello,
    sent to the prefill endpoint while the pair is live: no eviction, no restart, no route
    change, no peer lost (nothing for the router to re-pair), and the session completes."""
    prefill, decode = pair
    peer = decode.ep.connect(prefill.ep.address)
    sid = SessionId("s1")
    assert prefill.ep.open_sender(sid, PeerId("decode"))
    prefill.ep.send(sid, SubmitSlice(slice_id=SliceId(0), is_last=False, start=0, end=32))
    route = prefill.ep.call(lambda: dict(prefill.ep._routes))
    raw = Raw(prefill.ep.address, SECRET)
    try:
        ghost = Participant(PeerId("g"), sim_profile(), incarnation=1).hello()
        for i in range(300):
            raw.send(_fresh(ghost, peer_id=f"ghost-{i}"))
        for _ in range(50):
            raw.send(_fresh(decode.ep.participant.hello()))
        assert all(raw.recv_frame() is not None for _ in range(350))
        start = StartTransfer(
            request_id=RequestId("r"), dst_block_ids=(3, 4), prefix_tokens=0, num_tokens=64
        )
        decode.ep.open_receiver(sid, peer, start)
        prefill.ep.send(sid, SubmitSlice(slice_id=SliceId(1), is_last=True, start=32, end=64))
        assert decode.finished.wait(5.0) and prefill.finished.wait(5.0)
    finally:
        raw.close()
    snap = prefill.ep.snapshot()
    assert prefill.ep.call(lambda: dict(prefill.ep._routes)) == route
    assert snap["handshakes_accepted"] == 1 and snap.get("session_peer_restarted", 0) == 0
    assert snap.get("session_peer_lost", 0) == 0 and snap["handshakes_pending"] <= 32
    assert prefill.ep.call(prefill.ep.participant.peers.live_peers) == ["decode"]
    assert decode.ep.call(decode.ep.participant.peers.live_peers) == ["prefill"]


def test_an_initiator_that_refuses_our_hello_after_we_admitted_it_is_dropped() -> None:
    """The responder admits at the confirm; the initiator judges the responder's Hello only in
    the acknowledgement. If it refuses then (here: its peer table is full), it says so on the
    association, and the responder forgets it instead of keeping a peer that never comes."""
    full = Participant(PeerId("decode"), sim_profile(), incarnation=1, peer_capacity=1)
    with (
        Endpoint(full, secret=SECRET) as decode,
        Endpoint(_advertiser("prefill-a"), secret=SECRET) as first,
        Endpoint(_advertiser("prefill-b"), secret=SECRET) as second,
    ):
        for ep in (decode, first, second):
            ep.start()
        assert decode.connect(first.address) == "prefill-a"
        with pytest.raises(IncompatiblePeerError, match="peer table full"):
            decode.connect(second.address)
        deadline = time.monotonic() + 5.0
        while second.snapshot().get("handshakes_revoked", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        snap = second.snapshot()
        live = second.call(second.participant.peers.live_peers)
    assert snap["handshakes_accepted"] == 1 and snap["handshakes_revoked"] == 1 and live == []
