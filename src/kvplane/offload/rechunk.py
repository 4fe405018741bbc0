"""Re-chunking bytes between the host tier and a lower tier of larger chunks.

A tier chunk of span ``r`` (:mod:`~kvplane.offload.spans`) is the bytes of its ``r`` host chunks
end to end. :func:`demoter` builds the job work that writes whole groups of host slots as tier
chunks, :func:`promoter` the work that reads tier chunks and copies each wanted piece into its
host slot. Both use one view of the host buffer where a group's host slots follow on (no copy),
else a :class:`Staging` buffer of their job path (one worker thread per path, so no two jobs
share it). At span 1 every chunk is its own host slot, as without re-chunking. Decides
nothing: chunks and slots come from the tier book's reservations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvplane.ids import ChunkKey, SlotId
from kvplane.offload.book_types import Promotion, TierWrite
from kvplane.offload.jobs import Work
from kvplane.offload.tiers.base import ReadOutcome, Tier
from kvplane.offload.tiers.host import ALIGN, HostTier

STAGE_BYTES = 16 << 20
"""A staging buffer holds this many bytes of tier chunks (at least one chunk) per tier call."""


class Staging:
    """A grow-only, ``ALIGN``-aligned byte buffer for the tier chunks of one job path."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        """At least ``nbytes`` bytes, aligned; reused by the next call (same thread only)."""
        if self._buf.numel() < nbytes:
            raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
            start = (-raw.data_ptr()) % ALIGN
            self._buf = raw[start : start + nbytes]
        return self._buf[:nbytes]


def host_run(host: HostTier, slots: Sequence[SlotId]) -> torch.Tensor | None:
    """One view of host ``slots`` when they follow on in the buffer (consecutive ids, no
    padding between slots), else ``None``."""
    if len(slots) == 1:
        return host.slot(slots[0])
    first = int(slots[0])
    if host.slots.padded or any(int(s) != first + i for i, s in enumerate(slots)):
        return None
    cb = host.chunk_bytes
    return host.buffer[first * cb : (first + len(slots)) * cb]


@dataclass(frozen=True, slots=True)
class TierRead:
    """Read tier chunk ``key`` from ``tier_slot``; piece ``parts[i]`` goes to ``host_slots[i]``."""

    tier_slot: SlotId
    key: ChunkKey
    parts: tuple[int, ...]
    host_slots: tuple[SlotId, ...]


Unit = tuple[SlotId, ChunkKey, list[SlotId]]
"""One tier chunk to write: its tier slot, its tier key and its host slots in order."""


def demote_units(
    write: TierWrite, keys: Sequence[ChunkKey], slot_of: Callable[[int], SlotId]
) -> list[Unit]:
    """The :func:`demoter` units of ``write`` (of a store or write-down of ``keys``):
    ``slot_of(i)`` is the host slot of ``keys[i]`` (each member is pinned there)."""
    return [
        (SlotId(slot), keys[write.members(j)[-1]], [slot_of(i) for i in write.members(j)])
        for j, slot in enumerate(write.tier_slots)
    ]


def tier_reads(
    promotions: Sequence[Promotion], keys: Sequence[ChunkKey], host_slots: Sequence[SlotId]
) -> tuple[list[TierRead], list[int]]:
    """The :func:`promoter` reads of ``promotions`` (all from one tier) of a load of ``keys``
    into ``host_slots``: one read per tier chunk, its pieces into their host slots; and the
    load positions in the order of the promoter's ok flags."""
    by_slot: dict[int, list[Promotion]] = {}
    for p in promotions:
        by_slot.setdefault(p.tier_slot, []).append(p)
    reads = [
        TierRead(
            SlotId(slot),
            ChunkKey(ps[0].tier_key) if ps[0].tier_key else keys[ps[0].index],
            tuple(p.part for p in ps),
            tuple(host_slots[p.index] for p in ps),
        )
        for slot, ps in by_slot.items()
    ]
    return reads, [p.index for ps in by_slot.values() for p in ps]


def _windows(n: int, chunk_bytes: int) -> int:
    """Tier chunks one staging buffer holds."""
    return max(1, STAGE_BYTES // chunk_bytes) if n else 0


def demoter(
    tier: Tier,
    host: HostTier,
    units: Sequence[tuple[SlotId, ChunkKey, Sequence[SlotId]]],
    staging: Staging,
) -> Work:
    """Work that writes each ``(tier slot, tier key, host slots)`` of ``units``: the host
    slots' bytes end to end, as one tier chunk. Host slots stay pinned until it is done."""
    cb, per = tier.chunk_bytes, _windows(len(units), tier.chunk_bytes)

    def work() -> list[bool]:
        for at in range(0, len(units), per):
            part = units[at : at + per]
            views = [host_run(host, slots) for _s, _k, slots in part]
            stage = staging.get(cb * sum(v is None for v in views))  # none at span 1
            payloads, used = [], 0
            for view, (_s, _k, slots) in zip(views, part, strict=True):
                if view is None:
                    staged = stage[used : used + cb]
                    torch.cat([host.slot(s) for s in slots], out=staged)
                    payloads.append(staged)
                    used += cb
                else:
                    payloads.append(view)
            tier.write([s for s, _k, _h in part], [k for _s, k, _h in part], payloads)
        return [True] * len(units)

    return work


def promoter(tier: Tier, host: HostTier, reads: Sequence[TierRead], staging: Staging) -> Work:
    """Work that reads each tier chunk of ``reads`` and puts its pieces into their host slots;
    returns one ok flag per piece, in the order of ``reads`` and their ``parts``. A piece of a
    chunk read back bad leaves its host slot holding garbage (the book frees it)."""
    cb, hb = tier.chunk_bytes, host.chunk_bytes
    span = cb // hb
    per = _windows(len(reads), cb)

    def direct(r: TierRead) -> torch.Tensor | None:
        whole = r.parts == tuple(range(span))
        return host_run(host, r.host_slots) if whole else None

    def work() -> list[bool]:
        oks: list[bool] = []
        for at in range(0, len(reads), per):
            part = reads[at : at + per]
            outs = [direct(r) for r in part]
            stage = staging.get(cb * sum(o is None for o in outs))
            views, used = [], 0
            for o in outs:
                views.append(stage[used : used + cb] if o is None else o)
                used += cb if o is None else 0
            got = tier.read([r.tier_slot for r in part], [r.key for r in part], views)
            for r, out, view, outcome in zip(part, outs, views, got, strict=True):
                ok = outcome is ReadOutcome.OK
                if ok and out is None:
                    for p, slot in zip(r.parts, r.host_slots, strict=True):
                        host.slot(slot).copy_(view[p * hb : (p + 1) * hb])
                oks += [ok] * len(r.parts)
        return oks

    return work
