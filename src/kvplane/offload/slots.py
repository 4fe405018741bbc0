"""Chunk slot status: which chunk occupies which slot of a tier, and in what state.

One transition table (:data:`TRANSITIONS`), atomic batches, lowest-free slot allocation and an
integrity check. Not thread-safe. See docs/offload.md.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable, Sequence
from typing import cast

from kvplane.errors import IllegalTransitionError, InvalidArgumentError, UnknownChunkError
from kvplane.ids import ChunkKey, SlotId
from kvplane.validators import require_index, require_int

MAX_KEY_BYTES = 64
"""Longest chunk key a tier stores (a block hash is 32 bytes); it must fit the chunk header."""


class SlotStatus(enum.Enum):
    """The life cycle state of one slot of one tier."""

    EMPTY = "empty"
    STORING = "storing"
    READY = "ready"
    LOADING = "loading"
    EVICTING = "evicting"

    # Members are singletons compared by identity: hash them by identity too, in C (Enum's own
    # __hash__ is Python code, and every transition check hashes two statuses).
    __hash__ = object.__hash__


S = SlotStatus
TRANSITIONS: frozenset[tuple[SlotStatus, SlotStatus]] = frozenset(
    {
        (S.EMPTY, S.STORING),
        (S.STORING, S.READY),
        (S.STORING, S.EMPTY),
        (S.READY, S.LOADING),
        (S.LOADING, S.LOADING),
        (S.LOADING, S.READY),
        (S.READY, S.EVICTING),
        (S.EVICTING, S.EMPTY),
    }
)
"""The only legal ``(from, to)`` pairs; LOADING -> LOADING adds or drops one reader."""
_SOURCES: dict[SlotStatus, frozenset[SlotStatus]] = {
    to: frozenset(a for a, b in TRANSITIONS if b is to) for to in SlotStatus
}
"""Per target status, the statuses that may move to it (one set lookup per checked slot)."""
_STORING = frozenset({S.STORING})
_LOADING = frozenset({S.LOADING})


def check_chunk_key(key: object) -> ChunkKey:
    """``key`` as a :data:`ChunkKey`: ``bytes`` of 1..:data:`MAX_KEY_BYTES` bytes, else an error."""
    if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
        shown = f"{len(key)} bytes" if isinstance(key, bytes) else repr(key)
        raise InvalidArgumentError(
            f"a chunk key must be bytes of 1..{MAX_KEY_BYTES} bytes, got {shown}"
        )
    return ChunkKey(key)


def check_chunk_keys(keys: Iterable[object]) -> list[ChunkKey]:
    """Validate a batch of keys: each a valid key, no key twice (``InvalidArgumentError``)."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise InvalidArgumentError(f"expected a sequence of chunk keys, got a single {keys!r:.40}")
    given = list(keys)
    for key in given:  # checked inline: this runs per chunk on every store and load
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            check_chunk_key(key)  # a bytes subclass passes; anything else raises
    out = cast(list[ChunkKey], given)
    reject_duplicates(out)
    return out


def reject_duplicates(keys: Sequence[ChunkKey]) -> None:
    """``InvalidArgumentError`` naming the first key listed twice in ``keys``; one set build."""
    if len(set(keys)) != len(keys):
        seen: set[ChunkKey] = set()
        for key in keys:
            if key in seen:
                raise InvalidArgumentError(f"chunk key {key.hex()} appears twice in one batch")
            seen.add(key)


