"""Associations: the replay window, direction keys bound to both nonces, and the codec's use
of them (a replayed, reflected or transplanted frame is dropped; reordering is tolerated)."""

from __future__ import annotations

import msgspec
import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.pd.association import REPLAY_WINDOW, ReplayWindow, associate, transcript
from kvplane.pd.codec import Codec, DropReason, MalformedMessage
from kvplane.pd.events import Heartbeat, Hello, Probe
from kvplane.pd.handshake import compat_fingerprint
from kvplane.testing.session_pair import sim_profile

SECRET = b"association-test-secret"
PROFILE = sim_profile()


def hello(name: str, nonce: bytes, incarnation: int = 1) -> Hello:
    return Hello(peer_id=name, incarnation=incarnation, profile=PROFILE,
                 fingerprint=compat_fingerprint(PROFILE), nonce=nonce)  # fmt: skip


HI, HR = hello("decode", b"i" * 16), b"r" * 16


def test_the_window_accepts_each_number_once_and_tolerates_reordering() -> None:
    w = ReplayWindow(size=8)
    assert [w.accept(s) for s in (1, 3, 2, 3, 1, 0)] == [True, True, True, False, False, False]
    assert w.accept(20) and not w.accept(12) and w.accept(13) and not w.accept(13)
    assert w.accept(1 << 40) and not w.accept(20)  # a jump past the window clears it
    assert ReplayWindow().size == REPLAY_WINDOW


def test_both_sides_derive_matching_keys_from_both_nonces() -> None:
    for secret in (SECRET, None):
        i = associate(secret, HI, HR, we_initiated=True)
        r = associate(secret, HI, HR, we_initiated=False)
        assert i.send_key == r.recv_key and i.recv_key == r.send_key and i.binding == r.binding
        assert i.send_key != i.recv_key  # a reflected frame fails its tag
        other = associate(secret, hello("decode", b"j" * 16), HR, we_initiated=True)
        assert other.send_key != i.send_key  # a fresh nonce: a fresh key
    with pytest.raises(InvalidArgumentError, match="initiator nonce is 0 bytes"):
        transcript(hello("decode", b""), HR)
    with pytest.raises(InvalidArgumentError, match="responder nonce is 8 bytes"):
        transcript(HI, b"r" * 8)


@pytest.mark.parametrize("secret", [SECRET, None])
def test_frames_on_an_association_are_fresh(secret: bytes | None) -> None:
    codec = Codec(secret=secret)
    i = associate(secret, HI, HR, we_initiated=True)
    r = associate(secret, HI, HR, we_initiated=False)
    beat = Heartbeat(peer_id="decode", seq=1)
    first, second = codec.encode(beat, i), codec.encode(beat, i)
    assert codec.decode(second, r) == beat and codec.decode(first, r) == beat  # reordered: ok
    replay = codec.decode(first, r)
    assert isinstance(replay, MalformedMessage) and replay.reason is DropReason.REPLAYED
    unauth = DropReason.UNAUTHENTICATED if secret else DropReason.MALFORMED
    reflected = codec.decode(codec.encode(beat, r), r)  # our own frame sent back to us
    assert isinstance(reflected, MalformedMessage) and reflected.reason is unauth
    elsewhere = associate(secret, hello("decode", b"k" * 16), HR, we_initiated=False)
    moved = codec.decode(codec.encode(beat, i), elsewhere)  # onto another connection
    assert isinstance(moved, MalformedMessage) and moved.reason is unauth
    plain = codec.decode(codec.encode(beat, i))  # a sequenced frame is no handshake frame
    assert isinstance(plain, MalformedMessage) and plain.reason is unauth
    hs = codec.decode(codec.encode(Probe(nonce=1)), r)  # nor the reverse
    assert isinstance(hs, MalformedMessage) and hs.reason is unauth


def test_a_handshake_frame_claiming_a_sequence_number_is_malformed() -> None:
    codec = Codec(secret=SECRET)
    frame = codec.seal(msgspec.msgpack.encode([codec.version, 5, Probe(nonce=1)]))
    got = codec.decode(frame)
    assert isinstance(got, MalformedMessage) and got.reason is DropReason.MALFORMED
