"""KV events on the wire: what a publisher's frames and a replay exchange are.

The shape of vLLM's KV events (``vllm/distributed/kv_events.py``) so tools built for them read
ours: a ``KVEventBatch`` ``[ts, events, data_parallel_rank]`` of tagged ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` maps in msgpack, published as ``[topic, seq, payload]``
(``seq``: 8 bytes big-endian, per publisher); a replay request is the 8-byte start seq, answered
with ``[topic, seq, payload]`` frames and ``[b"", END_SEQ, b""]``. Ours name chunks (a chunk key
in ``block_hashes``), carry the tier in ``medium`` and the publisher's worker id and incarnation
in the topic. Owns the format and its lenient decoding; no sockets. See docs/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

from kvplane.errors import InvalidArgumentError
from kvplane.validators import require_id, require_int

__all__ = [
    "END_SEQ", "MAX_EVENTS", "TOPIC_PREFIX", "AllCleared", "ChunksRemoved", "ChunksStored",
    "EventBatch", "Frame", "KVEvent", "Origin", "decode_batch", "decode_end", "decode_frame",
    "encode_batch", "parse_seq", "parse_topic", "replay_request", "topic",
]  # fmt: skip

MAX_EVENTS = 1 << 20
"""Most events, and most chunk keys in one event, a batch may carry (a snapshot is one batch)."""
TOPIC_PREFIX = b"kv/"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame that ends a replay answer (vLLM's ``ZmqEventPublisher.END_SEQ``)."""
_Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]
_Keys = Annotated[tuple[_Key, ...], msgspec.Meta(max_length=MAX_EVENTS)]
_Medium = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class KVEvent(msgspec.Struct, frozen=True, omit_defaults=True, tag=True):
    """Base of the events (a msgpack map tagged ``type``, as vLLM's ``KVCacheEvent``)."""


class ChunksStored(KVEvent, frozen=True, omit_defaults=False, tag="BlockStored"):
    """Chunks ``block_hashes`` (chunk keys) became readable in tier ``medium``. vLLM's fields
    we do not know at the tier hook stay empty but present (vLLM requires them): no parent hash
    (each key commits to its whole prefix already), no token ids, no LoRA; ``block_size`` is
    tokens per chunk (0: unsaid)."""

    block_hashes: _Keys
    medium: _Medium
    parent_block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    lora_id: int | None = None
    lora_name: str | None = None


class ChunksRemoved(KVEvent, frozen=True, tag="BlockRemoved"):
    """Chunks ``block_hashes`` left tier ``medium``."""

    block_hashes: _Keys
    medium: _Medium


class AllCleared(KVEvent, frozen=True, tag="AllBlocksCleared"):
    """The publisher holds nothing in any tier; a batch starting with it stands alone."""


AnyEvent = ChunksStored | ChunksRemoved | AllCleared


class EventBatch(msgspec.Struct, frozen=True, array_like=True):
    """One published batch, vLLM's ``KVEventBatch`` ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: Annotated[tuple[AnyEvent, ...], msgspec.Meta(max_length=MAX_EVENTS)]
    data_parallel_rank: int | None = None

    @property
    def resets(self) -> bool:
        """Whether the batch starts with :class:`AllCleared`: the state after it does not
        depend on any earlier batch (a publisher's first batch, a snapshot)."""
        return bool(self.events) and isinstance(self.events[0], AllCleared)


@dataclass(frozen=True, slots=True)
class Origin:
    """Who published a frame: the worker id and its incarnation (a restart's is larger)."""

    worker: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded ``[topic, seq, payload]`` frame."""

    origin: Origin
    seq: int
    batch: EventBatch


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def topic(worker: str, incarnation: int) -> bytes:
    """The topic frame of ``worker``'s ``incarnation``: ``kv/<worker>/<incarnation>``."""
    require_id("KV event worker", worker)
    require_int("KV event incarnation", incarnation, min=0)
    return TOPIC_PREFIX + f"{worker}/{incarnation}".encode()


def parse_topic(raw: bytes) -> Origin | None:
    """The origin a topic frame names; None for anything else."""
    if not raw.startswith(TOPIC_PREFIX) or len(raw) > 512:
        return None
    try:
        worker, _, inc = raw[len(TOPIC_PREFIX) :].decode().rpartition("/")
    except UnicodeDecodeError:
        return None
    if not worker or not inc.isascii() or not inc.isdigit() or len(inc) > 20:
        return None
    return Origin(worker, int(inc))


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch | None:
    """The batch of ``payload``; None when it is not one (unknown fields are ignored, so a
    vLLM publisher's newer fields decode)."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError:
        return None


def parse_seq(raw: bytes) -> int | None:
    """An 8-byte big-endian seq (unsigned); None for another length."""
    return int.from_bytes(raw, "big") if len(raw) == 8 else None


def decode_frame(parts: list[bytes]) -> Frame | None:
    """A ``[topic, seq, payload]`` frame decoded; None when any part is not what it should be
    (the caller counts it dropped)."""
    if len(parts) != 3:
        return None
    origin, seq, batch = parse_topic(parts[0]), parse_seq(parts[1]), decode_batch(parts[2])
    if origin is None or seq is None or batch is None:
        return None
    return Frame(origin, seq, batch)


def decode_end(parts: list[bytes]) -> tuple[Origin, int] | None:
    """``(origin, the publisher's next seq)`` of a replay answer's end frame
    ``[topic, END_SEQ, next_seq]``; None for anything else (vLLM's bare end included)."""
    if len(parts) != 3 or parts[1] != END_SEQ:
        return None
    origin, end = parse_topic(parts[0]), parse_seq(parts[2])
    return None if origin is None or end is None else (origin, end)


def replay_request(start: int) -> bytes:
    """The replay request for every batch from seq ``start`` on."""
    if not isinstance(start, int) or not 0 <= start < 1 << 63:
        raise InvalidArgumentError(f"a replay starts at a seq in [0, 2**63), got {start!r}")
    return start.to_bytes(8, "big")
