"""Chunk moves as plans: pool blocks <-> the chunk slots of a slot buffer, one op per chunk.

:class:`SlotBuffer` is the one home of slot addressing (a host tier's slots, each chunk stored
block-major in the layout's canonical order, so one contiguous run per slot).
:class:`ChunkPlans` describes such a buffer as a layout; the planner's CHUNK grouping is the
one place a chunk becomes byte runs. A move's one
transport batch is the planner's validated one-block template copied to whole blocks and slots
(``check_tiles`` proved it safe once), and at construction the CHUNK plan of one move each way
must map every byte as the tiled batch does, on this very layout. It plans only: it holds no
tensor and moves no byte."""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError, PlanError
from kvplane.ids import ChunkKey, RegionId, TokenRange
from kvplane.layout import BLOCK_MAJOR, Axis, KVLayout
from kvplane.transfer.plan import ValidatedPlan
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanSide
from kvplane.transports.base import DescriptorList, Int64Array
from kvplane.transports.checks import Lattice, Tiles, check_batch, check_tiles
from kvplane.validators import require_index, require_int, require_size

CACHE_DESCRIPTORS = 1 << 18
"""Descriptors of the batches remembered (~100 bytes each with their proof and facts), least
recently used first out: a move of the same blocks and slots again costs a lookup."""


@dataclass(frozen=True, slots=True)
class SlotBuffer:
    """``num_slots`` slots of ``chunk_bytes`` bytes in one buffer, slot ``s`` at byte ``s *
    slot_stride`` (``slot_stride >= chunk_bytes``; more when slots are padded).

    A chunk is stored block-major, so the slot-side runs of its op in a CHUNK plan tile one
    run, :meth:`run`: the bytes a host slot view holds and a disk or remote tier writes and
    reads. ``InvalidArgumentError`` for a bad count, size or a stride shorter than a chunk."""

    num_slots: int
    chunk_bytes: int
    slot_stride: int

    def __post_init__(self) -> None:
        require_int("SlotBuffer.num_slots", self.num_slots, min=1)
        require_size("SlotBuffer.chunk_bytes", self.chunk_bytes, min=1)
        require_size("SlotBuffer.slot_stride", self.slot_stride, min=self.chunk_bytes)

    @property
    def padded(self) -> bool:
        """True when a slot has bytes past its chunk (slot ``s + 1`` does not follow on)."""
        return self.slot_stride != self.chunk_bytes

    @property
    def nbytes(self) -> int:
        """The buffer's length: ``num_slots * slot_stride``."""
        return self.num_slots * self.slot_stride

    def run(self, slot: object) -> tuple[int, int]:
        """``(offset, length)`` of slot ``slot``'s chunk in the buffer; ``InvalidArgumentError``
        unless ``slot`` is an index in ``[0, num_slots)``."""
        return require_index("a slot", slot, self.num_slots) * self.slot_stride, self.chunk_bytes


class ChunkMove:
    """One gather or scatter: the one transport batch that runs it (``src``/``dst``: every
    chunk's runs in chunk order, continuing runs merged, vouched by ``checks``, so the
    transport does not check them again) and, built on first use, its validated
    CHUNK-grouped :attr:`plan`, which moves exactly the batch's bytes. The plan is built from
    the block ids, slots and keys the move was made of, copied when it was made: changing the
    caller's arrays afterwards changes neither."""

    __slots__ = ("_build", "_plan", "dst", "src")

    def __init__(
        self, src: DescriptorList, dst: DescriptorList, build: Callable[[], ValidatedPlan]
    ) -> None:
        self.src, self.dst = src, dst
        self._build = build
        self._plan: ValidatedPlan | None = None

    @property
    def plan(self) -> ValidatedPlan:
        """The planner's CHUNK-grouped plan of this move (one op per chunk, with its key),
        validated; built once, on first use."""
        if self._plan is None:
            self._plan = self._build()
        return self._plan


