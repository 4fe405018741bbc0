"""Recurrent-state snapshots stored with their chunks, keyed like the chunk.

A hybrid model's prefix hit needs the recurrent state after the prefix as well as its KV: the
state after a chunk's last token is kept here under that chunk's :class:`~kvplane.ids.ChunkKey`
(which commits to the whole prefix). Host: an LRU of ``host_slots`` snapshots (CPU bytes).
Lower tiers (optional, fastest first: disk, remote): tiers of their own, written through on every
put, each one's slots reused least recently stored first; their headers and checksums make a
corrupt or foreign snapshot a miss, never wrong state. On construction each lower tier is
re-indexed (:meth:`Tier.scan`: what survived a restart is held again), and a shared store is
asked for what other engines published (:meth:`StateStore.held_run`). Pure storage,
synchronous, not thread-safe: the caller decides what to snapshot and when to restore.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence

import torch

from kvplane.errors import InvalidArgumentError, OffloadError
from kvplane.ids import ChunkKey, SlotId
from kvplane.offload.tiers.base import ReadOutcome, Tier
from kvplane.offload.tiers.shared import SharedTier
from kvplane.validators import require_int


class _Slots:
    """One lower tier's index: which key is in which slot, oldest stored first, and the free
    slots."""

    def __init__(self, tier: Tier, found: Mapping[ChunkKey, SlotId]) -> None:
        bad = sorted(int(s) for s in found.values() if not 0 <= s < tier.num_slots)
        if bad or len(set(found.values())) != len(found):
            raise OffloadError(f"tier {tier.name!r}: its re-index names bad slots {bad[:4]}")
        self.tier = tier
        self.held: OrderedDict[ChunkKey, SlotId] = OrderedDict(
            sorted(found.items(), key=lambda kv: int(kv[1]))
        )
        used = set(found.values())
        self.free = [SlotId(i) for i in range(tier.num_slots - 1, -1, -1) if i not in used]

    def take(self) -> SlotId:
        """A slot to write: a free one, else the least recently stored one's (forgotten)."""
        if not self.free:
            _old, slot = self.held.popitem(last=False)
            self.free.append(slot)
        return self.free.pop()

    def drop(self, key: ChunkKey) -> None:
        self.free.append(self.held.pop(key))


