"""The host tier: one preallocated buffer of chunk slots in (pinned, where possible) CPU memory.

The buffer is allocated once, aligned to :data:`ALIGN` bytes, with every slot starting on an
``ALIGN`` boundary (``slot_stride = round_up(chunk_bytes, ALIGN)``), so slots double as the
staging buffers of every other path: device <-> host copies gather/scatter straight into them
(:mod:`kvplane.offload.copier`), and the disk tier does direct I/O from and into them without a
bounce copy. When ``chunk_bytes`` is a multiple of ``ALIGN`` consecutive slots are contiguous and
a run of them is one tensor (:meth:`HostTier.run`), which lets the copier move a run of chunks in
one operation.

Memory is pinned (page-locked, for asynchronous DMA to a GPU) when ``pin_memory`` is requested
and the platform has CUDA; otherwise it is plain pageable memory. Host memory does not survive
the process, so :meth:`HostTier.scan` finds nothing, and bytes in it are trusted (no checksum).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey, SlotId
from kvplane.offload.tiers.base import ReadOutcome, check_batch, check_slot

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
        for what, value in (("num_slots", num_slots), ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"HostTier.{what} must be a positive int: {value!r}")
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
