"""Recurrent-state snapshots stored with their chunks, keyed like the chunk.

A hybrid model's prefix hit needs the recurrent state after the prefix as well as its KV: the
state after a chunk's last token is kept here under that chunk's :class:`~kvplane.ids.ChunkKey`
(which commits to the whole prefix). Host: an LRU of ``host_slots`` snapshots (CPU bytes).
Disk (optional): a :class:`~kvplane.offload.tiers.disk.DiskTier` of its own, written through on
every put, its slots reused least recently stored first; its header and checksum make a corrupt
or foreign snapshot a miss, never wrong state. Pure storage, synchronous, not thread-safe: the
caller decides what to snapshot and when to restore.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch

from kvplane.errors import InvalidArgumentError, OffloadError
from kvplane.ids import ChunkKey, SlotId
from kvplane.offload.tiers.base import ReadOutcome, Tier
from kvplane.validators import require_int


class StateStore:
    """Snapshots of ``nbytes`` bytes each (see the module docstring)."""

    def __init__(self, nbytes: int, host_slots: int, disk: Tier | None = None) -> None:
        require_int("StateStore.nbytes", nbytes, min=1)
        require_int("StateStore.host_slots", host_slots, min=1)
        if disk is not None and disk.chunk_bytes != nbytes:
            raise InvalidArgumentError(
                f"the state disk tier holds {disk.chunk_bytes}-byte slots, snapshots are {nbytes}"
            )
        self.nbytes = nbytes
        self.host_slots = host_slots
        self.disk = disk
        self._host: OrderedDict[ChunkKey, torch.Tensor] = OrderedDict()
        self._disk: OrderedDict[ChunkKey, SlotId] = OrderedDict()
        self._free = [SlotId(i) for i in range(disk.num_slots - 1, -1, -1)] if disk else []
        self.counts: Counter[str] = Counter()
        """``stored``, ``host_hits``, ``disk_hits``, ``misses``, ``corrupt``."""

    def __contains__(self, key: object) -> bool:
        return key in self._host or key in self._disk

    def held_run(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` have a snapshot (host or disk; a disk one may still turn
        out corrupt when read: :meth:`get` then misses)."""
        n = 0
        for key in keys:
            if key not in self:
                break
            n += 1
        return n

    def put(self, key: ChunkKey, snapshot: torch.Tensor) -> None:
        """Keep a copy of ``snapshot`` (CPU, ``nbytes`` bytes) under ``key``; a held key is only
        refreshed. ``InvalidArgumentError`` for another size (nothing stored); ``OffloadError``
        from the disk tier (the host copy is kept)."""
        data = _bytes_of(snapshot)
        if data.numel() != self.nbytes:
            raise InvalidArgumentError(
                f"a state snapshot of {data.numel()} bytes; this store holds {self.nbytes}"
            )
        if key in self._host:
            self._host.move_to_end(key)
            return
        self._keep(key, data.clone())
        self.counts["stored"] += 1
        if self.disk is None or key in self._disk:
            return
        if not self._free:
            _old, slot = self._disk.popitem(last=False)
            self._free.append(slot)
        slot = self._free.pop()
        try:
            self.disk.write([slot], [key], [self._host[key]])
        except BaseException:
            self._free.append(slot)
            raise
        self._disk[key] = slot

    def get(self, key: ChunkKey) -> torch.Tensor | None:
        """A copy (uint8 ``[nbytes]``) of the snapshot under ``key``: from the host, else from
        disk (kept on the host again); None when neither holds a valid one."""
        got = self._host.get(key)
        if got is not None:
            self._host.move_to_end(key)
            self.counts["host_hits"] += 1
            return got.clone()
        slot = self._disk.get(key)
        if slot is None or self.disk is None:
            self.counts["misses"] += 1
            return None
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        outcome = self.disk.read([slot], [key], [out])[0]
        if outcome is not ReadOutcome.OK:
            del self._disk[key]
            self._free.append(slot)
            self.counts["corrupt" if outcome is ReadOutcome.CORRUPT else "misses"] += 1
            return None
        self.counts["disk_hits"] += 1
        self._keep(key, out.clone())
        return out

    def _keep(self, key: ChunkKey, data: torch.Tensor) -> None:
        self._host[key] = data
        while len(self._host) > self.host_slots:
            self._host.popitem(last=False)

    def close(self) -> None:
        """Close the disk tier (idempotent)."""
        if self.disk is not None:
            self.disk.close()

    def check_integrity(self) -> None:
        """Host within its slots; every disk slot either free or holding exactly one key."""
        if len(self._host) > self.host_slots:
            raise OffloadError(f"{len(self._host)} host snapshots > {self.host_slots}")
        if self.disk is not None:
            used = sorted([*self._free, *self._disk.values()])
            if used != list(range(self.disk.num_slots)):
                raise OffloadError("the state disk slots are lost or doubly used")


def _bytes_of(snapshot: torch.Tensor) -> torch.Tensor:
    """``snapshot``'s bytes as a flat uint8 tensor (a view when contiguous)."""
    if snapshot.device.type != "cpu":
        raise InvalidArgumentError(f"a state snapshot must be on the CPU, got {snapshot.device}")
    return snapshot.contiguous().view(torch.uint8).reshape(-1)
