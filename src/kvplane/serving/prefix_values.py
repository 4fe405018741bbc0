"""The values of a prefill worker's prefix offload: its settings and what it answers.

Owns :class:`PrefixSettings` (checked once, before any tier or job thread exists), the
results :class:`LoadStarted`, :class:`LoadFinished` and :class:`StoreFinished`, and
:class:`PoolParts`, what one pool's load and store paths share (references only: no bytes moved
here). :mod:`~kvplane.serving.prefix_offload` re-exports the settings and results.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.ids import RequestId
from kvplane.metrics import MetricsRegistry
from kvplane.offload import OffloadConfig, TierCascade
from kvplane.offload.chunk_cost import TunedChunks
from kvplane.serving.prefix_waits import PENDING_WAIT_S, PrefixWaits, check_wait_s
from kvplane.validators import require_int


@dataclass(frozen=True, slots=True)
class PrefixSettings:
    """How a prefill worker offloads: the tiers (``offload``) and the host chunk size in
    blocks; ``tuned`` (a config's ``[tune.chunks]``) sets each tier's size from measurements
    (:meth:`~kvplane.offload.chunk_cost.TunedChunks.sizes`; a cold size set in ``offload``
    wins). ``pending_wait_s``: the longest an admitted request waits for this worker's own
    stores (in flight, or promised by a computing request) of its prefix (0: never waits; the
    rule of :func:`~kvplane.serving.prefix_waits.check_wait_s`)."""

    offload: OffloadConfig
    blocks_per_chunk: int = 2
    tuned: TunedChunks | None = None
    pending_wait_s: float = PENDING_WAIT_S

    def __post_init__(self) -> None:
        if not isinstance(self.offload, OffloadConfig):
            raise InvalidArgumentError(f"offload must be an OffloadConfig, got {self.offload!r}")
        require_int("PrefixSettings.blocks_per_chunk", self.blocks_per_chunk, min=1)
        if self.tuned is not None and not isinstance(self.tuned, TunedChunks):
            raise InvalidArgumentError(f"tuned must be a TunedChunks, got {self.tuned!r}")
        check_wait_s("PrefixSettings.pending_wait_s", self.pending_wait_s)

    def resolved(self, block_bytes: int) -> tuple[int, OffloadConfig]:
        """The host ``blocks_per_chunk`` and the tier config for blocks of ``block_bytes``."""
        if self.tuned is None:
            return self.blocks_per_chunk, self.offload
        host, disk, remote = self.tuned.sizes(block_bytes, self.blocks_per_chunk)
        off = self.offload
        return host, dataclasses.replace(
            off,
            disk_blocks_per_chunk=off.disk_blocks_per_chunk or disk,
            remote_blocks_per_chunk=off.remote_blocks_per_chunk or remote,
            disk_gbps=off.disk_gbps or self.tuned.disk_gbps,
            remote_gbps=off.remote_gbps or self.tuned.remote_gbps,
        )


@dataclass(frozen=True, slots=True)
class LoadStarted:
    """A submitted prefix load: how many chunks and from which tier each comes (``ticket_id``
    0 and no chunks: a hit wholly before its window, nothing to load, or, with ``waiting``
    chunks, a request parked until this worker's stores of them land)."""

    ticket_id: int
    chunks: int
    sources: tuple[str, ...]
    waiting: int = 0


@dataclass(frozen=True, slots=True)
class LoadFinished:
    """A request's prefix load ended: ``tokens`` leading tokens are now in its device blocks."""

    request_id: RequestId
    tokens: int
    chunks: int
    failed: int


@dataclass(frozen=True, slots=True)
class StoreFinished:
    """A request's chunks left the device (``stored`` of them reached the host tier); of KV
    cache group ``group``'s pool (0: the first group's, or the one pool's)."""

    request_id: RequestId
    stored: int
    group: int = 0


Finished = LoadFinished | StoreFinished


@dataclass(frozen=True, slots=True)
class PoolParts:
    """What one pool's :class:`~kvplane.serving.prefix_loads.PrefixLoads` and
    :class:`~kvplane.serving.prefix_stores.PrefixStores` share: its tier cascade and chunk
    spec, its prefix waits, its counters (each path adds its own counts) and the registry of
    its metrics."""

    cascade: TierCascade
    spec: ChunkSpec
    waits: PrefixWaits
    counts: Counter[str]
    registry: MetricsRegistry