class ChunkPlans:
    """Plans moving chunks of ``blocks_per_chunk`` blocks between a pool laid out as ``layout``
    (at offset 0 of region ``pool_region``) and ``slots`` (all of region ``slots_region``).
    ``InvalidArgumentError`` unless a slot holds exactly one chunk. Thread-safe."""

    def __init__(
        self,
        layout: KVLayout,
        pool_region: RegionId,
        slots_region: RegionId,
        slots: SlotBuffer,
        blocks_per_chunk: int,
        *,
        cache_descriptors: int = CACHE_DESCRIPTORS,
    ) -> None:
        self.spec = ChunkSpec(layout.block_size, blocks_per_chunk)
        if slots.chunk_bytes != blocks_per_chunk * layout.bytes_per_block:
            raise InvalidArgumentError(
                f"slots hold {slots.chunk_bytes} bytes but a chunk of {blocks_per_chunk} "
                f"blocks is {blocks_per_chunk * layout.bytes_per_block}"
            )
        # whole blocks move: a sliding window (a property of a sequence) has no say here
        self.pool = dataclasses.replace(layout, sliding_window=None, layer_windows=())
        self.pool_region, self.slots_region, self.slots = pool_region, slots_region, slots
        host_blocks = blocks_per_chunk if slots.padded else slots.num_slots * blocks_per_chunk
        self.slot_layout = dataclasses.replace(self.pool, num_blocks=host_blocks, order=BLOCK_MAJOR)
        """The slot buffer seen as a pool: one slot (padded slots) or all of them."""
        self._lengths = {pool_region: self.pool.pool_bytes, slots_region: slots.nbytes}
        self._tiles = self._one_block()
        self._prove()
        self._cache_descriptors = cache_descriptors
        self._cache: OrderedDict[tuple[bool, bytes, bytes], tuple[DescriptorList, DescriptorList]]
        self._cache = OrderedDict()
        self._cached = 0
        """Descriptors the cached batches hold."""
        self._lock = threading.Lock()

    def gather(
        self, block_ids: Int64Array, slots: Int64Array, keys: Sequence[ChunkKey] = ()
    ) -> ChunkMove:
        """Pool blocks ``block_ids`` (chunk ``i`` is ids ``i*bpc..``) into ``slots[i]``."""
        return self._move(True, block_ids, slots, tuple(keys))

    def scatter(
        self, slots: Int64Array, block_ids: Int64Array, keys: Sequence[ChunkKey] = ()
    ) -> ChunkMove:
        """``slots[i]`` into pool blocks ``block_ids`` (chunk-major, as for :meth:`gather`)."""
        return self._move(False, block_ids, slots, tuple(keys))

    def _move(
        self, to_slots: bool, ids: Int64Array, slots: Int64Array, keys: tuple[ChunkKey, ...]
    ) -> ChunkMove:
        """The move: its batch cached per (direction, ids, slots), else built. ``ids`` and
        ``slots`` 1-D int64 arrays; ``keys`` one per chunk, or none. ``InvalidArgumentError``
        for a wrong count, an id or slot out of range or repeated (a move reads and writes
        every byte once)."""
        bpc = self.spec.blocks_per_chunk
        if ids.size != slots.size * bpc or (keys and len(keys) != slots.size):
            raise InvalidArgumentError(
                f"{slots.size} chunks need {slots.size * bpc} block ids and no or "
                f"{slots.size} keys, got {ids.size} and {len(keys)}"
            )
        ids, slots = _frozen_copy(ids), _frozen_copy(slots)  # the plan, built later, uses these
        key = (to_slots, ids.tobytes(), slots.tobytes())
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
        if found is None:
            found = self._batch(to_slots, ids, slots)
            self._remember(key, found)
        return ChunkMove(
            *found, lambda: ValidatedPlan.join(self._plans(to_slots, ids, slots, keys))
        )

    def _remember(
        self, key: tuple[bool, bytes, bytes], batch: tuple[DescriptorList, DescriptorList]
    ) -> None:
        with self._lock:
            if key not in self._cache:
                self._cache[key] = batch
                self._cached += len(batch[0])
            while self._cached > self._cache_descriptors and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached -= len(old[0])

    def _one_block(self) -> dict[bool, Tiles]:
        """Per direction (True: to the slots), the planner's validated runs moving pool block
        0 into slot 0's block 0, proved to tile: block ``b`` of the pool is those bytes ``b *
        stride(BLOCK)`` further on (a strided layout), block ``j`` of slot ``s`` ``s *
        slot_stride + j * bytes_per_block`` further (the slots are block-major)."""
        one = np.zeros(1, dtype=np.int64)
        plan = plan_transfer(
            PlanSide(self.pool, one, self.pool_region),
            PlanSide(self.slot_layout, one, self.slots_region),
            TokenRange(0, self.spec.block_size),
        ).validate(self._lengths, self._lengths)
        pool = [Lattice(self.pool.strides_bytes()[Axis.BLOCK], self.pool.num_blocks)]
        slot = [
            Lattice(self.pool.bytes_per_block, self.spec.blocks_per_chunk),
            Lattice(self.slots.slot_stride, self.slots.num_slots),
        ]
        whole, lengths = plan.whole, self._lengths
        back = check_batch(whole.dst, whole.src, lengths, lengths, sources_disjoint=True)
        return {
            True: check_tiles(whole, pool, slot, lengths, lengths),
            False: check_tiles(back, slot, pool, lengths, lengths),
        }

    def _prove(self) -> None:
        """``PlanError`` unless the tiled batch of a move of (up to) two chunks, of the pool's
        last blocks and the buffer's last slots in reverse order, maps every byte as the
        planner's CHUNK plan of that move does, both ways: the fast path is checked against its
        specification on the layout it will run on, once."""
        bpc = self.spec.blocks_per_chunk
        n = min(2, self.slots.num_slots, self.pool.num_blocks // bpc)
        ids = np.arange(self.pool.num_blocks - n * bpc, self.pool.num_blocks, dtype=np.int64)
        slots = np.arange(self.slots.num_slots - n, self.slots.num_slots, dtype=np.int64)
        ids, slots = _frozen_copy(ids[::-1]), _frozen_copy(slots[::-1])
        for to_slots in (True, False):
            whole = ValidatedPlan.join(self._plans(to_slots, ids, slots, ())).whole
            if not np.array_equal(
                _maximal_runs(*self._batch(to_slots, ids, slots)),
                _maximal_runs(whole.src, whole.dst),
            ):
                raise PlanError(
                    f"the tiled {'gather' if to_slots else 'scatter'} of {n} chunks of "
                    f"{bpc} blocks differs from its CHUNK plan on this layout"
                )

    def _batch(
        self, to_slots: bool, ids: Int64Array, slots: Int64Array
    ) -> tuple[DescriptorList, DescriptorList]:
        """The move's batch: the one-block template copied to each (block, slot block), chunk
        by chunk, continuing runs merged, vouched by
        :meth:`~kvplane.transports.checks.Tiles.batch` (the template was validated once, and
        copies at distinct blocks and slots proved disjoint and in bounds with it)."""
        tiles = self._tiles[to_slots]
        if to_slots:
            batch = tiles.batch(ids, slots, ("block ids", "slots"))
        else:
            batch = tiles.batch(slots, ids, ("slots", "block ids"))
        return batch.src, batch.dst

    def _plans(
        self, to_slots: bool, ids: Int64Array, slots: Int64Array, keys: tuple[ChunkKey, ...]
    ) -> list[ValidatedPlan]:
        """One plan over the whole slot buffer; with padded slots one per chunk (a slot's
        padding is no block of any layout), each slot a one-chunk pool at its :meth:`run`."""
        bpc, region = self.spec.blocks_per_chunk, self.slots_region
        if not self.slots.padded or not slots.size:  # (no chunk: one empty plan)
            host = (slots[:, None] * bpc + np.arange(bpc, dtype=np.int64)[None, :]).ravel()
            return [self._plan(to_slots, ids, PlanSide(self.slot_layout, host, region), keys)]
        local = np.arange(bpc, dtype=np.int64)
        return [
            self._plan(
                to_slots,
                ids[i * bpc : (i + 1) * bpc],
                PlanSide(self.slot_layout, local, region, self.slots.run(s)[0]),
                keys[i : i + 1],
            )
            for i, s in enumerate(slots.tolist())
        ]

    def _plan(
        self, to_slots: bool, ids: Int64Array, host: PlanSide, keys: tuple[ChunkKey, ...]
    ) -> ValidatedPlan:
        """The chunks of ``ids`` laid end to end as one sequence, CHUNK-grouped, validated."""
        pool = PlanSide(self.pool, ids, self.pool_region)
        src, dst = (pool, host) if to_slots else (host, pool)
        plan = plan_transfer(
            src,
            dst,
            TokenRange(0, len(ids) * self.spec.block_size),
            options=PlanOptions(grouping=OpGrouping.CHUNK, chunk_spec=self.spec, chunk_keys=keys),
        )
        return plan.validate(
            {src.region: self._lengths[src.region]}, {dst.region: self._lengths[dst.region]}
        )


def _maximal_runs(src: DescriptorList, dst: DescriptorList) -> Int64Array:
    """A batch's byte mapping as its maximal runs in source order, rows ``(src region, src
    offset, dst region, dst offset, length)``: equal for two batches with disjoint sources
    exactly when they move the same bytes to the same places, however their runs are cut."""
    order = np.lexsort((src.offsets, src.regions))
    sr, so, ln = src.regions[order], src.offsets[order], src.lengths[order]
    dr, do = dst.regions[order], dst.offsets[order]
    ends = so[:-1] + ln[:-1]
    cont = (
        (sr[1:] == sr[:-1]) & (so[1:] == ends) & (dr[1:] == dr[:-1]) & (do[1:] == do[:-1] + ln[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~cont))) if len(sr) else np.zeros(0, np.int64)
    lengths = np.add.reduceat(ln, starts) if len(sr) else ln
    return np.stack([sr[starts], so[starts], dr[starts], do[starts], lengths], axis=1)


def _frozen_copy(values: Int64Array) -> Int64Array:
    """A read-only int64 copy of ``values`` (a few hundred nanoseconds for a move's ids)."""
    out = np.array(values, dtype=np.int64, copy=True)
    out.setflags(write=False)
    return out
