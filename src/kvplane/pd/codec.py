"""Wire frames: a versioned, sequenced msgspec envelope around the tagged union of wire events.

A CRC-32 or HMAC tag, no pickle. Handshake frames (sequence 0) are tagged with the shared secret;
every later frame with its :class:`~kvplane.pd.association.Association`'s key, numbered and
accepted once. :meth:`Codec.decode` never raises: a bad frame is a :class:`MalformedMessage`
naming its :class:`DropReason`. See docs/pd.md.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import zlib
from dataclasses import dataclass

import msgspec

from kvplane.errors import InvalidArgumentError
from kvplane.pd.association import Association
from kvplane.pd.events import AnyWireEvent
from kvplane.pd.handshake import PROTOCOL_VERSION
from kvplane.validators import require_size

DEFAULT_MAX_FRAME = 1 << 20
MAC_BYTES = 16
CRC_BYTES = 4


class DropReason(enum.Enum):
    """Why a frame was dropped (also the suffix of the endpoint's ``dropped_*`` counters)."""

    OVERSIZED = "oversized"
    UNAUTHENTICATED = "unauthenticated"
    MALFORMED = "malformed"
    UNKNOWN_VERSION = "unknown_version"
    REPLAYED = "replayed"
    """Authentic, but its sequence number was seen already or is too old (a replay)."""


@dataclass(frozen=True, slots=True)
class MalformedMessage:
    """A frame that could not be turned into a wire event, and why (never raised)."""

    reason: DropReason
    detail: str
    size: int


class _Envelope(msgspec.Struct, array_like=True):
    version: int
    seq: int
    event: AnyWireEvent


class Codec:
    """Encode/decode frames; ``secret`` (>= 16 bytes) turns on HMAC authentication.

    ``assoc`` (encode and decode): the connection's association, or None for a handshake frame
    (sequence 0, tagged with the secret itself). Decoding on an association advances its
    replay window; encoding, its send counter.
    """

    def __init__(
        self,
        *,
        secret: bytes | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        version: int = PROTOCOL_VERSION,
    ) -> None:
        if secret is not None and len(secret) < 16:
            raise InvalidArgumentError(
                f"shared secret must be at least 16 bytes, got {len(secret)}"
            )
        require_size("max_frame", max_frame, min=64)
        self.secret = secret
        self.max_frame = max_frame
        self.version = version
        self.tag_bytes = MAC_BYTES if secret is not None else CRC_BYTES
        self._encoder = msgspec.msgpack.Encoder()
        self._current = msgspec.msgpack.Decoder(_Envelope)
        self._parts = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._int = msgspec.msgpack.Decoder(int)

    def _tag(self, body: bytes, key: bytes | None) -> bytes:
        """``key``: an association's direction key, None for the handshake (the secret)."""
        if self.secret is not None:
            mac = hmac.new(self.secret if key is None else key, body, hashlib.sha256)
            return mac.digest()[:MAC_BYTES]
        seed = 0 if key is None else int.from_bytes(key, "little")
        return zlib.crc32(body, seed).to_bytes(CRC_BYTES, "little")

    def encode(self, event: AnyWireEvent, assoc: Association | None = None) -> bytes:
        """The frame for ``event``; ``InvalidArgumentError`` if it would exceed ``max_frame``."""
        seq, key = (0, None) if assoc is None else (assoc.next_seq(), assoc.send_key)
        body = self._encoder.encode(_Envelope(self.version, seq, event))
        frame = body + self._tag(body, key)
        if len(frame) > self.max_frame:
            raise InvalidArgumentError(
                f"{type(event).__name__} frame is {len(frame)} bytes, "
                f"over max_frame={self.max_frame}"
            )
        return frame

    def seal(self, body: bytes) -> bytes:
        """Append a valid handshake tag to arbitrary ``body`` bytes (for tests and fuzzers)."""
        return body + self._tag(body, None)

    def decode(
        self, frame: bytes, assoc: Association | None = None
    ) -> AnyWireEvent | MalformedMessage:
        """The event in ``frame`` or a :class:`MalformedMessage`; never raises."""
        size = len(frame)
        if size > self.max_frame:
            return MalformedMessage(DropReason.OVERSIZED, f"{size} > {self.max_frame}", size)
        if size <= self.tag_bytes:
            return MalformedMessage(DropReason.MALFORMED, "shorter than its tag", size)
        cut = size - self.tag_bytes
        body = frame[:cut]
        key = None if assoc is None else assoc.recv_key
        if not hmac.compare_digest(frame[cut:], self._tag(body, key)):
            reason = DropReason.UNAUTHENTICATED if self.secret is not None else DropReason.MALFORMED
            return MalformedMessage(reason, "tag mismatch", size)
        try:  # the common case: this version, one decode
            env: _Envelope = self._current.decode(body)
        except Exception as exc:  # a trust boundary: classify the failure
            return self._classify(body, size, exc)
        if env.version != self.version:
            return MalformedMessage(DropReason.UNKNOWN_VERSION, f"version {env.version}", size)
        if assoc is None:
            if env.seq != 0:
                return MalformedMessage(DropReason.MALFORMED, "sequenced, no association", size)
        elif not assoc.window.accept(env.seq):
            return MalformedMessage(DropReason.REPLAYED, f"sequence {env.seq}", size)
        return env.event

    def _classify(self, body: bytes, size: int, exc: Exception) -> MalformedMessage:
        """Why an authentic body failed to decode: another version, or malformed."""
        try:
            version = self._int.decode(self._parts.decode(body)[0])
        except Exception:
            return MalformedMessage(DropReason.MALFORMED, f"envelope: {exc}", size)
        if version != self.version:
            return MalformedMessage(DropReason.UNKNOWN_VERSION, f"version {version}", size)
        return MalformedMessage(DropReason.MALFORMED, f"event: {exc}", size)
