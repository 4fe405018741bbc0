"""Chunk moves as plans: pool blocks <-> the chunk slots of a slot buffer, one op per chunk.

:class:`ChunkPlans` describes a buffer of chunk slots (:class:`SlotBuffer`: a host tier's slots,
each chunk stored block-major in the layout's canonical order) as a layout and builds the
validated :class:`~kvplane.transfer.plan.TransferPlan` s of gathers (pool -> slots) and scatters
(slots -> pool) with :func:`~kvplane.transfer.planner.plan_transfer`'s CHUNK grouping, the one
place a chunk becomes byte runs. A move's one transport batch is the planner's validated
one-block template shifted by whole blocks and slots, proved by ``check_batch``; its CHUNK plan
is built when asked for. It plans only: it holds no tensor and moves no byte.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey, RegionId, TokenRange
from kvplane.layout import BLOCK_MAJOR, Axis, KVLayout
from kvplane.transfer.plan import ValidatedPlan
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanSide
from kvplane.transports.base import DescriptorList, Int64Array
from kvplane.transports.checks import check_batch
from kvplane.transports.copier import coalesce

CACHE_DESCRIPTORS = 1 << 18
"""Descriptors of the moves remembered (~100 bytes each with their proof and facts), least
recently used first out: a move planned again costs a lookup; a new one ~30-60 us per chunk
for its op objects, plus ~1 ms of planning and validation."""


@dataclass(frozen=True, slots=True)
class SlotBuffer:
    """``num_slots`` chunk slots in region ``region``, slot ``s`` at byte ``s * slot_stride``
    (``slot_stride`` >= one chunk's bytes; more when slots are padded)."""

    region: RegionId
    num_slots: int
    slot_stride: int


class ChunkMove:
    """One gather or scatter: the one transport batch that runs it (``src``/``dst``: every
    chunk's runs in chunk order, continuing runs merged, vouched by ``check_batch``, so a
    move submitted again is not checked again) and, built on first use, its validated
    CHUNK-grouped :attr:`plan`, which moves exactly the batch's bytes."""

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
    (at offset 0 of region ``pool_region``) and ``slots``. Thread-safe."""

    def __init__(
        self,
        layout: KVLayout,
        pool_region: RegionId,
        slots: SlotBuffer,
        blocks_per_chunk: int,
        *,
        cache_descriptors: int = CACHE_DESCRIPTORS,
    ) -> None:
        self.spec = ChunkSpec(layout.block_size, blocks_per_chunk)
        chunk = blocks_per_chunk * layout.bytes_per_block
        if slots.slot_stride < chunk:
            raise InvalidArgumentError(
                f"slots {slots.slot_stride} bytes apart cannot hold chunks of {chunk} bytes"
            )
        # whole blocks move: a sliding window (a property of a sequence) has no say here
        self.pool = dataclasses.replace(layout, sliding_window=None)
        self.pool_region = pool_region
        self.slots = slots
        self._padded = slots.slot_stride != chunk
        host_blocks = blocks_per_chunk if self._padded else slots.num_slots * blocks_per_chunk
        self.slot_layout = dataclasses.replace(self.pool, num_blocks=host_blocks, order=BLOCK_MAJOR)
        """The slot buffer seen as a pool: one slot (padded slots) or all of them."""
        self._lengths = {
            pool_region: self.pool.pool_bytes,
            slots.region: slots.num_slots * slots.slot_stride,
        }
        self._template = self._one_block()
        self._cache_descriptors = cache_descriptors
        self._cache: OrderedDict[tuple[bool, bytes, bytes, tuple[ChunkKey, ...]], ChunkMove]
        self._cache = OrderedDict()
        self._cached = 0
        """Descriptors the cached moves hold."""
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
        """The cached move, or a new one: ``ids``/``slots`` int64, in range (the caller's
        check); ``keys`` one per chunk, or none. ``InvalidArgumentError`` for a repeated id or
        slot (a move reads and writes every byte once)."""
        bpc = self.spec.blocks_per_chunk
        if ids.size != slots.size * bpc or (keys and len(keys) != slots.size):
            raise InvalidArgumentError(
                f"{slots.size} chunks need {slots.size * bpc} block ids and no or "
                f"{slots.size} keys, got {ids.size} and {len(keys)}"
            )
        key = (to_slots, ids.tobytes(), slots.tobytes(), keys)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        for what, values in (("block ids", ids), ("slots", slots)):  # a new move: check it
            uniq, counts = np.unique(values, return_counts=True)
            if len(uniq) != len(values):
                raise InvalidArgumentError(f"{what} repeat {int(uniq[counts > 1][0])}")
        move = self._shifted(to_slots, ids, slots, keys)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = move
                self._cached += len(move.src)
            while self._cached > self._cache_descriptors and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached -= len(old.src)
        return move

    def _one_block(self) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The runs moving pool block 0 into slot 0's block 0 (pool offsets, slot offsets,
        lengths): the planner's plan, validated. Block ``b`` of the pool is these bytes
        ``b * stride(BLOCK)`` further on (a strided layout), block ``j`` of slot ``s``
        ``s * slot_stride + j * bytes_per_block`` further (the slots are block-major)."""
        one = np.zeros(1, dtype=np.int64)
        plan = plan_transfer(
            PlanSide(self.pool, one, self.pool_region),
            PlanSide(self.slot_layout, one, self.slots.region),
            TokenRange(0, self.spec.block_size),
        ).validate(self._lengths, self._lengths)
        src, dst = plan.whole.src, plan.whole.dst
        return src.offsets, dst.offsets, src.lengths

    def _shifted(
        self, to_slots: bool, ids: Int64Array, slots: Int64Array, keys: tuple[ChunkKey, ...]
    ) -> ChunkMove:
        """The move's batch: the one-block template shifted to each (block, slot block),
        chunk by chunk, merged where runs continue, then proved by ``check_batch`` (pairing,
        bounds, nothing written or read twice) -- the cheap part of validation; the planner's
        byte checksum was paid once, for the template."""
        t_pool, t_slot, t_len = self._template
        bpc, bpb = self.spec.blocks_per_chunk, self.pool.bytes_per_block
        pool_base = ids * self.pool.strides_bytes()[Axis.BLOCK]
        slot_base = (slots[:, None] * self.slots.slot_stride + np.arange(bpc) * bpb).ravel()
        pool = (pool_base[:, None] + t_pool[None, :]).ravel()
        slot = (slot_base[:, None] + t_slot[None, :]).ravel()
        lengths = np.tile(t_len, len(ids))
        p_regions = np.full(len(pool), self.pool_region, dtype=np.int64)
        s_regions = np.full(len(slot), self.slots.region, dtype=np.int64)
        pool_list = DescriptorList(p_regions, pool, lengths)
        slot_list = DescriptorList(s_regions, slot, pool_list.lengths)
        src, dst = (pool_list, slot_list) if to_slots else (slot_list, pool_list)
        src, dst = coalesce(src, dst)
        check_batch(src, dst, self._lengths, self._lengths, sources_disjoint=True)
        return ChunkMove(
            src, dst, lambda: ValidatedPlan.join(self._plans(to_slots, ids, slots, keys))
        )

    def _plans(
        self, to_slots: bool, ids: Int64Array, slots: Int64Array, keys: tuple[ChunkKey, ...]
    ) -> list[ValidatedPlan]:
        """One plan over the whole slot buffer; with padded slots one per chunk (a slot's
        padding is no block of any layout), each slot a one-chunk pool at its own offset."""
        bpc = self.spec.blocks_per_chunk
        if not self._padded or not slots.size:  # (no chunk: one empty plan)
            host = (slots[:, None] * bpc + np.arange(bpc, dtype=np.int64)[None, :]).ravel()
            side = PlanSide(self.slot_layout, host, self.slots.region)
            return [self._plan(to_slots, ids, side, keys)]
        local = np.arange(bpc, dtype=np.int64)
        stride = self.slots.slot_stride
        return [
            self._plan(
                to_slots,
                ids[i * bpc : (i + 1) * bpc],
                PlanSide(self.slot_layout, local, self.slots.region, int(s) * stride),
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
