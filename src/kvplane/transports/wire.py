"""What transports put on the wire: typed metadata, handshake bodies and the binary frame header.

No pickle; :func:`parse_header` refuses a bad header before any body byte is read. See
docs/transports.md.
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import numpy as np

from kvplane.errors import IncompatiblePeerError, MalformedMessageError
from kvplane.transports.base import DescriptorList

WIRE_VERSION = 4
"""Version of metadata, handshake and frame formats; peers must match exactly (2: the mutual
handshake with both nonces, and PING; 3: the target names itself in WELCOME, not CHALLENGE;
4: the initiator names itself and the agent it means in AUTH, not HELLO)."""
MAGIC = b"KVPT"
MAX_CONTROL_BYTES = 1 << 20
"""Largest metadata blob, handshake body or control frame body."""
MAX_NOTIFY_BYTES = 64 << 10
"""Largest ``notify`` payload a batch may carry."""
MAX_FRAME_DESCRIPTORS = 1 << 16
MAX_FRAME_PAYLOAD = 1 << 30

S = TypeVar("S", bound=msgspec.Struct)

HEADER = struct.Struct("<4sBBHIQQ")
"""magic, version, frame type, flags, descriptor count, transfer id, body length."""


class FrameType(enum.IntEnum):
    HELLO = 1  # initiator -> target: Hello
    CHALLENGE = 2  # target -> initiator: Challenge (its nonce and proof, not its name)
    AUTH = 3  # initiator -> target: Auth (its name, whom it means, its proof)
    WELCOME = 4  # target -> initiator: Welcome (its name, regions; shm: segment fds ride along)
    REJECT = 5  # unused since version 2: a refused handshake is closed unanswered
    DATA = 6  # bytes for a write (to target) or a read response (to initiator)
    COMMIT = 7  # initiator -> target: every byte of the batch was sent/copied; body = notify
    ABORT = 8  # initiator -> target: forget the batch (release its pins)
    ACK = 9  # target -> initiator: batch outcome; FLAG_ERROR + utf-8 reason on failure
    READ_REQ = 10  # initiator -> target: descriptor table of target bytes to send back
    PIN = 11  # shm initiator -> target: pin these region ids (int64 body) for the batch
    PINNED = 12  # shm target -> initiator: pin outcome (FLAG_ERROR + reason on failure)
    PING = 13  # initiator -> target: keep-alive of an idle connection, empty body


FLAG_ERROR = 1
"""ACK/PINNED: the operation failed; the body is a utf-8 reason."""
FLAG_NOTIFY = 2
"""COMMIT: the body is a notify payload (possibly empty) to deliver."""


@dataclass(frozen=True, slots=True)
class Header:
    ftype: FrameType
    flags: int
    count: int
    xfer_id: int
    length: int


class RegionInfo(msgspec.Struct, array_like=True, frozen=True):
    """One exposed region: id and length; ``base`` (engine address) or shm ``segment`` location."""

    region_id: int
    length: int
    base: int = 0
    segment: int = 0
    segment_offset: int = 0


class Metadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``Transport.metadata()`` returns, encoded; ``engine`` holds third-party metadata."""

    version: int
    transport: str
    agent: str
    address: str = ""
    host: str = ""
    regions: list[RegionInfo] = []
    engine: bytes = b""


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Initiator's opening: what for (wire version, transport) and a nonce; nothing about who
    it is or whom it means, which the target has not yet earned."""

    version: int
    transport: str
    nonce: bytes


class Challenge(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Target's answer: its nonce and its proof over both (empty without a secret); nothing
    about who it is, which the initiator has not yet earned."""

    nonce: bytes
    mac: bytes


class Auth(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Initiator's answer, sent only to a target that proved the secret: who it is, who it
    means to reach ("": anyone), and its proof over both nonces and both names (empty
    without a secret)."""

    agent: str
    target: str
    mac: bytes


class SegmentInfo(msgspec.Struct, array_like=True, frozen=True):
    segment: int
    length: int


class Welcome(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The target's live region table (and, for shm, the segments whose fds ride along)."""

    regions: list[RegionInfo]
    segments: list[SegmentInfo] = []
    idle_ms: int = 0
    """The target drops a connection idle this long (0: never); the initiator pings before."""
    agent: str = ""
    """The target's agent, told only after the initiator's proof (the handshake fills it in)."""


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msg)


