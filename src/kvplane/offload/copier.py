"""Device <-> host chunk copies: gather pool blocks into host slots and scatter them back.

Theory of operation
-------------------
A chunk is ``blocks_per_chunk`` blocks of one pool; in a host slot it is stored block-major in
the layout's canonical order, ``[bpc, layers, comps, tokens, heads, dim]``, whatever the pool's
memory order (the layout fingerprint in stored headers names that order too). The copier views
the pool through :meth:`KVLayout.canonical_view` (zero-copy) and moves whole blocks along its
BLOCK axis:

- per run of consecutive host slots (a fresh tier hands out consecutive slots, so usually one
  per job), and inside it per run of consecutive *device* block ids, one slice ``copy_``
  (memcpy speed);
- when device ids are too scattered for that to pay (average run under :data:`MIN_RUN`
  blocks), one ``torch.index_select(pool_view, 0, ids, out=host_run)`` (gather, store) or
  ``pool_view.index_copy_(0, ids, host_run)`` (scatter, load) per host run instead. CPU
  ``index_copy_`` is an element loop, several times slower than memcpy, hence the run split;
  on a GPU both index ops are used directly.

A CPU pool whose canonical view is its memory order (blocks back to back) skips torch: the
blocks of a host run are byte runs of the pool, moved by the transports' C run copier
(:func:`~kvplane.transports.native_copy.copy_runs_native`: ``memcpy`` per block, streaming
stores for large moves, split with the copier's own :class:`CopyWorkers`). The job thread
then starts no OpenMP team of its own to fight the application's, and a chunk store or load
runs at memcpy speed or better. Without a C compiler the torch paths below do it.

Tensors are viewed as the widest integer type dividing a DIM row (``int64`` for any usual
head size), which keeps the copies dtype-agnostic (fp8 included) and ``index_copy_`` fast.
A pool on a GPU goes through preallocated device staging buffers (one for each direction, so a
store and a load can run on two job threads at once) and a synchronous copy to host memory.
There is no Python loop per block per layer: loops are per run of slots or of block ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvplane.blocks.table import consecutive_runs
from kvplane.errors import InvalidArgumentError
from kvplane.ids import SlotId
from kvplane.layout import KVLayout
from kvplane.offload.jobs import BlockIds, check_block_ids
from kvplane.offload.tiers.host import HostTier
from kvplane.transports.native_copy import copy_runs_native, kernel
from kvplane.transports.workers import CopyWorkers

MIN_RUN = 4
"""Average device-block run length from which per-run slice copies beat ``index_copy_``."""

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class ChunkCopier:
    """Moves chunks of ``blocks_per_chunk`` blocks between ``pool`` (laid out as ``layout``)
    and the slots of ``host``. Not thread-safe per direction; gather and scatter may overlap.
    :meth:`close` stops its copy helper threads (started on first use)."""

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
        if host.chunk_bytes != blocks_per_chunk * layout.bytes_per_block:
            raise InvalidArgumentError(
                f"host slots hold {host.chunk_bytes} bytes but a chunk of {blocks_per_chunk} "
                f"blocks is {blocks_per_chunk * layout.bytes_per_block}"
            )
        row = layout.head_dim * layout.element_size
        self._dtype = next(dt for size, dt in _WIDE if row % size == 0)
        self.layout = layout
        self.host = host
        self.blocks_per_chunk = blocks_per_chunk
        self._view = layout.canonical_view(pool).view(self._dtype)
        self._block_shape = tuple(self._view.shape[1:])
        self._on_cpu = pool.device.type == "cpu"
        self._staging: tuple[torch.Tensor, torch.Tensor] | None = None
        self._flat: torch.Tensor | None = None
        """The pool as flat bytes, when its blocks lie back to back (the native run path)."""
        self._workers = CopyWorkers(name="kvplane-offload-copy")
        if self._on_cpu and self._view.is_contiguous() and kernel().library is not None:
            self._flat = self._view.reshape(-1).view(torch.uint8)
        if not self._on_cpu:
            shape = (staging_blocks, *self._block_shape)
            self._staging = (
                torch.empty(shape, dtype=self._dtype, device=pool.device),
                torch.empty(shape, dtype=self._dtype, device=pool.device),
            )

    # -- validation ----------------------------------------------------------------------------
    def _check(
        self, block_ids: BlockIds, slots: Sequence[SlotId]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Both as int64 arrays: 1-D integer sequences (:func:`check_block_ids`), in range and
        ``blocks_per_chunk`` ids per slot; ``InvalidArgumentError`` before any copy otherwise."""
        ids = check_block_ids(block_ids, int(self._view.shape[0]))
        sl = check_block_ids(slots, self.host.num_slots, "host slots")
        if ids.size != sl.size * self.blocks_per_chunk:
            raise InvalidArgumentError(
                f"{sl.size} chunks need {sl.size * self.blocks_per_chunk} block ids, got {ids.size}"
            )
        return ids, sl

    def _host_runs(self, sl: npt.NDArray[np.int64]) -> list[tuple[int, int, torch.Tensor]]:
        """``(chunk start, chunk stop, host bytes)`` per run of slots (flat ``uint8``)."""
        if not self.host.contiguous_slots:
            return [(i, i + 1, self.host.slot(SlotId(int(sl[i])))) for i in range(sl.size)]
        return [(a, b, self.host.run(SlotId(int(sl[a])), b - a)) for a, b in consecutive_runs(sl)]

    def _blocks_view(self, raw: torch.Tensor) -> torch.Tensor:
        """Host bytes seen as ``[blocks, *block_shape]`` of the copy dtype."""
        return raw.view(self._dtype).view(-1, *self._block_shape)

    def _native(self, part: npt.NDArray[np.int64], raw: torch.Tensor, *, to_host: bool) -> bool:
        """Pool blocks ``part`` <-> host bytes ``raw`` (block ``i`` of the run at ``i * block
        bytes``) by the C run copier; False when the pool does not take that path."""
        if self._flat is None:
            return False
        block = self.layout.bytes_per_block
        pool_off = part * block
        host_off = np.arange(part.size, dtype=np.int64) * block
        lengths = np.full(part.size, block, dtype=np.int64)
        if to_host:
            return copy_runs_native(
                self._flat, pool_off, raw, host_off, lengths, workers=self._workers
            )
        return copy_runs_native(raw, host_off, self._flat, pool_off, lengths, workers=self._workers)

    # -- copies --------------------------------------------------------------------------------
    def gather(self, block_ids: BlockIds, slots: Sequence[SlotId]) -> None:
        """Copy pool blocks ``block_ids`` (chunk-major: chunk ``i`` is ids ``i*bpc..``) into
        host ``slots``. Reads the pool, writes only those slots; the caller holds the slots
        STORING and keeps the blocks from reuse (the fence) until this returns."""
        ids, sl = self._check(block_ids, slots)
        bpc = self.blocks_per_chunk
        for a, b, raw in self._host_runs(sl):
            part = ids[a * bpc : b * bpc]
            if self._native(part, raw, to_host=True):
                continue
            host = self._blocks_view(raw)
            if self._staging is not None:
                self._via_staging(torch.from_numpy(part), host, self._staging[0], to_host=True)
                continue
            runs = consecutive_runs(part)
            if len(runs) * MIN_RUN <= part.size:
                for s, e in runs:
                    first = int(part[s])
                    host[s:e].copy_(self._view[first : first + (e - s)])
            else:
                torch.index_select(self._view, 0, torch.from_numpy(part), out=host)

    def scatter(self, slots: Sequence[SlotId], block_ids: BlockIds) -> None:
        """Copy host ``slots`` into pool blocks ``block_ids`` (chunk-major). Writes only those
        blocks; the caller holds the slots pinned (LOADING) and owns the blocks."""
        ids, sl = self._check(block_ids, slots)
        bpc = self.blocks_per_chunk
        for a, b, raw in self._host_runs(sl):
            part = ids[a * bpc : b * bpc]
            if self._native(part, raw, to_host=False):
                continue
            host = self._blocks_view(raw)
            if self._staging is not None:
                self._via_staging(torch.from_numpy(part), host, self._staging[1], to_host=False)
                continue
            runs = consecutive_runs(part)
            if len(runs) * MIN_RUN <= part.size:
                for s, e in runs:
                    first = int(part[s])
                    self._view[first : first + (e - s)].copy_(host[s:e])
            else:
                self._view.index_copy_(0, torch.from_numpy(part), host)

    def _via_staging(
        self, idx: torch.Tensor, host: torch.Tensor, staging: torch.Tensor, *, to_host: bool
    ) -> None:
        step = staging.shape[0]
        dev_idx = idx.to(self._view.device)
        for s in range(0, idx.numel(), step):
            n = min(step, idx.numel() - s)
            stage = staging[:n]
            if to_host:
                torch.index_select(self._view, 0, dev_idx[s : s + n], out=stage)
                host[s : s + n].copy_(stage)
            else:
                stage.copy_(host[s : s + n])
                self._view.index_copy_(0, dev_idx[s : s + n], stage)
        torch.cuda.synchronize(self._view.device)

    def close(self) -> None:
        """Stop the copy helper threads; later copies run on the calling thread only."""
        self._workers.close()
