"""The KV event publisher's "describe" exchange: who a source is and how it keys chunks.

A client sends ``[b"", DESCRIBE]`` (16 bytes, never an 8-byte replay start, so a publisher that
predates it drops it and a replay client never sends it) to the publisher's replay socket; the
answer is ``[b"", topic, DESCRIBE, payload]``: the publisher's topic (worker id, incarnation)
and a msgpack :class:`KeyScheme` map, or ``nil`` while the publisher does not know its scheme
yet (a vLLM connector learns its key root at its workers' handshake). Same CURVE door as
replays: a client without the cluster secret gets nothing. No sockets here but
:func:`ask_describe`'s one. See docs/serving.md ("KV events").
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import zmq

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.curve_auth import CurveKeys, secure_client
from kvplane.errors import InvalidArgumentError, MalformedMessageError, TransferTimeoutError
from kvplane.serving.kv_events import Origin, parse_topic
from kvplane.validators import require_finite_positive, require_int

DESCRIBE = b"kvplane.describe"
"""The describe request's frame, and the marker frame of its answer."""
MAX_KEY_ROOT = 4096
"""Longest key root told (a worker's: its model id and layout fingerprint, as ``WorkerInfo``)."""
MAX_ANSWER = 2 * MAX_KEY_ROOT
"""Largest describe answer a client takes."""


class KeyScheme(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A source's chunk keys: ``BlockHasher(hash_seed, key_root)`` over blocks of
    ``block_size`` tokens, ``blocks_per_chunk`` blocks per chunk (the fields of
    :class:`~kvplane.serving.router.route_policy.ChunkKeyScheme`; ``key_root`` is the
    model/layout fingerprint). Unknown fields of a newer publisher are ignored."""

    hash_seed: int
    key_root: bytes
    block_size: int
    blocks_per_chunk: int

    def __post_init__(self) -> None:
        require_int("KeyScheme.hash_seed", self.hash_seed, min=0)
        if not isinstance(self.key_root, bytes) or not 0 < len(self.key_root) <= MAX_KEY_ROOT:
            raise InvalidArgumentError(
                f"KeyScheme.key_root must be 1-{MAX_KEY_ROOT} bytes, got {self.key_root!r:.80}"
            )
        require_int("KeyScheme.block_size", self.block_size, min=1)
        require_int("KeyScheme.blocks_per_chunk", self.blocks_per_chunk, min=1)

    @classmethod
    def of(cls, hasher: BlockHasher, spec: ChunkSpec) -> KeyScheme:
        """The scheme of chunks keyed by ``hasher`` in ``spec``'s chunks (a worker's own)."""
        return cls(hasher.seed, hasher.fingerprint, spec.block_size, spec.blocks_per_chunk)

    def fields(self) -> dict[str, int | str]:
        """The four values by name, the key root in hex (as the proxy's flags take them)."""
        return {
            "key_root": self.key_root.hex(), "hash_seed": self.hash_seed,
            "block_size": self.block_size, "blocks_per_chunk": self.blocks_per_chunk,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Description:
    """A describe answer: the source's ``origin`` (worker id and incarnation, as its topic
    says) and its ``scheme`` (None: not known to the publisher yet; ask again later)."""

    origin: Origin
    scheme: KeyScheme | None


def answer_frames(topic: bytes, scheme: KeyScheme | None) -> tuple[bytes, bytes, bytes]:
    """The publisher's describe answer after the routing frames: ``[topic, DESCRIBE, payload]``."""
    return topic, DESCRIBE, msgspec.msgpack.encode(scheme)


def decode_answer(parts: list[bytes]) -> Description:
    """A describe answer's frames (after the empty delimiter) decoded;
    ``MalformedMessageError`` (one line) for anything else."""
    origin = parse_topic(parts[0]) if len(parts) == 3 and parts[1] == DESCRIBE else None
    if origin is None:
        raise MalformedMessageError(f"not a KV event describe answer: {len(parts)} frame(s)")
    try:
        scheme = msgspec.msgpack.decode(parts[2], type=KeyScheme | None)
    except (msgspec.DecodeError, InvalidArgumentError) as exc:
        raise MalformedMessageError(f"a bad KV event describe answer: {exc}") from None
    return Description(origin, scheme)


def ask_describe(
    ctx: zmq.Context[zmq.Socket[bytes]],
    replay_address: str,
    keys: CurveKeys | None,
    timeout_s: float = 2.0,
) -> Description:
    """Ask the publisher whose replays are at ``replay_address`` to describe itself, over a
    DEALER of ``ctx`` of its own (CURVE client of ``keys``; None: plain), closed on return.
    ``TransferTimeoutError`` when no answer comes within ``timeout_s`` (down, another secret,
    or a publisher that predates describe); ``MalformedMessageError`` for a bad answer."""
    timeout_s = require_finite_positive("timeout_s", timeout_s)
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER)
        if keys is not None:
            secure_client(sock, keys)
        sock.connect(replay_address)
        sock.send_multipart([b"", DESCRIBE])
        if not sock.poll(int(timeout_s * 1000)):
            raise TransferTimeoutError(
                f"KV event source {replay_address} did not describe itself within {timeout_s} s "
                "(down, another secret, or a publisher without describe)"
            )
        parts = sock.recv_multipart()
    finally:
        sock.close(linger=0)
    if not parts or parts[0]:
        raise MalformedMessageError(f"a describe answer from {replay_address} without delimiter")
    return decode_answer(parts[1:])
