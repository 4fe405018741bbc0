"""The host tier: one preallocated, aligned buffer of chunk slots in (pinned, where possible)
CPU memory.

Slots double as staging buffers for the copier and the disk tier's direct I/O. Bytes are
trusted; nothing survives the process. See docs/offload.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey, SlotId
from kvplane.offload.tiers.base import ReadOutcome, check_batch, check_slot
from kvplane.validators import require_int, require_size

ALIGN = 4096
"""Slot alignment in bytes: a page, and the strictest direct-I/O alignment we meet."""


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


class HostTier:
    """``num_slots`` slots of ``chunk_bytes`` bytes in one aligned CPU buffer."""

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
        self.slot_stride = round_up(chunk_bytes)
        self.pinned = bool(pin_memory) and torch.cuda.is_available()
        total = num_slots * self.slot_stride
        raw = torch.empty(total + ALIGN, dtype=torch.uint8, pin_memory=self.pinned)
        start = (-raw.data_ptr()) % ALIGN
        self.buffer = raw[start : start + total]
        """All slots, ``num_slots * slot_stride`` bytes, ``ALIGN``-aligned."""

    @property
    def contiguous_slots(self) -> bool:
        """True when slot ``i + 1`` starts right where slot ``i``'s chunk ends."""
        return self.slot_stride == self.chunk_bytes

    def _slot(self, slot: object) -> int:
        return check_slot(self.name, self.num_slots, slot) * self.slot_stride

    def slot(self, slot: SlotId) -> torch.Tensor:
        """The ``chunk_bytes`` uint8 view of one slot (aliases the tier's memory)."""
        start = self._slot(slot)
        return self.buffer[start : start + self.chunk_bytes]

    def run(self, first: SlotId, count: int) -> torch.Tensor:
        """``count`` consecutive slots from ``first`` as one uint8 view of ``count *
        chunk_bytes`` bytes; needs :attr:`contiguous_slots`."""
        if not self.contiguous_slots:
            raise InvalidArgumentError(
                f"tier {self.name!r}: slots of {self.chunk_bytes} bytes are padded to "
                f"{self.slot_stride}; a run of them is not one tensor"
            )
        start = self._slot(first)
        if count <= 0 or first + count > self.num_slots:
            raise InvalidArgumentError(
                f"tier {self.name!r}: run of {count} slots from {first} leaves the tier"
            )
        return self.buffer[start : start + count * self.chunk_bytes]

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