def decode(data: bytes, kind: type[S]) -> S:
    """Decode and validate ``data`` as ``kind``; ``MalformedMessageError`` names what is wrong."""
    if len(data) > MAX_CONTROL_BYTES:
        raise MalformedMessageError(
            f"{kind.__name__} of {len(data)} bytes exceeds the {MAX_CONTROL_BYTES}-byte limit"
        )
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except msgspec.DecodeError as exc:
        raise MalformedMessageError(f"malformed {kind.__name__}: {exc}") from None


def decode_metadata(data: bytes, transport: str) -> Metadata:
    """Decode peer metadata and check that it is ours (same transport kind and wire version)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedMessageError(f"peer metadata must be bytes, got {type(data).__name__}")
    meta = decode(bytes(data), Metadata)
    if meta.version != WIRE_VERSION:
        raise IncompatiblePeerError(
            f"peer {meta.agent!r} speaks wire version {meta.version}, we speak {WIRE_VERSION}"
        )
    if meta.transport != transport:
        raise IncompatiblePeerError(
            f"peer {meta.agent!r} metadata is for transport {meta.transport!r}, not {transport!r}"
        )
    if not meta.agent:
        raise MalformedMessageError("peer metadata has an empty agent name")
    return meta


def pack_header(
    ftype: FrameType, xfer_id: int, length: int, count: int = 0, flags: int = 0
) -> bytes:
    return HEADER.pack(MAGIC, WIRE_VERSION, int(ftype), flags, count, xfer_id, length)


def parse_header(raw: bytes | bytearray | memoryview) -> Header:
    """Validate a received header; ``MalformedMessageError`` before any body byte is read."""
    magic, version, ftype, flags, count, xfer_id, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise MalformedMessageError(f"bad frame magic {magic!r}")
    if version != WIRE_VERSION:
        raise MalformedMessageError(f"frame version {version}, expected {WIRE_VERSION}")
    try:
        kind = FrameType(ftype)
    except ValueError:
        raise MalformedMessageError(f"unknown frame type {ftype}") from None
    if count > MAX_FRAME_DESCRIPTORS:
        raise MalformedMessageError(
            f"frame names {count} descriptors (max {MAX_FRAME_DESCRIPTORS})"
        )
    if kind in (FrameType.DATA, FrameType.READ_REQ):
        limit = MAX_FRAME_PAYLOAD if kind is FrameType.DATA else 0
        if length > limit:
            raise MalformedMessageError(f"{kind.name} frame payload {length} exceeds {limit}")
    elif length > MAX_CONTROL_BYTES:
        raise MalformedMessageError(f"{kind.name} frame body {length} exceeds {MAX_CONTROL_BYTES}")
    return Header(kind, flags, count, xfer_id, length)


def pack_table(descs: DescriptorList) -> bytes:
    """The wire form of a descriptor table: regions, offsets, lengths as little-endian int64."""
    return b"".join(np.ascontiguousarray(c, dtype="<i8").tobytes() for c in
                    (descs.regions, descs.offsets, descs.lengths))  # fmt: skip


def parse_table(raw: bytes | bytearray, count: int) -> DescriptorList:
    """Decode ``count`` descriptors; ``MalformedMessageError`` for negative or empty ranges."""
    if len(raw) != 24 * count:
        raise MalformedMessageError(f"descriptor table of {len(raw)} bytes for {count} entries")
    cols = np.frombuffer(raw, dtype="<i8").reshape(3, count).astype(np.int64)
    try:
        return DescriptorList(cols[0], cols[1], cols[2])
    except ValueError as exc:
        raise MalformedMessageError(f"bad descriptor table: {exc}") from None


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``ConnectionResetError`` if the peer closes first. Each call
    asks for all that is left (``MSG_WAITALL``: one system call per fill however the bytes
    trickle in, not one per arrival); a receive timeout still ends a call that got nothing."""
    while len(view):
        got = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        if got == 0:
            raise ConnectionResetError("peer closed the connection")
        view = view[got:]


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def read_header(sock: socket.socket) -> Header:
    return parse_header(recv_bytes(sock, HEADER.size))
