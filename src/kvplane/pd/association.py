"""Associations: the per-connection keys and sequence numbers that make PD frames fresh.

A handshake (``Hello`` with the initiator's nonce, ``HelloReply`` with the responder's, then
``HelloConfirm``) binds the initiator's ``Hello`` and both nonces into one transcript;
:func:`associate` derives one key per direction from it and the shared secret. An
:class:`Association` numbers the frames it seals and accepts each number once
(:class:`ReplayWindow`). No I/O and no clock: the caller draws the nonces. See docs/pd.md
("Freshness").
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

import msgspec

from kvplane.errors import InvalidArgumentError
from kvplane.pd.events import Hello

__all__ = ["NONCE_BYTES", "REPLAY_WINDOW", "Association", "ReplayWindow", "associate", "transcript"]

NONCE_BYTES = 16
"""Length of a handshake nonce (drawn by the caller, e.g. ``secrets.token_bytes``)."""
REPLAY_WINDOW = 1024
"""How far behind the highest sequence number a late (reordered) frame is still accepted."""
_KDF_LABEL = b"kvplane-pd-association\0"


class ReplayWindow:
    """Accepts each sequence number (>= 1) at most once, and none ``size`` or more below the
    highest accepted (the sliding window of RFC 4303, section 3.4.3). Mutated by ``accept``."""

    __slots__ = ("_bits", "_mask", "size", "top")

    def __init__(self, size: int = REPLAY_WINDOW) -> None:
        self.size = size
        self.top = 0
        self._bits = 0  # bit i set: top - i was accepted
        self._mask = (1 << size) - 1

    def accept(self, seq: int) -> bool:
        """True the first time ``seq`` is seen inside the window (it is then recorded)."""
        if seq > self.top:
            shift = seq - self.top
            self._bits = ((self._bits << shift) | 1) & self._mask if shift < self.size else 1
            self.top = seq
            return True
        off = self.top - seq
        if seq < 1 or off >= self.size or (self._bits >> off) & 1:
            return False
        self._bits |= 1 << off
        return True


@dataclass(slots=True)
class Association:
    """One established connection's direction keys, send counter and replay window.

    ``send_key``/``recv_key``: HMAC keys with a secret, else 4-byte CRC seeds (the codec reads
    them). ``binding``: the transcript digest both sides share.
    """

    binding: bytes
    send_key: bytes
    recv_key: bytes
    sent: int = 0
    window: ReplayWindow = field(default_factory=ReplayWindow)

    def next_seq(self) -> int:
        """The sequence number of the next frame sealed on this association (1, 2, ...)."""
        self.sent += 1
        return self.sent


def transcript(initiator: Hello, responder_nonce: bytes) -> bytes:
    """32-byte digest of the initiator's ``Hello`` (its nonce included) and the responder's
    nonce; ``InvalidArgumentError`` when a nonce is not :data:`NONCE_BYTES` long (an
    association needs both sides' fresh nonces). The responder's ``Hello`` is not in it: it
    travels later, sealed on the association this transcript keys."""
    for who, nonce in (("initiator", initiator.nonce), ("responder", responder_nonce)):
        if len(nonce) != NONCE_BYTES:
            raise InvalidArgumentError(f"{who} nonce is {len(nonce)} bytes, need {NONCE_BYTES}")
    body = msgspec.msgpack.encode([initiator, responder_nonce])
    return hashlib.blake2b(b"kvplane-pd-transcript-3\0" + body, digest_size=32).digest()


def _direction_key(secret: bytes | None, binding: bytes, direction: bytes) -> bytes:
    if secret is None:  # no secret: a CRC seed that still ties frames to this association
        return hashlib.blake2b(direction + binding, digest_size=4).digest()
    return hmac.new(secret, _KDF_LABEL + direction + binding, hashlib.sha256).digest()


def associate(
    secret: bytes | None, initiator: Hello, responder_nonce: bytes, *, we_initiated: bool
) -> Association:
    """The association of one handshake, from our side (pure; see :func:`transcript`)."""
    binding = transcript(initiator, responder_nonce)
    i2r = _direction_key(secret, binding, b"i>r")
    r2i = _direction_key(secret, binding, b"r>i")
    send, recv = (i2r, r2i) if we_initiated else (r2i, i2r)
    return Association(binding=binding, send_key=send, recv_key=recv)
