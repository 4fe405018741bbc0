"""The plug-in points of the PD workers: what computes KV (prefill) and what consumes it (decode).

:class:`KVProducer`, :class:`KVDecoder`, their inputs and :func:`kv_fingerprint`. See
docs/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from kvplane.blocks import BlockPool, BlockTable
from kvplane.ids import RequestId, TokenRange
from kvplane.layout import KVLayout
from kvplane.models.kv_groups import KVGroups


@dataclass(frozen=True, slots=True)
class PoolTensor:
    """A pool tensor with its layout (``layout.check_pool(tensor)`` holds); views, not copies.
    ``groups``: a paged pool of a model with several KV cache groups is group 0's, and holds
    groups 1..'s pools here (each over its group's layers; see docs/attention.md)."""

    layout: KVLayout
    tensor: torch.Tensor
    groups: tuple[PoolTensor, ...] = ()

    def __post_init__(self) -> None:
        self.layout.check_pool(self.tensor)

    @property
    def pools(self) -> tuple[PoolTensor, ...]:
        """One pool per KV cache group, in group order (this one alone without groups)."""
        return (self, *self.groups)


@dataclass(frozen=True, slots=True)
class ProduceStep:
    """One prefill step of one request.

    ``token_ids``: int64 ``[N]`` read-only, the whole prompt. ``block_ids``: the request's blocks
    in the prefill pool, holding positions ``[0, N)``. ``tokens``: the positions this step
    computes. ``state_slot``: the request's slot in the state pool (None without one).
    ``group_block_ids``: with KV cache groups, the blocks of groups 1.. (``block_ids`` are
    group 0's), each holding ``[0, N)`` in its group's pool.
    """

    request_id: RequestId
    token_ids: np.ndarray
    block_ids: tuple[int, ...]
    tokens: TokenRange
    is_last: bool
    state_slot: int | None = None
    group_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step returns: the first sampled token, exactly on the last step."""

    first_token: int | None = None


@dataclass(frozen=True, slots=True)
class DecodeJob:
    """A request whose KV has arrived: ``table`` (ADMITTED in ``pool``) holds the prompt's
    blocks; ``received`` is the range that moved (``[0, received.start)`` came from the decode
    pool's prefix cache). The worker alone marks the received prompt computed (caching its full
    blocks; not in sliding-window pools): before ``decode`` for a decoder that does not verify,
    so such a decoder finds the whole prompt computed and may grow ``table`` through ``pool``;
    after a verifying decoder's ``decode`` that counted no mismatches. The worker releases the
    table afterwards. With KV cache groups, ``table``/``pool`` are group 0's and
    ``group_tables``/``group_pools`` groups 1..'s (a window group's holding only its window)."""

    request_id: RequestId
    token_ids: np.ndarray
    table: BlockTable
    pool: BlockPool
    first_token: int
    max_new_tokens: int
    received: TokenRange
    state_slot: int | None = None
    group_tables: tuple[BlockTable, ...] = ()
    group_pools: tuple[BlockPool, ...] = ()

    @property
    def tables(self) -> tuple[tuple[BlockTable, BlockPool], ...]:
        """Each KV cache group's table and the block pool it holds blocks of, in group order."""
        return tuple(
            zip((self.table, *self.group_tables), (self.pool, *self.group_pools), strict=True)
        )


@dataclass(frozen=True, slots=True)
class DecodeOutput:
    """Generated tokens (starting with the first token) and, for a verifying decoder, how many
    KV elements / state bytes / token values differed from what the producer made (else None)."""

    tokens: tuple[int, ...]
    mismatches: int | None = None


@runtime_checkable
class KVModel(Protocol):
    """How a model's KV is laid out; both sides of a PD pair must agree (handshake)."""

    @property
    def model_id(self) -> str: ...

    def kv_layout(
        self, num_blocks: int, block_size: int, head_range: tuple[int, int] | None = None
    ) -> KVLayout:
        """The paged pool of ``num_blocks`` blocks (the rank's TP ``head_range``, default all)."""
        ...

    def state_layout(self, num_slots: int) -> KVLayout | None:
        """The whole-only per-request state pool (recurrent state), or None."""
        ...


@runtime_checkable
class GroupedKVModel(KVModel, Protocol):
    """Optional: a model that computes and reads one paged pool per KV cache group."""

    def kv_groups(self, layout: KVLayout) -> KVGroups | None:
        """The KV cache groups of a pool of ``layout`` this model serves one pool each, or None
        (one pool of every layer: a one-window model, or one serving a single pool)."""
        ...


@runtime_checkable
class KVProducer(KVModel, Protocol):
    """Computes KV step by step into the prefill pool (see the module docstring)."""

    def produce(self, step: ProduceStep, kv: PoolTensor, state: PoolTensor | None) -> StepOutput:
        """Write the KV of ``step.tokens`` into ``kv`` (a pool of :meth:`kv_layout`) at
        ``step.block_ids``; on the last step fill ``state`` at ``step.state_slot`` and return the
        first token. Mutates only those slots. A recurrent model (a hybrid) keeps the slot's
        state current after every step (the worker snapshots it at chunk boundaries for prefix
        offload) and takes, at a step starting at ``s > 0``, the slot as holding the state after
        ``s`` tokens (its own previous step's, or one restored with a loaded prefix)."""
        ...


@runtime_checkable
class KVDecoder(KVModel, Protocol):
    """Continues a request from received KV (see the module docstring)."""

    @property
    def verifies(self) -> bool:
        """True for a decoder that checks the received KV (its ``mismatches`` decide whether
        the worker caches the prompt's blocks) rather than generating from it."""
        ...

    def decode(self, job: DecodeJob, kv: PoolTensor, state: PoolTensor | None) -> DecodeOutput:
        """Generate up to ``job.max_new_tokens`` tokens starting with ``job.first_token`` (see
        :class:`DecodeJob` for what is marked computed when)."""
        ...


def kv_fingerprint(model_id: str, layout: KVLayout) -> bytes:
    """Model identity + pool layout: what a worker's block hashes (and chunk keys) commit to."""
    return b"model:" + model_id.encode() + b"\0layout:" + layout.fingerprint()
