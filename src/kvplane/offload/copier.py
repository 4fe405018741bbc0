"""Device <-> host chunk copies: gather pool blocks into host slots and scatter them back.

A :class:`ChunkCopier` runs every gather and scatter as validated transfer plans
(:class:`~kvplane.transfer.chunk_plans.ChunkPlans`: one op per chunk, annotated with its key when
the caller gives keys) on its own in-process ``local`` transport, where the pool and the host
tier's slot buffer are two registered regions; the transport owns the copy paths (C run copier,
copy threads, device staging for a GPU pool). The copier checks arguments and waits for the
batch; it never addresses bytes itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvplane.errors import InvalidArgumentError, TransportError
from kvplane.ids import ChunkKey, SlotId
from kvplane.layout import KVLayout
from kvplane.offload.jobs import BlockIds, check_block_ids
from kvplane.offload.tiers.host import HostTier
from kvplane.transfer.chunk_plans import ChunkMove, ChunkPlans
from kvplane.transports.base import XferKind, XferState
from kvplane.transports.local import LocalTransport


class ChunkCopier:
    """Moves chunks of ``blocks_per_chunk`` blocks between ``pool`` (laid out as ``layout``)
    and the slots of ``host`` (``InvalidArgumentError`` unless a slot holds one chunk, or for a
    STATE pool). Not thread-safe per direction; gather and scatter may overlap.
    ``staging_blocks``: device staging per copy step of a GPU pool. :meth:`close` stops its
    copy helper threads (started on first use)."""

    def __init__(
        self,
        layout: KVLayout,
        pool: torch.Tensor,
        host: HostTier,
        blocks_per_chunk: int,
        staging_blocks: int = 256,
    ) -> None:
        layout.check_pool(pool)
        if layout.whole_only:
            raise InvalidArgumentError("a STATE pool moves whole, not in chunks of blocks")
        self.layout = layout
        self.host = host
        self.blocks_per_chunk = blocks_per_chunk
        self.transport = LocalTransport(
            agent="offload-copier",
            history=16,
            stage_bytes=max(1, staging_blocks) * layout.bytes_per_block,
        )
        pool_region = self.transport.register(pool).region_id
        slots_region = self.transport.register(host.buffer).region_id
        self._peer = self.transport.connect(self.transport.metadata())  # loopback
        self.plans = ChunkPlans(layout, pool_region, slots_region, host.slots, blocks_per_chunk)

    def _check(
        self, block_ids: BlockIds, slots: Sequence[SlotId]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Both as int64 arrays: 1-D integer sequences (:func:`check_block_ids`), in range,
        ``blocks_per_chunk`` ids per slot; ``InvalidArgumentError`` before any copy otherwise
        (a repeated id or slot too, when the move is planned)."""
        ids = check_block_ids(block_ids, self.layout.num_blocks)
        sl = check_block_ids(slots, self.host.num_slots, "host slots")
        if ids.size != sl.size * self.blocks_per_chunk:
            raise InvalidArgumentError(
                f"{sl.size} chunks need {sl.size * self.blocks_per_chunk} block ids, got {ids.size}"
            )
        return ids, sl

    def gather(
        self, block_ids: BlockIds, slots: Sequence[SlotId], keys: Sequence[ChunkKey] = ()
    ) -> None:
        """Copy pool blocks ``block_ids`` (chunk-major: chunk ``i`` is ids ``i*bpc..``) into
        host ``slots`` (``keys``: the chunks' keys, annotating the plan; optional). Reads the
        pool, writes only those slots; the caller holds the slots STORING and keeps the blocks
        from reuse (the fence) until this returns."""
        ids, sl = self._check(block_ids, slots)
        self._run(self.plans.gather(ids, sl, keys))

    def scatter(
        self, slots: Sequence[SlotId], block_ids: BlockIds, keys: Sequence[ChunkKey] = ()
    ) -> None:
        """Copy host ``slots`` into pool blocks ``block_ids`` (chunk-major). Writes only those
        blocks; the caller holds the slots pinned (LOADING) and owns the blocks."""
        ids, sl = self._check(block_ids, slots)
        self._run(self.plans.scatter(sl, ids, keys))

    def _run(self, move: ChunkMove) -> None:
        """Every op of ``move`` in its one batch on the local transport, synchronously
        (checked at its first submit only); ``TransportError`` unless DONE."""
        if not len(move.src):
            return
        handle = self.transport.submit(XferKind.WRITE, move.src, move.dst, self._peer)
        got = self.transport.poll(handle)
        if got.state is not XferState.DONE:
            raise TransportError(f"chunk copy ended {got.state.value}: {got.reason}")

    def close(self) -> None:
        """Stop the copy helper threads; later copies run on the calling thread only."""
        self.transport.stop_copy_threads()
