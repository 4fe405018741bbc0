"""Frames: round trips, every drop reason, authentication, and a mutation fuzzer.

The fuzzer draws batches of frames with hypothesis (random bytes; valid frames with flipped,
cut or spliced bytes; garbage bodies sealed with a valid tag so they reach the decoder; other
protocol versions). ``decode`` must never raise, must reject everything that is not a valid
frame, and whatever it accepts must be a valid event that round-trips. 2,000 frames by default,
100,000 with KVPLANE_SLOW=1.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplane.errors import InvalidArgumentError
from kvplane.pd.codec import Codec, DropReason, MalformedMessage
from kvplane.pd.events import (
    WIRE_EVENTS,
    Abort,
    AbortAck,
    AnyWireEvent,
    Heartbeat,
    Hello,
    HelloConfirm,
    HelloReply,
    LeaseRenew,
    Outcome,
    Probe,
    ProbeReply,
    SliceReady,
    SliceResult,
    SliceStatus,
    TransferRequest,
    WireEvent,
)
from kvplane.pd.handshake import PROTOCOL_VERSION, compat_fingerprint
from kvplane.testing.session_pair import sim_profile

SECRET = b"0123456789abcdef-secret"
PROFILE = sim_profile()
HELLO = Hello(
    peer_id="p", incarnation=3, profile=PROFILE, fingerprint=compat_fingerprint(PROFILE),
    transport="tcp", transport_metadata=b"\x00meta", lease_ms=5000,
)  # fmt: skip
CORPUS: list[AnyWireEvent] = [
    HELLO,
    HelloReply(accepted=False, echo=b"n" * 16, reasons=("model_id: ours 'a'",)),
    HelloReply(accepted=True, echo=b"n" * 16, nonce=b"m" * 16),
    HelloConfirm(echo=b"r" * 16),
    HelloConfirm(echo=b"r" * 16, hello=HELLO),
    Heartbeat(peer_id="p", seq=7),
    LeaseRenew(peer_id="p", seq=7, lease_ms=5000),
    Probe(nonce=1),
    ProbeReply(nonce=1, peer_id="p", counters={"frames_in": 3}),
    TransferRequest(
        session_id="s",
        epoch=2,
        request_id="r",
        dst_block_ids=(1, 5, 9),
        prefix_tokens=16,
        num_tokens=100,
    ),
    SliceReady(session_id="s", epoch=2, slice_id=0, is_last=False, start=16, end=64),
    SliceResult(
        session_id="s",
        epoch=2,
        slice_id=0,
        is_last=True,
        start=16,
        end=64,
        status=SliceStatus.COMMITTED,
    ),
    Abort(session_id="s", epoch=2, token=9, outcome=Outcome.FAILED, reason="x", drained=False),
    AbortAck(session_id="s", epoch=2, token=9, outcome=Outcome.ABORTED),
]


def test_corpus_covers_every_wire_event() -> None:
    assert {type(e) for e in CORPUS} == set(WIRE_EVENTS)


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("event", CORPUS, ids=lambda e: type(e).__name__)
def test_round_trip(event: AnyWireEvent, secret: bytes | None) -> None:
    codec = Codec(secret=secret)
    frame = codec.encode(event)
    body = msgspec.msgpack.encode([PROTOCOL_VERSION, 0, event])
    assert len(frame) - len(body) == codec.tag_bytes
    assert codec.decode(frame) == event


def test_every_drop_reason() -> None:
    codec = Codec(max_frame=256)
    frame = codec.encode(Probe(nonce=1))
    assert codec.decode(b"x" * 257) == MalformedMessage(DropReason.OVERSIZED, "257 > 256", 257)
    assert codec.decode(b"abc").reason is DropReason.MALFORMED  # type: ignore[union-attr]
    flipped = bytes([frame[0] ^ 1]) + frame[1:]
    assert codec.decode(flipped) == MalformedMessage(
        DropReason.MALFORMED, "tag mismatch", len(frame)
    )
    other = codec.seal(msgspec.msgpack.encode([9, 0, Probe(nonce=1)]))
    assert codec.decode(other) == MalformedMessage(
        DropReason.UNKNOWN_VERSION, "version 9", len(other)
    )
    old = codec.seal(msgspec.msgpack.encode([1, Probe(nonce=1)]))  # version 1: no sequence
    assert codec.decode(old) == MalformedMessage(DropReason.UNKNOWN_VERSION, "version 1", len(old))
    junk = codec.decode(codec.seal(b"\xc1junk"))
    assert isinstance(junk, MalformedMessage) and junk.reason is DropReason.MALFORMED
    event = ["slice_ready", "s", 1, 0, False, 9, 3]
    invalid = codec.seal(msgspec.msgpack.encode([PROTOCOL_VERSION, 0, event]))
    bad = codec.decode(invalid)  # end < start: the struct's own validation rejects it
    assert isinstance(bad, MalformedMessage) and "end < start" in bad.detail


def test_hmac_authenticates_and_a_wrong_secret_is_unauthenticated() -> None:
    ours, theirs = Codec(secret=SECRET), Codec(secret=b"another-secret-of-16")
    frame = theirs.encode(Heartbeat(peer_id="p", seq=1))
    got = ours.decode(frame)
    assert isinstance(got, MalformedMessage) and got.reason is DropReason.UNAUTHENTICATED
    assert Codec().decode(ours.encode(Probe(nonce=2))).reason is DropReason.MALFORMED  # type: ignore[union-attr]
    with pytest.raises(InvalidArgumentError, match="at least 16"):
        Codec(secret=b"short")


def test_encode_refuses_frames_over_the_limit() -> None:
    codec = Codec(max_frame=64)
    with pytest.raises(InvalidArgumentError, match="over max_frame=64"):
        codec.encode(TransferRequest(
            session_id="s", epoch=1, request_id="r", dst_block_ids=tuple(range(100)),
            prefix_tokens=0, num_tokens=1,
        ))  # fmt: skip


# -- the fuzzer ----------------------------------------------------------------------------------
CODEC = Codec()
VALID = [CODEC.encode(e) for e in CORPUS]


@st.composite
def mutated_frame(draw: st.DrawFn) -> tuple[str, bytes]:
    """``(kind, frame)``: kind says what the decoder must make of it."""
    how = draw(
        st.sampled_from(["random", "flip", "cut", "splice", "sealed", "sealed_valid", "version"])
    )
    base = draw(st.sampled_from(VALID))
    if how == "random":
        return how, draw(st.binary(max_size=300))
    if how == "flip":
        pos = draw(st.integers(0, len(base) - 1))
        return how, base[:pos] + bytes([base[pos] ^ draw(st.integers(1, 255))]) + base[pos + 1 :]
    if how == "cut":
        return how, base[: draw(st.integers(0, len(base) - 1))]
    if how == "splice":
        other = draw(st.sampled_from(VALID))
        return how, base[: draw(st.integers(1, len(base) - 1))] + other[
            draw(st.integers(0, len(other) - 1)) :
        ]
    body = base[: -CODEC.tag_bytes]
    if how == "version":
        event = CODEC.decode(base)
        version = draw(st.integers(0, 1 << 40).filter(lambda v: v != PROTOCOL_VERSION))
        return how, CODEC.seal(msgspec.msgpack.encode([version, 0, event]))
    if how == "sealed_valid":
        return how, base
    pos = draw(st.integers(0, len(body) - 1))  # a mutated body with a valid tag reaches the decoder
    return how, CODEC.seal(body[:pos] + draw(st.binary(min_size=1, max_size=8)) + body[pos + 1 :])


def check_batch(frames: list[tuple[str, bytes]]) -> None:
    for how, frame in frames:
        got = CODEC.decode(frame)  # must never raise
        if how == "sealed_valid":
            assert isinstance(got, WireEvent)
        elif how == "version":
            assert isinstance(got, MalformedMessage) and got.reason is DropReason.UNKNOWN_VERSION
        elif how == "sealed":
            if isinstance(got, WireEvent):  # a mutation can still be a valid event: then exact
                assert CODEC.decode(CODEC.encode(got)) == got
            else:
                assert isinstance(got, MalformedMessage)
        elif frame not in VALID:
            assert isinstance(got, MalformedMessage), (how, frame)


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@fuzz(40)
@given(st.lists(mutated_frame(), min_size=50, max_size=50))
def test_fuzz_2000_frames(frames: list[tuple[str, bytes]]) -> None:
    check_batch(frames)


@pytest.mark.slow
@fuzz(2000)
@given(st.lists(mutated_frame(), min_size=50, max_size=50))
def test_fuzz_100000_frames(frames: list[tuple[str, bytes]]) -> None:
    check_batch(frames)