class StateStore:
    """Snapshots of ``nbytes`` bytes each (see the module docstring)."""

    def __init__(self, nbytes: int, host_slots: int, lower: Sequence[Tier] = ()) -> None:
        """``lower``: tiers of ``nbytes``-byte slots, fastest first (the store closes them).
        ``InvalidArgumentError`` for bad arguments; the re-index's ``OffloadError``."""
        require_int("StateStore.nbytes", nbytes, min=1)
        require_int("StateStore.host_slots", host_slots, min=1)
        for tier in lower:
            if tier.chunk_bytes != nbytes:
                raise InvalidArgumentError(
                    f"the state tier {tier.name!r} holds {tier.chunk_bytes}-byte slots, "
                    f"snapshots are {nbytes}"
                )
        self.nbytes = nbytes
        self.host_slots = host_slots
        self.lower = tuple(lower)
        self._host: OrderedDict[ChunkKey, torch.Tensor] = OrderedDict()
        self._tiers = [_Slots(tier, tier.scan()) for tier in self.lower]
        self.counts: Counter[str] = Counter()
        """``stored``, ``host_hits``, ``<tier>_hits`` (``disk_hits``, ``remote_hits``),
        ``misses`` (gets that found none), ``corrupt`` and ``missing`` (a tier's copy read
        back bad or gone), ``errors`` (a tier's write or read failed: counted, never raised),
        ``discovered`` (adopted from a shared store)."""

    def __contains__(self, key: object) -> bool:
        return key in self._host or any(key in t.held for t in self._tiers)

    def held_run(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` have a snapshot (host or a lower tier; one there may still
        turn out corrupt when read: :meth:`get` then misses). Keys past the run held here are
        asked of a shared store in one batch, and its leading run adopted (another engine's
        snapshots, keyed by content, serve here too)."""
        n = 0
        while n < len(keys) and keys[n] in self:
            n += 1
        for slots in self._tiers:
            if n < len(keys) and isinstance(slots.tier, SharedTier):
                n += self._discover(slots, keys[n:])
        return n

    def _discover(self, slots: _Slots, asked: Sequence[ChunkKey]) -> int:
        """Adopt the leading run of ``asked`` the shared tier holds; how many."""
        tier = slots.tier
        if not isinstance(tier, SharedTier):  # pragma: no cover - held_run checked
            return 0
        held = tier.held(asked)  # a server that fails is counted by the tier and skipped
        run = next((i for i, h in enumerate(held) if not h), len(asked))
        for key in asked[: min(run, tier.num_slots)]:
            slots.held[key] = slots.take()
        self.counts["discovered"] += min(run, tier.num_slots)
        return min(run, tier.num_slots)

    def put(self, key: ChunkKey, snapshot: torch.Tensor) -> None:
        """Keep a copy of ``snapshot`` (CPU, ``nbytes`` bytes) under ``key`` on the host and
        in every lower tier that lacks it; a held key is only refreshed. A lower tier that
        fails is counted (``errors``) and leaves the key out of it; ``InvalidArgumentError``
        for another size (nothing stored)."""
        data = _bytes_of(snapshot)
        if data.numel() != self.nbytes:
            raise InvalidArgumentError(
                f"a state snapshot of {data.numel()} bytes; this store holds {self.nbytes}"
            )
        if key in self._host:
            self._host.move_to_end(key)
        else:
            self._keep(key, data.clone())
            self.counts["stored"] += 1
        for slots in self._tiers:
            if key in slots.held:
                continue
            slot = slots.take()
            try:
                slots.tier.write([slot], [key], [self._host[key]])
            except OffloadError:
                slots.free.append(slot)
                self.counts["errors"] += 1
                continue
            slots.held[key] = slot

    def get(self, key: ChunkKey) -> torch.Tensor | None:
        """A copy (uint8 ``[nbytes]``) of the snapshot under ``key``: from the host, else from
        the fastest lower tier holding a valid one (kept on the host again); None when none
        does. A corrupt or missing copy is forgotten and the next tier asked; a tier whose
        read fails is counted (``errors``) and skipped."""
        got = self._host.get(key)
        if got is not None:
            self._host.move_to_end(key)
            self.counts["host_hits"] += 1
            return got.clone()
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        for slots in self._tiers:
            slot = slots.held.get(key)
            if slot is None:
                continue
            try:
                outcome = slots.tier.read([slot], [key], [out])[0]
            except OffloadError:
                self.counts["errors"] += 1
                continue
            if outcome is ReadOutcome.OK:
                self.counts[f"{slots.tier.name}_hits"] += 1
                self._keep(key, out.clone())
                return out
            slots.drop(key)
            self.counts["corrupt" if outcome is ReadOutcome.CORRUPT else "missing"] += 1
        self.counts["misses"] += 1
        return None

    def _keep(self, key: ChunkKey, data: torch.Tensor) -> None:
        self._host[key] = data
        while len(self._host) > self.host_slots:
            self._host.popitem(last=False)

    def close(self) -> None:
        """Close the lower tiers (idempotent)."""
        for tier in self.lower:
            tier.close()

    def check_integrity(self) -> None:
        """Host within its slots; every lower tier's slot either free or holding one key."""
        if len(self._host) > self.host_slots:
            raise OffloadError(f"{len(self._host)} host snapshots > {self.host_slots}")
        for slots in self._tiers:
            used = sorted([*slots.free, *slots.held.values()])
            if used != list(range(slots.tier.num_slots)):
                raise OffloadError(f"the state tier {slots.tier.name!r} lost or doubled a slot")


def _bytes_of(snapshot: torch.Tensor) -> torch.Tensor:
    """``snapshot``'s bytes as a flat uint8 tensor (a view when contiguous)."""
    if snapshot.device.type != "cpu":
        raise InvalidArgumentError(f"a state snapshot must be on the CPU, got {snapshot.device}")
    return snapshot.contiguous().view(torch.uint8).reshape(-1)
