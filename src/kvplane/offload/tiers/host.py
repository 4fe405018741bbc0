"""The host tier: one preallocated, aligned buffer of chunk slots in (pinned, where possible)
CPU memory.

Slots double as staging buffers for the copier and the disk tier's direct I/O; a slot's bytes
are the one run its :class:`~kvplane.transfer.chunk_plans.SlotBuffer` names. Bytes are trusted;
nothing survives the process. See docs/offload.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvplane.ids import ChunkKey, SlotId
from kvplane.offload.tiers.base import ReadOutcome, check_batch
from kvplane.transfer.chunk_plans import SlotBuffer
from kvplane.validators import require_int, require_size

ALIGN = 4096
"""Slot alignment in bytes: a page, and the strictest direct-I/O alignment we meet."""


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


class HostTier:
    """``num_slots`` slots of ``chunk_bytes`` bytes in one aligned CPU buffer, addressed by
    :attr:`slots` (the :class:`~kvplane.transfer.chunk_plans.SlotBuffer` its chunk plans
    use too)."""

    def __init__(
        self,
        num_slots: int,
        chunk_bytes: int,
        *,
        pin_memory: bool = True,
        name: str = "host",
    ) -> None:
        require_int("HostTier.num_slots", num_slots, min=1)
        require_size("HostTier.chunk_bytes", chunk_bytes, min=1)
        self.name = name
        self.num_slots = num_slots
        self.chunk_bytes = chunk_bytes
        self.slots = SlotBuffer(num_slots, chunk_bytes, round_up(chunk_bytes))
        self.pinned = bool(pin_memory) and torch.cuda.is_available()
        total = self.slots.nbytes
        raw = torch.empty(total + ALIGN, dtype=torch.uint8, pin_memory=self.pinned)
        start = (-raw.data_ptr()) % ALIGN
        self.buffer = raw[start : start + total]
        """All slots, ``num_slots * slot_stride`` bytes, ``ALIGN``-aligned."""

    @property
    def slot_stride(self) -> int:
        """Bytes from one slot's start to the next's: ``chunk_bytes`` rounded up to ``ALIGN``."""
        return self.slots.slot_stride

    def slot(self, slot: SlotId) -> torch.Tensor:
        """The ``chunk_bytes`` uint8 view of one slot (aliases the tier's memory): the chunk's
        one run, :meth:`SlotBuffer.run`. ``InvalidArgumentError`` for a slot out of range."""
        start, length = self.slots.run(slot)
        return self.buffer[start : start + length]

    # -- Tier protocol -------------------------------------------------------------------------
    def write(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], payloads: Sequence[torch.Tensor]
    ) -> None:
        check_batch(self.name, self.num_slots, self.chunk_bytes, slots, keys, payloads)
        for slot, payload in zip(slots, payloads, strict=True):
            self.slot(slot).copy_(payload)

    def read(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]
    ) -> list[ReadOutcome]:
        check_batch(self.name, self.num_slots, self.chunk_bytes, slots, keys, outs)
        for slot, out in zip(slots, outs, strict=True):
            out.copy_(self.slot(slot))
        return [ReadOutcome.OK] * len(slots)

    def scan(self) -> dict[ChunkKey, SlotId]:
        return {}

    def close(self) -> None:
        return None
