"""The zmq endpoint on 127.0.0.1: handshakes, sessions, probes, and a frame fuzzer.

The fuzzer sends batches of random and mutated frames (hypothesis) from a client that never
handshakes, then a probe: the control loop must still answer, and its counters must have moved
by exactly the batch's expected drops. 2,000 frames by default, 100,000 with KVPLANE_SLOW=1.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplane.errors import IncompatiblePeerError, TransferTimeoutError
from kvplane.ids import PeerId, RequestId, SessionId, SliceId
from kvplane.metrics import MetricsRegistry
from kvplane.pd.actions import Action, Finished, Release, StartSubmit
from kvplane.pd.codec import Codec
from kvplane.pd.endpoint import MAX_WAIT_MS, ControlClient, Endpoint
from kvplane.pd.events import (
    Probe,
    ProbeReply,
    SliceReady,
    StartTransfer,
    SubmitAccepted,
    SubmitSlice,
    SubmitStarted,
    TransportDone,
)
from kvplane.pd.handshake import PROTOCOL_VERSION, LayoutInfo, PeerProfile
from kvplane.pd.participant import Participant
from kvplane.pd.states import SessionState
from kvplane.pd.timers import Timings
from kvplane.testing.session_pair import sim_profile

MAX_FRAME = 4096
SECRET = b"endpoint-test-secret!"


def participant(name: str, incarnation: int, profile: PeerProfile | None = None) -> Participant:
    return Participant(PeerId(name), profile or sim_profile(), incarnation=incarnation)


class Worker:
    """An endpoint whose actions are collected; the prefill one drives slices to DONE."""

    def __init__(self, name: str, incarnation: int, secret: bytes | None = None) -> None:
        self.actions: list[Action] = []
        self.finished = threading.Event()
        self.ep = Endpoint(
            participant(name, incarnation), secret=secret, on_action=self.on_action,
            metrics=MetricsRegistry(),
        )  # fmt: skip

    def on_action(self, act: Action) -> None:
        self.actions.append(act)
        if isinstance(act, StartSubmit):  # the driver: submit, and the transport reports DONE
            for cls in (SubmitStarted, SubmitAccepted, TransportDone):
                self.ep.receive_local(act.session_id, cls(slice_id=act.slice_id))
        if isinstance(act, Finished):
            self.finished.set()


@pytest.fixture
def pd() -> Iterator[tuple[Worker, Worker]]:
    prefill, decode = Worker("prefill", 1, SECRET), Worker("decode", 1 << 30, SECRET)
    prefill.ep.start()
    decode.ep.start()
    yield prefill, decode
    decode.ep.close()
    prefill.ep.close()


def test_binds_loopback_and_runs_a_session_end_to_end(pd: tuple[Worker, Worker]) -> None:
    prefill, decode = pd
    assert prefill.ep.address.startswith("tcp://127.0.0.1:")
    peer = decode.ep.connect(prefill.ep.address)
    assert peer == "prefill"
    sid = SessionId("s1")
    assert prefill.ep.open_sender(sid, PeerId("decode"))
    prefill.ep.send(sid, SubmitSlice(slice_id=SliceId(0), is_last=False, start=0, end=32))
    start = StartTransfer(
        request_id=RequestId("r"), dst_block_ids=(3, 4), prefix_tokens=0, num_tokens=64
    )
    decode.ep.open_receiver(sid, peer, start)
    prefill.ep.send(sid, SubmitSlice(slice_id=SliceId(1), is_last=True, start=32, end=64))
    assert decode.finished.wait(5.0) and prefill.finished.wait(5.0)
    done = [a for w in pd for a in w.actions if isinstance(a, Finished)]
    assert sorted((a.role.value, a.state) for a in done) == [
        ("receiver", SessionState.SUCCESS),
        ("sender", SessionState.SUCCESS),
    ]
    releases = [a for w in pd for a in w.actions if isinstance(a, Release)]
    assert sorted((a.role.value, a.unit) for a in releases) == [
        ("receiver", 0),
        ("sender", 0),
        ("sender", 1),
    ]
    snap = prefill.ep.snapshot()
    assert snap["handshakes_accepted"] == 1 and snap["sessions_live"] == 0
    assert not any(k.startswith("dropped_") for k in snap)


def _llama() -> PeerProfile:
    lay = LayoutInfo(kind="gqa", dtype="float16", layer_ids=(0, 1), total_heads=8,
                     head_start=0, head_end=8, head_dim=128)  # fmt: skip
    return PeerProfile(protocol_version=PROTOCOL_VERSION, model_id="llama", layouts=(lay,))


@pytest.mark.parametrize("secret", [SECRET, None])
def test_an_incompatible_peer_is_refused_loudly(
    caplog: pytest.LogCaptureFixture, secret: bytes | None
) -> None:
    """The reasons (they name our layout) go only to a peer that proved the secret."""
    with (
        Endpoint(participant("prefill", 1), secret=secret) as server,
        Endpoint(participant("decode", 2, _llama()), secret=secret) as client,
    ):
        server.start()
        why = "peer refused: model_id: ours 'tiny-mla', theirs 'llama'" if secret else "secret"
        with (
            caplog.at_level(logging.WARNING, logger="kvplane.pd.endpoint"),
            pytest.raises(IncompatiblePeerError, match=why),
        ):
            client.connect(server.address)  # no loop thread on the client: connect pumps step()
        assert server.snapshot()["handshakes_refused"] == 1
        assert "refused peer 'decode': model_id: ours 'tiny-mla', theirs 'llama'" in caplog.text


def test_probe_answers_before_any_handshake_and_without_a_loop_thread() -> None:
    with Endpoint(participant("solo", 1)) as ep:
        client = ControlClient(ep.address)
        try:
            client.send(Probe(nonce=5))
            while ep.step(timeout_ms=50) == 0:
                pass
            reply = client.recv()
            assert isinstance(reply, ProbeReply) and reply.nonce == 5 and reply.peer_id == "solo"
            assert reply.counters["probes"] == 1 and reply.counters["frames_in"] == 1
        finally:
            client.close()


# -- the fuzzer ----------------------------------------------------------------------------------
PLAIN, KEYED = Codec(max_frame=MAX_FRAME), Codec(secret=SECRET, max_frame=MAX_FRAME)
GOOD = [
    KEYED.encode(SliceReady(session_id="s", epoch=3, slice_id=1, is_last=False, start=0, end=5)),
    KEYED.encode(Probe(nonce=77)),
]


@st.composite
def hostile(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """``(expected counter, multipart message)`` for an endpoint keyed with SECRET."""
    how = draw(
        st.sampled_from(["random", "flip", "plain", "version", "garbage", "parts", "stranger"])
    )
    base = draw(st.sampled_from(GOOD))
    if how == "random":  # random bytes: a 16-byte MAC cannot match
        return "dropped_unauthenticated", [draw(st.binary(min_size=17, max_size=200))]
    if how == "flip":
        pos = draw(st.integers(0, len(base) - 1))
        return "dropped_unauthenticated", [base[:pos] + bytes([base[pos] ^ 0x5A]) + base[pos + 1 :]]
    if how == "plain":  # a valid frame, CRC-tagged: no MAC
        return "dropped_unauthenticated", [PLAIN.encode(Probe(nonce=1 << 40))]
    if how == "version":
        return "dropped_unknown_version", [KEYED.seal(msgspec.msgpack.encode([9, Probe(nonce=1)]))]
    if how == "garbage":  # 0xc1 is never valid msgpack: authenticated but malformed
        return "dropped_malformed", [KEYED.seal(b"\xc1" + draw(st.binary(max_size=64)))]
    if how == "parts":
        return "dropped_bad_parts", [base, draw(st.binary(max_size=16))]
    return "dropped_unknown_peer", [GOOD[0]]  # valid session frame from a peer with no handshake


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[Endpoint, ControlClient]]:
    ep = Endpoint(participant("target", 1), secret=SECRET, max_frame=MAX_FRAME)
    ep.start()
    client = ControlClient(ep.address, secret=SECRET, max_frame=MAX_FRAME)
    yield ep, client
    client.close()
    ep.close()


NONCE = iter(range(1, 1 << 40))


def fuzz_batch(
    target: tuple[Endpoint, ControlClient], batch: list[tuple[str, list[bytes]]]
) -> None:
    _, client = target
    before = client.probe(next(NONCE)).counters
    expected = Counter(kind for kind, _ in batch)
    for _, parts in batch:
        client.send_raw(*parts)
    after = client.probe(next(NONCE)).counters  # the loop is alive and serves a valid request
    for key in set(before) | set(after) | set(expected):
        if key.startswith("dropped_"):
            assert after.get(key, 0) - before.get(key, 0) == expected[key], key
    assert after["frames_in"] - before["frames_in"] == len(batch) + 1
    assert after["frames_ok"] - before["frames_ok"] == expected["dropped_unknown_peer"] + 1


def fuzz(examples: int) -> settings:
    checks = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]
    return settings(max_examples=examples, deadline=None, suppress_health_check=checks)


@fuzz(40)
@given(batch=st.lists(hostile(), min_size=50, max_size=50))
def test_fuzz_2000_frames(
    target: tuple[Endpoint, ControlClient], batch: list[tuple[str, list[bytes]]]
) -> None:
    fuzz_batch(target, batch)


@pytest.mark.slow
@fuzz(2000)
@given(batch=st.lists(hostile(), min_size=50, max_size=50))
def test_fuzz_100000_frames(
    target: tuple[Endpoint, ControlClient], batch: list[tuple[str, list[bytes]]]
) -> None:
    fuzz_batch(target, batch)


def test_connect_to_nobody_times_out_and_cleans_up() -> None:
    with Endpoint(participant("lonely", 1)) as ep:
        ep.start()
        with pytest.raises(TransferTimeoutError, match="timed out"):
            ep.connect("tcp://127.0.0.1:9", timeout_s=0.2)
        assert ep.call(lambda: len(ep.greeter.pending)) == 0


def test_an_idle_loop_sleeps_until_its_next_deadline_instead_of_ticking() -> None:
    """No peers, no timers: the loop wakes at most every MAX_WAIT_MS (a fixed 2 ms tick woke
    about 150 times in 0.3 s), yet a command is served at once."""
    with Endpoint(participant("idle", 1)) as ep:
        ep.start()
        ep.call(lambda: None)
        before = ep.snapshot().get("idle_wakeups", 0)
        time.sleep(0.3)
        t0 = time.monotonic()
        assert ep.call(lambda: 42) == 42
        answered_s = time.monotonic() - t0
        woke = ep.snapshot().get("idle_wakeups", 0) - before
    assert woke <= 0.3 / (MAX_WAIT_MS / 1e3) + 2
    assert answered_s < MAX_WAIT_MS / 1e3


def test_a_dead_peer_fails_its_sessions_and_memory_is_released() -> None:
    fast = Timings(heartbeat_s=0.05, lease_s=0.3, in_doubt_s=0.05)
    prefill = Endpoint(Participant(PeerId("prefill"), sim_profile(), incarnation=1, timings=fast))
    done = threading.Event()
    seen: list[Action] = []

    def on_action(act: Action) -> None:
        seen.append(act)
        if isinstance(act, Release):
            done.set()

    decode = Endpoint(
        Participant(PeerId("decode"), sim_profile(), incarnation=2, timings=fast),
        on_action=on_action,
    )
    with decode:
        prefill.start()
        decode.start()
        peer = decode.connect(prefill.address)
        start = StartTransfer(
            request_id=RequestId("r"), dst_block_ids=(1,), prefix_tokens=0, num_tokens=8
        )
        decode.open_receiver(SessionId("s"), peer, start)
        prefill.close()  # the prefill worker dies with the session open
        assert done.wait(10.0)
    finished = [a for a in seen if isinstance(a, Finished)]
    assert [(a.state, a.reason) for a in finished] == [(SessionState.FAILED, "peer lost")]
    assert [a.via.value for a in seen if isinstance(a, Release)] == ["expired"]


def test_the_loop_survives_a_failing_action_callback_and_an_unencodable_frame() -> None:
    def explode(act: Action) -> None:
        raise RuntimeError("application bug")

    prefill = Endpoint(participant("prefill", 1), on_action=explode)
    decode = Endpoint(participant("decode", 2), max_frame=256)
    with prefill, decode:
        prefill.start()
        decode.start()
        peer = decode.connect(prefill.address)
        prefill.open_sender(SessionId("s"), PeerId("decode"))
        prefill.send(SessionId("s"), SubmitSlice(slice_id=SliceId(0), is_last=True, start=0, end=8))
        big = StartTransfer(
            request_id=RequestId("r"),
            dst_block_ids=tuple(range(500)),
            prefix_tokens=0,
            num_tokens=8,
        )
        decode.open_receiver(SessionId("s"), peer, big)  # 500 block ids: over max_frame=256
        prefill.open_sender(SessionId("t"), PeerId("decode"))
        prefill.send(SessionId("t"), SubmitSlice(slice_id=SliceId(0), is_last=True, start=0, end=8))
        small = StartTransfer(
            request_id=RequestId("r"), dst_block_ids=(1,), prefix_tokens=0, num_tokens=8
        )
        decode.open_receiver(SessionId("t"), peer, small)  # its request → StartSubmit → explode()
        deadline = time.monotonic() + 10.0
        while prefill.snapshot().get("loop_errors", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        client = ControlClient(prefill.address)
        try:
            assert client.probe(3).counters["loop_errors"] >= 1  # and it still answers
        finally:
            client.close()
        assert decode.snapshot()["dropped_unencodable"] == 1
