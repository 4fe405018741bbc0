"""Wire frames: a versioned msgspec envelope around the tagged union of wire events.

A CRC-32 or HMAC tag, no pickle. :meth:`Codec.decode` never raises: a bad frame is a
:class:`MalformedMessage` naming its :class:`DropReason`. See docs/pd.md.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import zlib
from dataclasses import dataclass

import msgspec

from kvplane.errors import InvalidArgumentError
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


@dataclass(frozen=True, slots=True)
class MalformedMessage:
    """A frame that could not be turned into a wire event, and why (never raised)."""

    reason: DropReason
    detail: str
    size: int


class _Envelope(msgspec.Struct, array_like=True):
    version: int
    event: AnyWireEvent


class _RawEnvelope(msgspec.Struct, array_like=True):
    version: int
    event: msgspec.Raw


class Codec:
    """Encode/decode frames; ``secret`` (>= 16 bytes) turns on HMAC authentication."""

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
        self._envelope = msgspec.msgpack.Decoder(_RawEnvelope)
        self._event = msgspec.msgpack.Decoder(AnyWireEvent)

    def _tag(self, body: bytes) -> bytes:
        if self.secret is not None:
            return hmac.new(self.secret, body, hashlib.sha256).digest()[:MAC_BYTES]
        return zlib.crc32(body).to_bytes(CRC_BYTES, "little")

    def encode(self, event: AnyWireEvent) -> bytes:
        """The frame for ``event``; ``InvalidArgumentError`` if it would exceed ``max_frame``."""
        body = self._encoder.encode(_Envelope(self.version, event))
        if self.secret is None:
            frame = body + zlib.crc32(body).to_bytes(CRC_BYTES, "little")
        else:
            frame = body + self._tag(body)
        if len(frame) > self.max_frame:
            raise InvalidArgumentError(
                f"{type(event).__name__} frame is {len(frame)} bytes, "
                f"over max_frame={self.max_frame}"
            )
        return frame

    def seal(self, body: bytes) -> bytes:
        """Append a valid tag to arbitrary ``body`` bytes (for tests and fuzzers)."""
        return body + self._tag(body)

    def decode(self, frame: bytes) -> AnyWireEvent | MalformedMessage:
        """The event in ``frame`` or a :class:`MalformedMessage`; never raises."""
        size = len(frame)
        if size > self.max_frame:
            return MalformedMessage(DropReason.OVERSIZED, f"{size} > {self.max_frame}", size)
        if size <= self.tag_bytes:
            return MalformedMessage(DropReason.MALFORMED, "shorter than its tag", size)
        cut = size - self.tag_bytes
        body = frame[:cut]
        if self.secret is not None:
            ok = hmac.compare_digest(frame[cut:], self._tag(body))
        else:
            ok = int.from_bytes(frame[cut:], "little") == zlib.crc32(body)
        if not ok:
            reason = DropReason.UNAUTHENTICATED if self.secret is not None else DropReason.MALFORMED
            return MalformedMessage(reason, "tag mismatch", size)
        try:  # the common case: this version, one decode
            env: _Envelope = self._current.decode(body)
            if env.version == self.version:
                return env.event
        except Exception:  # a trust boundary: classify below
            pass
        try:
            raw = self._envelope.decode(body)
        except Exception as exc:
            return MalformedMessage(DropReason.MALFORMED, f"envelope: {exc}", size)
        if raw.version != self.version:
            return MalformedMessage(DropReason.UNKNOWN_VERSION, f"version {raw.version}", size)
        try:
            event: AnyWireEvent = self._event.decode(raw.event)
            return event  # pragma: no cover - the fast path decoded this frame already
        except Exception as exc:  # validation errors from the structs' __post_init__ included
            return MalformedMessage(DropReason.MALFORMED, f"event: {exc}", size)