class SlotTable:
    """Slot status of one tier (``name``) with ``num_slots`` slots; see the module docstring."""

    def __init__(self, num_slots: int, name: str = "tier") -> None:
        require_int("SlotTable.num_slots", num_slots, min=1)
        self.name = name
        self._slot_what = f"a slot of tier {name!r}"  # built once: slots are checked often
        self._n = num_slots
        self._status: list[SlotStatus] = [S.EMPTY] * num_slots
        self._key: list[ChunkKey | None] = [None] * num_slots
        self._readers: list[int] = [0] * num_slots
        self._slot_of: dict[ChunkKey, SlotId] = {}
        self._free: list[int] = list(range(num_slots))  # a heap; sorted is a valid heap

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self._n

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._n - len(self._free)

    def slot_of(self, key: ChunkKey) -> SlotId | None:
        """The slot holding ``key`` in any non-EMPTY status, or ``None``."""
        return self._slot_of.get(key)

    def status(self, slot: SlotId) -> SlotStatus:
        return self._status[self._check_slot(slot)]

    def status_of(self, key: ChunkKey) -> SlotStatus:
        """Status of the slot holding ``key``; EMPTY when no slot holds it."""
        slot = self._slot_of.get(key)
        return S.EMPTY if slot is None else self._status[slot]

    def key_at(self, slot: SlotId) -> ChunkKey | None:
        return self._key[self._check_slot(slot)]

    def readers(self, key: ChunkKey) -> int:
        slot = self._slot_of.get(key)
        return 0 if slot is None else self._readers[slot]

    def keys(self) -> list[ChunkKey]:
        """Every key held in a non-EMPTY slot, in slot order."""
        return [k for k in self._key if k is not None]

    def keys_in(self, *statuses: SlotStatus) -> set[ChunkKey]:
        return {
            k
            for k, s in zip(self._key, self._status, strict=True)
            if k is not None and s in statuses
        }

    # -- validation ------------------------------------------------------------------------
    def _check_slot(self, slot: object) -> int:
        return require_index(self._slot_what, slot, self._n)

    def _held(
        self, keys: Sequence[ChunkKey], to: SlotStatus, sources: frozenset[SlotStatus] | None = None
    ) -> list[SlotId]:
        """The entry check of every batch move of held keys: no key listed twice
        (``InvalidArgumentError``), each held (``UnknownChunkError``) and in one of ``sources``
        (default: the statuses that may move to ``to``; ``IllegalTransitionError``). Returns
        their slots; changes nothing."""
        reject_duplicates(keys)
        slots: list[SlotId] = []
        slot_of, status = self._slot_of, self._status
        allowed = _SOURCES[to] if sources is None else sources
        for key in keys:
            slot = slot_of.get(key)
            if slot is None:
                raise UnknownChunkError(f"chunk {key.hex()} is not held by tier {self.name!r}")
            if status[slot] not in allowed:
                if sources is not None:
                    raise IllegalTransitionError(
                        f"tier {self.name!r} slot {slot} (chunk {key.hex()}) is "
                        f"{status[slot].value}, not one of {sorted(s.value for s in sources)}"
                    )
                self._check_transition(slot, to)  # raises, naming the slot and the move
            slots.append(slot)
        return slots

    def all_in(self, keys: Sequence[ChunkKey], status: SlotStatus) -> bool:
        """Whether every key is held and in ``status`` (the fast check before a batch move)."""
        slot_of, st = self._slot_of, self._status
        for key in keys:
            slot = slot_of.get(key)
            if slot is None or st[slot] is not status:
                return False
        return True

    def _check_transition(self, slot: int, to: SlotStatus) -> None:
        frm = self._status[slot]
        if (frm, to) not in TRANSITIONS:
            key = self._key[slot]
            raise IllegalTransitionError(
                f"tier {self.name!r} slot {slot} (chunk {key.hex() if key else None}): "
                f"{frm.value} -> {to.value} is not allowed"
            )

    # -- transitions -----------------------------------------------------------------------
    def begin_store(self, keys: Sequence[ChunkKey]) -> list[SlotId] | None:
        """EMPTY -> STORING for new ``keys`` in the lowest free slots; ``None`` if too few free.

        Raises ``InvalidArgumentError`` for a key listed twice and ``IllegalTransitionError``
        for a key already held (any status) before changing anything. Keys must otherwise be
        pre-validated (:func:`check_chunk_key`).
        """
        reject_duplicates(keys)
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is not None:
                raise IllegalTransitionError(
                    f"tier {self.name!r}: chunk {key.hex()} already holds slot {slot} "
                    f"({self._status[slot].value})"
                )
        if len(keys) > len(self._free):
            return None
        slots = [SlotId(heapq.heappop(self._free)) for _ in keys]
        for key, slot in zip(keys, slots, strict=True):
            self._status[slot] = S.STORING
            self._key[slot] = key
            self._slot_of[key] = slot
        return slots

    def finish_store(self, keys: Sequence[ChunkKey], ok: bool) -> list[SlotId]:
        """STORING -> READY (``ok``) or STORING -> EMPTY (failed store frees the slot)."""
        to = S.READY if ok else S.EMPTY
        slots = self._held(keys, to, _STORING)
        for key, slot in zip(keys, slots, strict=True):
            if ok:
                self._status[slot] = S.READY
            else:
                self._release(key, slot)
        return slots

    def pin(self, keys: Sequence[ChunkKey]) -> list[SlotId]:
        """READY -> LOADING, or one more reader on a LOADING slot (each key listed once)."""
        slots = self._held(keys, S.LOADING)
        for slot in slots:
            self._status[slot] = S.LOADING
            self._readers[slot] += 1
        return slots

    def unpin(self, keys: Sequence[ChunkKey]) -> list[SlotId]:
        """One reader fewer: LOADING(n) -> LOADING(n-1), or -> READY for the last reader.

        Each key listed once (``InvalidArgumentError`` otherwise, before any change).
        """
        slots = self._held(keys, S.READY, _LOADING)
        for slot in slots:
            self._readers[slot] -= 1
            if self._readers[slot] == 0:
                self._status[slot] = S.READY
        return slots

    def evict(self, keys: Sequence[ChunkKey]) -> list[SlotId]:
        """READY -> EVICTING -> EMPTY for each key (a pinned or storing chunk cannot go)."""
        slots = self._held(keys, S.EVICTING)
        for key, slot in zip(keys, slots, strict=True):
            self._status[slot] = S.EVICTING  # EVICTING -> EMPTY is always legal
            self._release(key, slot)
        return slots

    def adopt(self, key: ChunkKey, slot: SlotId) -> None:
        """Re-index after a restart: an EMPTY ``slot`` found holding ``key`` becomes READY."""
        self.adopt_batch([key], [slot])

    def adopt_batch(self, keys: Sequence[ChunkKey], slots: Sequence[SlotId]) -> None:
        """:meth:`adopt` ``keys[i]`` into ``slots[i]`` for every ``i``, all or nothing.

        Raises ``InvalidArgumentError`` for a bad key (:func:`check_chunk_keys`), a slot out of
        range, a key or slot listed twice or unequal lengths, and ``IllegalTransitionError`` for
        a key already held or a slot not EMPTY, before changing anything.
        """
        ks = check_chunk_keys(keys)
        idx = [self._check_slot(s) for s in slots]
        if len(idx) != len(ks):
            raise InvalidArgumentError(f"adopt: {len(ks)} keys but {len(idx)} slots")
        if len(set(idx)) != len(idx):
            raise InvalidArgumentError(f"adopt: a slot is named twice in {sorted(idx)}")
        for key, i in zip(ks, idx, strict=True):
            if key in self._slot_of or self._status[i] is not S.EMPTY:
                raise IllegalTransitionError(
                    f"tier {self.name!r}: cannot adopt chunk {key.hex()} into slot {i} "
                    f"({self._status[i].value}, key held: {key in self._slot_of})"
                )
        if not idx:
            return
        taken = set(idx)
        self._free = [f for f in self._free if f not in taken]
        heapq.heapify(self._free)
        for key, i in zip(ks, idx, strict=True):
            self._status[i] = S.READY
            self._key[i] = key
            self._slot_of[key] = SlotId(i)

    def _release(self, key: ChunkKey, slot: int) -> None:
        self._status[slot] = S.EMPTY
        self._key[slot] = None
        self._readers[slot] = 0
        del self._slot_of[key]
        heapq.heappush(self._free, slot)

    # -- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``IllegalTransitionError`` naming the first broken invariant.

        Free slots are exactly the EMPTY ones (each once); the key map and the per-slot keys
        agree; readers > 0 exactly on LOADING slots; no slot is left EVICTING.
        """
        free = sorted(self._free)
        empty = [i for i, s in enumerate(self._status) if s is S.EMPTY]
        if free != empty:
            raise IllegalTransitionError(f"tier {self.name!r}: free slots {free} != EMPTY {empty}")
        for i, (status, key, readers) in enumerate(
            zip(self._status, self._key, self._readers, strict=True)
        ):
            if (status is S.EMPTY) != (key is None):
                raise IllegalTransitionError(
                    f"tier {self.name!r} slot {i}: {status} with key {key!r}"
                )
            if key is not None and self._slot_of.get(key) != i:
                raise IllegalTransitionError(f"tier {self.name!r} slot {i}: key map disagrees")
            if (readers > 0) != (status is S.LOADING) or readers < 0:
                raise IllegalTransitionError(
                    f"tier {self.name!r} slot {i}: {readers} readers while {status.value}"
                )
            if status is S.EVICTING:
                raise IllegalTransitionError(f"tier {self.name!r} slot {i} left EVICTING")
        if len(self._slot_of) != self._n - len(self._free):
            raise IllegalTransitionError(f"tier {self.name!r}: key map size != used slots")
