"""The block pool: ref counts, the LRU free queue and the prefix-cache hash map of one KV pool.

Every method validates before it changes anything; :meth:`BlockPool.check_integrity` checks
the invariants. A pool may reserve a null block: what a block table's entries that slid out of
every layer's window point at (never handed out, freed, shared or cached). Eviction and shared
holders: docs/offload.md.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Collection, Sequence
from typing import cast

import numpy as np
import numpy.typing as npt

from kvplane.blocks.free_queue import FreeBlockQueue
from kvplane.blocks.hashing import check_block_hash
from kvplane.config import PoolConfig
from kvplane.errors import (
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    UnknownBlockError,
)
from kvplane.ids import BlockHash, BlockId
from kvplane.metrics import MetricsRegistry
from kvplane.validators import require_int

_INT = {int}

BlockIdsIn = Sequence[BlockId] | npt.NDArray[np.integer]
"""Block ids a pool method takes: a sequence of ints or a 1-D integer numpy array (checked in
C, with no Python loop per block, when the ids are plain ints or such an array)."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens with ref counts and a prefix-cache map.

    Pure bookkeeping: the pool owns no tensors; a KV tensor of ``num_blocks`` pages is indexed
    by the :data:`~kvplane.ids.BlockId` values it hands out. Not thread-safe.

    ``metrics`` (optional, injected) receives, labelled ``pool=name``: counters
    ``kvplane_block_pool_allocated_blocks``, ``..._allocation_failures``, ``..._cache_hits``
    (blocks shared by :meth:`touch`), ``..._cache_evictions``, and gauges ``..._usage`` (used /
    total) and ``..._cached_blocks``.

    ``null_block=True`` reserves the last block as :attr:`null_block` (held by the pool, ref
    count 1, never in the free queue; not counted in :attr:`num_used_blocks`).

    Reservations (:meth:`reserve`): free blocks promised to holders that will take them later
    (a request's table that grows step by step). The pool counts only their total: what is
    not reserved (:attr:`num_available_blocks`) is all :meth:`allocate` and :meth:`touch` may
    take from the free queue, unless an allocation names the reserved blocks it draws on.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        metrics: MetricsRegistry | None = None,
        *,
        name: str = "default",
        null_block: bool = False,
    ) -> None:
        require_int("BlockPool.num_blocks", num_blocks, min=2 if null_block else 1)
        require_int("BlockPool.block_size", block_size, min=1)
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        # hash -> insertion-ordered set of the blocks holding it (dict keys; values unused)
        self._hash_map: dict[BlockHash, dict[BlockId, None]] = {}
        self._num_cached = 0
        self._free = FreeBlockQueue(num_blocks)
        self._null = BlockId(num_blocks - 1) if null_block else None
        self._peak = 0
        self._reserved = 0
        if self._null is not None:
            self._free.remove(self._null)
            self._ref[self._null] = 1
        self._metrics = metrics
        self._name = name
        if metrics is not None:
            lbl = ("pool",)
            self._m_alloc = metrics.counter(
                "block_pool_allocated_blocks", "Blocks handed out by allocate", lbl
            ).labels(pool=name)
            self._m_fail = metrics.counter(
                "block_pool_allocation_failures", "allocate calls that found too few blocks", lbl
            ).labels(pool=name)
            self._m_hits = metrics.counter(
                "block_pool_cache_hits", "Cached blocks shared through touch", lbl
            ).labels(pool=name)
            self._m_evict = metrics.counter(
                "block_pool_cache_evictions", "Cached free blocks whose hash was dropped", lbl
            ).labels(pool=name)
            self._m_usage = metrics.gauge(
                "block_pool_usage", "Used blocks / total blocks", lbl
            ).labels(pool=name)
            self._m_cached = metrics.gauge(
                "block_pool_cached_blocks", "Blocks registered in the prefix-cache map", lbl
            ).labels(pool=name)
            self._m_peak = metrics.gauge(
                "block_pool_peak_used_blocks", "Most blocks in use at once since start", lbl
            ).labels(pool=name)
            self._update_gauges()

    @classmethod
    def from_config(
        cls, config: PoolConfig, metrics: MetricsRegistry | None = None, *, name: str = "default"
    ) -> BlockPool:
        return cls(config.num_blocks, config.block_size, metrics, name=name)

    @property
    def null_block(self) -> BlockId | None:
        """The reserved null block (None without one): its content is never read as KV."""
        return self._null

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached or not): what :meth:`allocate` can hand out."""
        return len(self._free)

    @property
    def num_reserved_blocks(self) -> int:
        """Free blocks promised by :meth:`reserve` (never more than the free blocks)."""
        return self._reserved

    @property
    def num_available_blocks(self) -> int:
        """Free blocks not reserved: what an allocation drawing on no reservation can take."""
        return len(self._free) - self._reserved

    @property
    def capacity(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self._num_blocks - (self._null is not None)

    @property
    def num_used_blocks(self) -> int:
        """Blocks requests hold (the null block is the pool's, not counted)."""
        return self.capacity - len(self._free)

    @property
    def peak_used_blocks(self) -> int:
        """The most blocks requests held at once since the pool was made."""
        return self._peak

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, used or free (standby duplicates included)."""
        return self._num_cached

    # -- validation ------------------------------------------------------------------------
    def _block_id(self, value: object) -> BlockId:
        """``value`` as a known block id, or :class:`UnknownBlockError` naming it."""
        if isinstance(value, bool):
            raise UnknownBlockError(f"{value!r} is not a block id of pool {self._name!r}")
        try:
            idx = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise UnknownBlockError(f"{value!r} is not a block id of pool {self._name!r}") from None
        if not 0 <= idx < self._num_blocks:
            raise UnknownBlockError(
                f"block {idx} is not in pool {self._name!r} (blocks 0..{self._num_blocks - 1})"
            )
        return BlockId(idx)

    def _block_ids(self, block_ids: BlockIdsIn) -> list[BlockId]:
        """``block_ids`` as a list of known ids, or :class:`UnknownBlockError` naming the first
        bad one. A 1-D integer numpy array or a list of plain ints is checked in C (types, then
        the range by ``min``/``max``), with no Python loop per block; anything else id by id."""
        items: list[object]
        if (
            isinstance(block_ids, np.ndarray)
            and block_ids.ndim == 1
            and block_ids.dtype.kind in "iu"
        ):
            items = block_ids.tolist()  # plain ints, in C
        elif isinstance(block_ids, (str, bytes, bytearray)):
            raise InvalidArgumentError(f"block_ids must be a sequence of ints, got {block_ids!r}")
        else:
            try:
                items = list(block_ids)
            except TypeError:
                raise InvalidArgumentError(
                    f"block_ids must be a sequence of ints, got {block_ids!r}"
                ) from None
        if not items:
            return []
        if set(map(type, items)) == _INT:
            ints = cast(list[BlockId], items)
            if min(ints) >= 0 and max(ints) < self._num_blocks:
                return ints
        return [self._block_id(b) for b in items]

    def ref_count(self, block_id: BlockId) -> int:
        return self._ref[self._block_id(block_id)]

    def block_hash(self, block_id: BlockId) -> BlockHash | None:
        """The hash ``block_id`` is cached under, or ``None`` if it is not cached."""
        return self._hash[self._block_id(block_id)]

    def lookup(self, block_hash: BlockHash) -> BlockId | None:
        """A block cached under ``block_hash``, or ``None``.

        Among several holders it is the first registered one in use (``ref_count > 0``), so
        sharing it takes nothing from the free queue; when every holder is free, the first
        registered one. Changes nothing. Raises :class:`InvalidArgumentError` for a malformed
        hash.
        """
        holders = self._hash_map.get(check_block_hash(block_hash))
        if holders is None:
            return None
        ref = self._ref
        first: BlockId | None = None
        for block in holders:  # almost always one holder; standbys are rare
            if ref[block] > 0:
                return block
            if first is None:
                first = block
        return first

    def free_queue_order(self) -> list[BlockId]:
        """Free blocks from the next one :meth:`allocate` hands out to the most recently freed."""
        return self._free.order()

    # -- mutations -------------------------------------------------------------------------
    def reserve(self, n: int) -> bool:
        """Promise ``n`` more free blocks to a holder that takes them later (``allocate``'s
        ``reserved``); False, changing nothing, when fewer than ``n`` are available.
        ``InvalidArgumentError`` for a negative or non-int ``n``."""
        require_int("reserve's n", n, min=0)
        if n > self.num_available_blocks:
            return False
        self._reserved += n
        return True

    def unreserve(self, n: int) -> None:
        """Return ``n`` reserved blocks (a holder that will not take them).
        ``InvalidArgumentError`` for a bad ``n`` or more than are reserved, before any change."""
        require_int("unreserve's n", n, min=0, max=self._reserved)
        self._reserved -= n

    def allocate(self, n: int, *, reserved: int = 0) -> list[BlockId] | None:
        """Take ``n`` blocks from the head of the free queue, each with ref count 1, drawing
        ``reserved`` of them on the pool's reservations (those are reserved no more).

        Returns them in pop order, or ``None`` (and changes nothing) when fewer than
        ``n - reserved`` are available (:attr:`num_available_blocks`). A handed-out block that
        was cached is evicted: its hash leaves the map. ``n == 0`` returns ``[]``. Raises
        :class:`InvalidArgumentError` for a negative or non-int ``n``, or ``reserved`` beyond
        ``n`` or the reservations, before any change.
        """
        require_int("allocate's n", n, min=0)
        require_int("allocate's reserved", reserved, min=0, max=min(n, self._reserved))
        if n - reserved > self.num_available_blocks:
            if self._metrics is not None:
                self._m_fail.inc()
            return None
        self._reserved -= reserved
        out: list[BlockId] = []
        evicted = 0
        for _ in range(n):
            block = self._free.popleft()
            if block is None:  # pragma: no cover - guarded by the length check above
                raise BlockStateError("free queue ran dry below its own length")
            if self._hash[block] is not None:
                self._uncache(block)
                evicted += 1
            self._ref[block] = 1
            out.append(block)
        self._peak = max(self._peak, self.num_used_blocks)
        if self._metrics is not None:
            self._m_alloc.inc(n)
            if evicted:
                self._m_evict.inc(evicted)
            self._update_gauges()
        return out

    def free(self, block_ids: BlockIdsIn) -> None:
        """Drop one reference per listed id (a block listed twice loses two).

        Blocks reaching ref count 0 are appended to the free queue's tail in the order they
        reach 0 while walking the list, so the first one freed is the first evicted; cached
        blocks keep their hash and stay matchable. Raises :class:`UnknownBlockError` for an
        id outside the pool and :class:`DoubleFreeError` when a block would drop below 0
        (duplicates inside one call included), before changing anything.
        """
        ids = self._block_ids(block_ids)
        counts = Counter(ids)
        self._refuse_null(counts, "free")
        for block, times in counts.items():
            if times > self._ref[block]:
                raise DoubleFreeError(
                    f"block {block} of pool {self._name!r} freed {times} time(s) "
                    f"but has ref count {self._ref[block]}"
                )
        for block in ids:
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free.append(block)
        if self._metrics is not None:
            self._update_gauges()

    def touch(self, block_ids: BlockIdsIn) -> None:
        """Share blocks found by :meth:`lookup` (a prefix-cache hit): ref count += 1 each.

        A free block leaves the free queue (it can no longer be evicted). Raises
        :class:`UnknownBlockError` for an id outside the pool and :class:`BlockStateError` for a
        free block that is not cached (its content is garbage) or for more free blocks than
        are available (the rest are reserved), before changing anything.
        """
        ids = self.check_touch(block_ids)
        if self._reserved:  # a free block it takes must not be a reserved one
            taking = len({b for b in ids if self._ref[b] == 0})
            if taking > self.num_available_blocks:
                raise BlockStateError(
                    f"cannot touch {taking} free block(s) of pool {self._name!r}: "
                    f"{self._reserved} of its {len(self._free)} free blocks are reserved"
                )
        for block in ids:
            if self._ref[block] == 0:
                self._free.remove(block)
            self._ref[block] += 1
        self._peak = max(self._peak, self.num_used_blocks)
        if self._metrics is not None:
            self._m_hits.inc(len(ids))
            self._update_gauges()

    def check_touch(self, block_ids: BlockIdsIn) -> list[BlockId]:
        """Raise what :meth:`touch` would raise for ``block_ids``; changes nothing.

        Returns the ids as validated :data:`~kvplane.ids.BlockId` values. Lets a caller check
        blocks before other work that must not happen when the touch would fail.
        """
        ids = self._block_ids(block_ids)
        self._refuse_null(ids, "touch")
        ref, hashes = self._ref, self._hash
        if 0 not in map(ref.__getitem__, ids):  # all in use (the common case): scanned in C
            return ids
        for block in ids:
            if ref[block] == 0 and hashes[block] is None:
                raise BlockStateError(
                    f"cannot touch block {block} of pool {self._name!r}: it is free and not cached"
                )
        return ids

    def cache_block(self, block_id: BlockId, block_hash: BlockHash) -> None:
        """Register a FULL, computed, in-use block under ``block_hash`` for prefix matching.

        The caller promises the block's KV for all ``block_size`` tokens is written. Idempotent
        for the same (block, hash). When ``block_hash`` is already registered for another block,
        ``block_id`` stands by behind it (both hold the same KV): :meth:`lookup` returns the
        earliest registered holder in use, else the earliest registered one, so a prefix stays
        findable while any holder lives. Raises
        :class:`UnknownBlockError`, :class:`InvalidArgumentError` for a malformed hash, and
        :class:`BlockStateError` for a free block or one already cached under another hash.
        """
        block = self._block_id(block_id)
        block_hash = check_block_hash(block_hash)
        self._refuse_null((block,), "cache")
        if self._ref[block] == 0:
            raise BlockStateError(f"cannot cache block {block} of pool {self._name!r}: it is free")
        current = self._hash[block]
        if current is not None:
            if current != block_hash:
                raise BlockStateError(
                    f"block {block} of pool {self._name!r} is already cached under "
                    f"{current.hex()}, not {block_hash.hex()}"
                )
            return
        self._hash[block] = block_hash
        self._hash_map.setdefault(block_hash, {})[block] = None
        self._num_cached += 1
        if self._metrics is not None:
            self._update_gauges()

    def _refuse_null(self, ids: Collection[BlockId], action: str) -> None:
        """``BlockStateError`` when ``ids`` holds the null block (one C-level membership test)."""
        if self._null is not None and self._null in ids:
            raise BlockStateError(f"cannot {action} the null block {self._null} of {self._name!r}")

    def _uncache(self, block: BlockId) -> None:
        """Drop ``block``'s hash; the next standby block (if any) becomes the one looked up."""
        h = self._hash[block]
        if h is None:  # pragma: no cover - callers check first
            return
        holders = self._hash_map[h]
        del holders[block]
        if not holders:
            del self._hash_map[h]
        self._hash[block] = None
        self._num_cached -= 1

    # -- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise :class:`BlockStateError` naming the first broken invariant (see module doc)."""
        self._free.check_integrity()
        negative = [(b, r) for b, r in enumerate(self._ref) if r < 0]
        if negative:
            raise BlockStateError(f"block {negative[0][0]} has negative ref count {negative[0][1]}")
        free = set(self._free)
        used = sum(1 for ref in self._ref if ref > 0)
        if len(free) + used != self._num_blocks:
            raise BlockStateError(f"free {len(free)} + used {used} != total {self._num_blocks}")
        if not 0 <= self._reserved <= len(free):
            raise BlockStateError(f"{self._reserved} blocks reserved but {len(free)} free")
        if self._null is not None and (self._ref[self._null], self._hash[self._null]) != (1, None):
            raise BlockStateError(f"the null block {self._null} is not held once, uncached")
        for block, ref in enumerate(self._ref):
            if (ref == 0) != (block in free):
                raise BlockStateError(
                    f"block {block} has ref count {ref} but free-queue membership {block in free}"
                )
            h = self._hash[block]
            if h is not None and block not in self._hash_map.get(h, {}):
                raise BlockStateError(f"block {block} carries hash {h.hex()} the map does not")
        registered = 0
        for h, holders in self._hash_map.items():
            if not holders:
                raise BlockStateError(f"map has an empty block set for {h.hex()}")
            for block in holders:
                if self._hash[block] != h:
                    raise BlockStateError(f"map has {h.hex()} -> block {block}, block disagrees")
            registered += len(holders)
        if registered != self._num_cached:
            raise BlockStateError(f"{registered} blocks in the map, count says {self._num_cached}")

    def _update_gauges(self) -> None:
        self._m_usage.set(self.num_used_blocks / self._num_blocks)
        self._m_cached.set(self._num_cached)
        self._m_peak.set(self._peak)
