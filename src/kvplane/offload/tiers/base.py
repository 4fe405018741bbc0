"""The tier plug-in point: a store of fixed-size chunk payloads addressed by slot.

A tier moves bytes and never decides which chunk goes where; a bad read is
:attr:`ReadOutcome.CORRUPT`, never wrong bytes. See docs/offload.md.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey, SlotId
from kvplane.metrics import MetricsRegistry
from kvplane.offload.codecs.base import RAW_TAG
from kvplane.offload.codecs.coder import ChunkCoder
from kvplane.offload.slots import check_chunk_key
from kvplane.offload.tiers.header import ChunkHeader, check_fingerprint
from kvplane.validators import require_index, require_int, require_size


class ReadOutcome(enum.Enum):
    """Result of reading one chunk: its bytes are in the output buffer only when ``OK``."""

    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


class SyncPolicy(enum.Enum):
    """When a disk tier forces written bytes to stable storage.

    ``NONE`` relies on the page cache (survives process death, not power loss); ``DATA``
    fdatasyncs the payload before writing its header and the header after (publish after
    complete, across power loss too).
    """

    NONE = "none"
    DATA = "data"


@runtime_checkable
class Tier(Protocol):
    """A store of ``num_slots`` chunk payloads of ``chunk_bytes`` bytes each."""

    name: str
    num_slots: int
    chunk_bytes: int

    def write(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], payloads: Sequence[torch.Tensor]
    ) -> None:
        """Store ``payloads[i]`` as chunk ``keys[i]`` in ``slots[i]``; raise ``OffloadError``."""
        ...

    def read(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]
    ) -> list[ReadOutcome]:
        """Read chunk ``keys[i]`` from ``slots[i]`` into ``outs[i]``; per-chunk outcomes."""
        ...

    def scan(self) -> dict[ChunkKey, SlotId]:
        """Re-index: the valid chunks this tier already holds (after a restart)."""
        ...

    def close(self) -> None:
        """Release files, connections and threads; idempotent."""
        ...


def as_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor (shares its memory)."""
    return t.numpy().data


def encode_payload(coder: ChunkCoder | None, payload: torch.Tensor) -> tuple[bytes, memoryview]:
    """The codec tag and stored bytes of ``payload``: itself, raw, without a ``coder``."""
    if coder is None:
        return RAW_TAG, as_buffer(payload)
    enc = coder.encode(payload)
    return enc.tag, enc.data


def stored_fault(
    header: ChunkHeader, crc: int, data: memoryview, coder: ChunkCoder | None, out: torch.Tensor
) -> str | None:
    """``None`` when ``data`` (CRC ``crc``) is ``header``'s chunk, now in ``out`` (coded: decoded
    into it); else the corrupt-chunk reason, ``"checksum"`` or ``"codec"``."""
    if crc != header.checksum:
        return "checksum"
    if header.coded and (coder is None or not coder.decode(header.codec, data, out)):
        return "codec"
    return None


def check_stored_tier(
    tier: str, num_slots: object, chunk_bytes: int, fingerprint: object, coder: object
) -> tuple[ChunkCoder | None, bytes]:
    """``(coder, fingerprint)`` a stored-chunk tier runs with: :func:`check_coder`'s codec and
    the layout fingerprint with it folded in; ``InvalidArgumentError`` naming a bad field."""
    require_int(f"{tier}.num_slots", num_slots, min=1)
    require_size(f"{tier}.chunk_bytes", chunk_bytes, min=1)
    layout = check_fingerprint(f"{tier}.fingerprint", fingerprint)
    checked = check_coder(tier, coder, chunk_bytes)
    return checked, layout if checked is None else checked.fingerprint(layout)


def check_slot(tier: str, num_slots: int, slot: object) -> int:
    """``slot`` as an int in ``0..num_slots-1``, else ``InvalidArgumentError`` naming it."""
    return require_index(f"a slot of tier {tier!r}", slot, num_slots)


def check_batch(  # noqa: PLR0917 - one argument per thing that must line up
    tier: str,
    num_slots: int,
    chunk_bytes: int,
    slots: Sequence[SlotId],
    keys: Sequence[ChunkKey],
    buffers: Sequence[torch.Tensor],
) -> None:
    """Raise ``InvalidArgumentError`` unless ``slots``, ``keys`` and ``buffers`` line up: slots in
    range, valid keys, and 1-D contiguous uint8 CPU tensors of ``chunk_bytes`` bytes each."""
    if not len(slots) == len(keys) == len(buffers):
        raise InvalidArgumentError(
            f"tier {tier!r}: {len(slots)} slots, {len(keys)} keys and {len(buffers)} buffers"
        )
    for slot in slots:
        check_slot(tier, num_slots, slot)
    for key in keys:
        check_chunk_key(key)
    for t in buffers:
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != torch.uint8
            or t.dim() != 1
            or t.numel() != chunk_bytes
            or t.device.type != "cpu"
            or not t.is_contiguous()
        ):
            shown = (
                f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else t
            )
            raise InvalidArgumentError(
                f"tier {tier!r}: a chunk buffer must be a contiguous 1-D uint8 CPU tensor of "
                f"{chunk_bytes} bytes, got {shown}"
            )


def check_coder(tier: str, coder: object, chunk_bytes: int) -> ChunkCoder | None:
    """The codec a tier runs: ``None`` for none or ``raw`` (the tier's raw path), else
    ``coder``; ``InvalidArgumentError`` unless it is a :class:`ChunkCoder` of chunks of
    ``chunk_bytes`` bytes."""
    if coder is None:
        return None
    if not isinstance(coder, ChunkCoder) or coder.chunk_bytes != chunk_bytes:
        raise InvalidArgumentError(
            f"{tier}.coder must be a ChunkCoder of {chunk_bytes}-byte chunks, got {coder!r}"
        )
    return None if coder.is_raw else coder


class TierCounters:
    """The fault counters every tier keeps (no-ops without an injected registry).

    ``kvplane_offload_corrupt_chunks{tier, reason}``: a read or re-index found a chunk whose
    header or checksum was wrong (``reason`` one of header, key, layout, length, checksum,
    truncated, missing, codec: a payload that did not decode);
    ``kvplane_offload_tier_errors{tier}``: a whole operation failed (I/O error, server
    unreachable).
    """

    def __init__(self, metrics: MetricsRegistry | None, tier: str) -> None:
        self._tier = tier
        self._corrupt = None
        self._errors = None
        if metrics is not None:
            self._corrupt = metrics.counter(
                "offload_corrupt_chunks", "Stored chunks that failed validation", ("tier", "reason")
            )
            self._errors = metrics.counter(
                "offload_tier_errors", "Tier operations that failed as a whole", ("tier",)
            ).labels(tier=tier)

    def corrupt(self, reason: str) -> None:
        if self._corrupt is not None:
            self._corrupt.labels(tier=self._tier, reason=reason).inc()

    def error(self) -> None:
        if self._errors is not None:
            self._errors.inc()
