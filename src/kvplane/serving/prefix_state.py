"""The recurrent-state half of prefix offload, for a prefill worker with a state pool.

A hybrid model's prefix is only reusable with the state after it: after each prefill step that
ends on a chunk boundary, :meth:`PrefixState.snapshot` keeps the request's state slot under that
chunk's key (a :class:`~kvplane.offload.state_store.StateStore`: host LRU of the host tier's
slot count over lower tiers of its own, :func:`state_tiers`, re-indexed at start). A prefix
load is limited to the leading chunks that have a snapshot (a hit without its state is a miss)
and, once the KV is in, :meth:`PrefixState.restore` puts the state after the loaded chunks into
the request's slot. A chunk boundary inside a prefill step gets no snapshot (the state is only
exact at step ends: align the step size with the chunk). Not thread-safe: the worker loop owns
it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from kvplane.ids import ChunkKey
from kvplane.offload import OffloadConfig
from kvplane.offload.state_store import StateStore
from kvplane.offload.tiers.registry import open_lower_tiers
from kvplane.serving.producers.base import PoolTensor
from kvplane.validators import require_int


def state_tiers(offload: OffloadConfig) -> OffloadConfig:
    """The tier config of the state snapshots beside the KV tiers of ``offload``: the disk
    file ``<disk_path>.state``, the Redis namespace ``<remote_namespace>.state`` (same server,
    mode and replicas), raw (codecs are planned for KV layouts), one snapshot per slot."""
    return dataclasses.replace(
        offload,
        disk_path=None if offload.disk_path is None else Path(f"{offload.disk_path}.state"),
        remote_namespace=f"{offload.remote_namespace}.state",
        disk_codec="raw",
        remote_codec="raw",
        disk_blocks_per_chunk=0,
        remote_blocks_per_chunk=0,
    )


class PrefixState:
    """Snapshots and restores of one worker's state pool ``state`` (see the module docstring)."""

    def __init__(self, state: PoolTensor, tokens_per_chunk: int, offload: OffloadConfig) -> None:
        self.state = state
        self.tokens_per_chunk = require_int("tokens_per_chunk", tokens_per_chunk, min=1)
        layout = state.layout
        nbytes = layout.bytes_per_block  # one slot: every layer's row
        lower = open_lower_tiers(state_tiers(offload), nbytes, layout.fingerprint())
        try:
            self.store = StateStore(nbytes, offload.host_slots, lower)
        except BaseException:
            for tier in lower:
                tier.close()
            raise

    def _row(self, slot: int) -> torch.Tensor:
        """View ``[layers, 1, 1, 1, state_dim]`` of one slot of the state pool."""
        return self.state.layout.canonical_view(self.state.tensor)[slot]

    def snapshot(self, keys: Sequence[ChunkKey], slot: int, end: int) -> bool:
        """After a prefill step ending at ``end`` of a request whose full chunks have ``keys``
        and whose state is in ``slot``: on a chunk boundary, keep the state under that chunk's
        key. True when a snapshot was kept (on the host at least: a lower tier that fails is
        counted in ``store.counts["errors"]``, never raised)."""
        chunk, rest = divmod(end, self.tokens_per_chunk)
        if rest or not 0 < chunk <= len(keys):
            return False
        self.store.put(keys[chunk - 1], self._row(slot).contiguous())
        return True

    def loadable(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading chunks of ``keys`` have their state."""
        return self.store.held_run(keys)

    def restore(self, keys: Sequence[ChunkKey], chunks: int, slot: int) -> int:
        """Write the state after the first ``chunks`` chunks (their KV loaded) into ``slot``,
        or, when that snapshot is gone or corrupt, after the most chunks below it that have
        one. Returns how many chunks now come with their state (0: nothing written; compute
        the prompt from its start)."""
        for n in range(chunks, 0, -1):
            data = self.store.get(keys[n - 1])  # a tier that fails: counted, a miss
            if data is not None:
                row = self._row(slot)
                row.copy_(data.view(self.state.layout.dtype).view(row.shape))
                return n
        return 0

    def close(self) -> None:
        self.store.close()

    def check_integrity(self) -> None:
        self.store.check_integrity()
