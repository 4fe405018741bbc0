"""The order sockets' frames: one msgpack ``Envelope`` each, encoded and leniently decoded.

Owns what a frame is and how an unacceptable one is classified (dropped, or refused with an
answer to its call id). No sockets, no counters: ``rpc`` counts what this returns.
See docs/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvplane.serving.messages import RUNTIME_VERSION, AnyMessage, Envelope

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)
MAX_CALL_ID = 1 << 62


class _Head(msgspec.Struct, frozen=True, array_like=True):
    """The envelope's leading fields, read leniently when the whole envelope does not decode."""

    version: int
    call_id: int


_head_decoder = msgspec.msgpack.Decoder(_Head)


@dataclass(frozen=True, slots=True)
class Refused:
    """A frame whose call id is readable but whose version or message is not acceptable
    (``kind``: ``malformed`` or ``version``); its caller is answered with ``reason``."""

    call_id: int
    reason: str
    kind: str


@dataclass(frozen=True, slots=True)
class Dropped:
    """A frame not answered: ``kind`` is ``oversized``, ``malformed`` or ``version``."""

    kind: str


def encode(call_id: int, body: AnyMessage) -> bytes:
    return _encoder.encode(Envelope(version=RUNTIME_VERSION, call_id=call_id, body=body))


def decode(payload: bytes, max_frame: int) -> Envelope | Refused | Dropped:
    """The envelope of ``payload``; :class:`Refused` when only its head ``[version, call_id]``
    is readable (a call id in ``[0, MAX_CALL_ID]``); :class:`Dropped` otherwise. Pure."""
    if len(payload) > max_frame:
        return Dropped("oversized")
    try:
        env = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        return _refused(payload, f"invalid message: {exc}", "malformed")
    if env.version != RUNTIME_VERSION:
        why = f"runtime version {env.version} is not {RUNTIME_VERSION}"
        return _refused(payload, why, "version")
    return env


def _refused(payload: bytes, reason: str, kind: str) -> Refused | Dropped:
    try:
        head = _head_decoder.decode(payload)
    except msgspec.DecodeError:
        return Dropped(kind)
    if head.version != RUNTIME_VERSION:
        kind, reason = "version", f"runtime version {head.version} is not {RUNTIME_VERSION}"
    if not 0 <= head.call_id <= MAX_CALL_ID:
        return Dropped(kind)
    return Refused(head.call_id, reason[:4000], kind)
