"""The plain data a :class:`~kvplane.offload.book.TierBook` decides in and is told in.

Reservations (what a store or load may move, into which slots) go from the book to whoever
moves bytes (the in-process :class:`~kvplane.offload.cascade.TierCascade`, or a vLLM worker in
another process); tier writes, promotions and the re-index travel inside the vLLM connector's
messages. Every field is an int, str, bytes, bool or tuple of them: frozen, picklable,
compared by value. No behaviour lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplane.ids import ChunkKey, SlotId


@dataclass(frozen=True, slots=True)
class TierWrite:
    """Chunks ``indices`` (positions in the keys of the store or write-down that carries this
    write) go on to tier ``tier``'s ``tier_slots``, reserved STORING there by the book.

    ``span`` > 1 (a tier of larger chunks, :mod:`~kvplane.offload.spans`): tier chunk ``j`` is
    the ``span`` host chunks from position ``indices[j]`` on, keyed by the last of them."""

    tier: str
    indices: tuple[int, ...]
    tier_slots: tuple[int, ...]
    span: int = 1

    def members(self, j: int) -> range:
        """Positions of the host chunks that make tier chunk ``j``."""
        return range(self.indices[j], self.indices[j] + self.span)


@dataclass(frozen=True, slots=True)
class Promotion:
    """Chunk ``index`` of a load is read from ``tier`` slot ``tier_slot`` into its host slot.

    From a tier of larger chunks, host chunk ``index`` is piece ``part`` of the tier chunk
    ``tier_key`` (empty: the host key itself, a tier of the host's chunk size)."""

    index: int
    tier: str
    tier_slot: int
    tier_key: bytes = b""
    part: int = 0


@dataclass(frozen=True, slots=True)
class StoreReservation:
    """Host slots reserved for a store: host ``slots[i]`` (STORING) for ``keys[i]``, plus, when
    reserved write-through, the lower-tier ``writes`` to do right after the gather.

    ``deferred``: asked keys whose host copy is doomed (read back bad, other readers still pin
    it) and so not stored now; they are storable once those readers are done, so the caller
    must offer them again later.
    """

    keys: tuple[ChunkKey, ...]
    slots: tuple[SlotId, ...]
    writes: tuple[TierWrite, ...] = ()
    deferred: tuple[ChunkKey, ...] = ()


@dataclass(frozen=True, slots=True)
class WriteDown:
    """Host-resident ``keys`` to copy down to lower tiers: one ``writes`` entry per tier that
    admits some of them (its ``indices`` index ``keys``); host pins each once per write."""

    keys: tuple[ChunkKey, ...]
    writes: tuple[TierWrite, ...]


@dataclass(frozen=True, slots=True)
class LoadReservation:
    """Pinned (host) or reserved and pinned (promotion) slots for loading ``keys``, a prefix
    of what was asked: ``host_slots[i]`` holds, or after its promotion will hold, ``keys[i]``."""

    keys: tuple[ChunkKey, ...]
    host_slots: tuple[SlotId, ...]
    promotions: tuple[Promotion, ...]

    @property
    def sources(self) -> tuple[str, ...]:
        """Per key, the tier the load reads it from (``"host"`` unless promoted)."""
        out = ["host"] * len(self.keys)
        for p in self.promotions:
            out[p.index] = p.tier
        return tuple(out)


@dataclass(frozen=True, slots=True)
class TierIndex:
    """A start-up handshake: the engine fingerprint digest that roots the chunk keys, the chunk
    size, and per lower tier the valid chunks it already holds (a restart)."""

    fingerprint: bytes
    chunk_bytes: int
    tiers: tuple[tuple[str, tuple[tuple[ChunkKey, int], ...]], ...] = field(default=())

    def found(self, tier: str) -> dict[ChunkKey, int]:
        """``{key: slot}`` held by ``tier`` (empty for a tier the index does not name)."""
        for name, items in self.tiers:
            if name == tier:
                return dict(items)
        return {}
