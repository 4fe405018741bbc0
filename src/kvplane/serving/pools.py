"""One worker's KV memory: the paged KV pool, the whole-only pools, their regions and allocators.

Pool tensors, each one registered transport region: the paged KV pool (blocks handed out
through per-request block tables) or, for a model serving KV cache groups, one per group (each
with its own block allocator, a window group's with a null block, and hasher), then the model's
whole-only state pool if it has one, and the tail pool (a 32-byte record per request: first
token, prompt length, prompt digest). Whole-only pools share one slot allocator. Not
thread-safe: the worker loop owns it. See docs/serving.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from kvplane.blocks import BlockHasher, BlockPool
from kvplane.errors import BlockStateError, LayoutError
from kvplane.ids import BlockId, RegionId
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.pd.handshake import PROTOCOL_VERSION, LayoutInfo, PeerProfile, Placement
from kvplane.pipeline.advert import encode_advert
from kvplane.serving.producers.base import GroupedKVModel, KVModel, PoolTensor, kv_fingerprint
from kvplane.transports.base import Transport

TAIL_BYTES = 32
"""A tail record: first token (int64 LE), prompt length (int64 LE), :func:`prompt_digest`."""
DIGEST_BYTES = 16


def prompt_digest(token_ids: np.ndarray) -> bytes:
    """16-byte BLAKE2b digest of a prompt's token ids (as int64 LE): what the tail carries."""
    data = np.ascontiguousarray(token_ids, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


@dataclass(frozen=True, slots=True)
class TailRecord:
    """What a tail record says (all zeros: never written)."""

    first_token: int
    num_tokens: int
    digest: bytes


def _allocate(transport: Transport, layout: KVLayout) -> torch.Tensor:
    """A zeroed pool tensor, in transport memory when the transport allocates (``shm``), with
    every page touched now: a first touch in the middle of a transfer costs a page fault."""
    alloc = cast(Callable[[int], torch.Tensor] | None, getattr(transport, "allocate", None))
    if alloc is None:
        tensor = layout.allocate()
    else:
        tensor = alloc(layout.pool_bytes).view(layout.dtype).view(layout.shape)
    tensor.view(torch.uint8).fill_(0)
    return tensor


def placement_of(model: KVModel) -> Placement:
    """The :class:`Placement` ``model`` computes for (a rank producer's ``placement``); the
    default, one process holding the whole model, for any other."""
    placement = getattr(model, "placement", None)
    return placement if isinstance(placement, Placement) else Placement()


def _group_layouts(model: KVModel, layout: KVLayout) -> tuple[KVLayout, ...]:
    """The paged pools' layouts: ``layout`` alone, or one per KV cache group where ``model``
    serves several (:class:`GroupedKVModel`) and holds the whole model (a rank of a TP × PP
    placement keeps one pool of its layers)."""
    if not isinstance(model, GroupedKVModel) or placement_of(model) != Placement():
        return (layout,)
    groups = model.kv_groups(layout)
    return (layout,) if groups is None or groups.single else groups.layouts(layout)


class WorkerPools:
    """The pools of one worker (see the module docstring). ``num_slots`` bounds the number of
    requests in flight; ``head_range`` is the rank's TP range of KV heads (default all)."""

    def __init__(
        self,
        model: KVModel,
        transport: Transport,
        *,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        head_range: tuple[int, int] | None = None,
        hash_seed: int = 0,
        metrics: MetricsRegistry | None = None,
        name: str = "worker",
    ) -> None:
        self.model_id = model.model_id
        self.placement = placement_of(model)
        """Which rank of a TP × PP layout the pools hold (:func:`placement_of`)."""
        kv_layout = model.kv_layout(num_blocks, block_size, head_range)
        if kv_layout.whole_only:
            raise LayoutError("the KV pool of a worker must be paged, not whole-only")
        kv_layouts = _group_layouts(model, kv_layout)
        state_layout = model.state_layout(num_slots)
        tail_layout = KVLayout.state(
            num_slots=num_slots, num_layers=1, state_dim=TAIL_BYTES, dtype=torch.uint8
        )
        layouts = [*kv_layouts] + ([state_layout] if state_layout is not None else [])
        layouts.append(tail_layout)
        self.tensors = [_allocate(transport, lay) for lay in layouts]
        self.regions = [transport.register(t).region_id for t in self.tensors]
        self.layouts = layouts
        self.num_kv_pools = len(kv_layouts)
        """Paged pools: one per KV cache group (``layouts[:num_kv_pools]``), then whole-only."""
        k = self.num_kv_pools
        groups = zip(layouts[1:k], self.tensors[1:k], strict=True)
        self.kv = PoolTensor(layouts[0], self.tensors[0], tuple(PoolTensor(*g) for g in groups))
        """The paged KV pool (group 0's, holding groups 1..'s as ``kv.groups``)."""
        self.state = PoolTensor(layouts[k], self.tensors[k]) if state_layout is not None else None
        self.tail = PoolTensor(tail_layout, self.tensors[-1])
        nulls = [kv_layout.windowed] if k == 1 else [lay.window_of(lay.layer_ids[0]) is not None
                                                     for lay in kv_layouts]  # fmt: skip
        pools = tuple(
            BlockPool(num_blocks, block_size, metrics, name=f"{name}_kv{g or ''}", null_block=null)
            for g, null in enumerate(nulls)
        )
        self.blocks, self.group_blocks = pools[0], pools[1:]
        """The KV pool's blocks (group 0's; ``group_blocks``: groups 1..'s); a windowed pool
        reserves a null block for the entries of blocks dropped out of every window
        (:meth:`~kvplane.blocks.BlockTable.drop_before`)."""
        self.slots = BlockPool(num_slots, 1, metrics, name=f"{name}_slots")
        hashers = tuple(
            BlockHasher(seed=hash_seed, fingerprint=kv_fingerprint(self.model_id, lay))
            for lay in kv_layouts
        )
        self.hasher, self.group_hashers = hashers[0], hashers[1:]
        """The worker's block hasher (group 0's; ``group_hashers``: groups 1..'s): every
        request's :class:`~kvplane.blocks.BlockTable` of a group hashes its blocks once with it,
        and prefix offload's chunk keys are those hashes."""
        self.transport_name = transport.name
        self._transport = transport

    @property
    def block_pools(self) -> tuple[BlockPool, ...]:
        """One block allocator per paged pool (KV cache group), in group order."""
        return (self.blocks, *self.group_blocks)

    @property
    def hashers(self) -> tuple[BlockHasher, ...]:
        return (self.hasher, *self.group_hashers)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Every layer the paged pools hold, ascending."""
        return tuple(sorted(i for kv in self.kv.pools for i in kv.layout.layer_ids))

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests, in every paged pool together."""
        return sum(p.num_used_blocks for p in self.block_pools)

    # -- what peers learn ------------------------------------------------------------------------
    def profile(self) -> PeerProfile:
        """What PD peers learn: every pool's layout and :attr:`placement` (a TP or PP rank is
        then judged as one member of a receiver's gather, not as a partial 1:1 sender)."""
        infos = tuple(
            LayoutInfo.from_description(
                lay.describe(),
                compat_fingerprint=lay.compat_fingerprint(),
                fingerprint=lay.fingerprint(),
                geometry_fingerprint=lay.geometry_fingerprint(),
            )
            for lay in self.layouts
        )
        return PeerProfile(
            protocol_version=PROTOCOL_VERSION,
            model_id=self.model_id,
            layouts=infos,
            placement=self.placement,
        )

    def advert(self) -> bytes:
        """The ``Hello.transport_metadata`` blob (call after every pool is registered)."""
        pools = list(zip(self.layouts, self.regions, strict=True))
        return encode_advert(self.transport_name, self._transport.metadata(), pools)

    def local_regions(self) -> dict[RegionId, int]:
        return {
            r: t.numel() * t.element_size() for r, t in zip(self.regions, self.tensors, strict=True)
        }

    # -- slots and tail records ------------------------------------------------------------------
    def take_slot(self) -> int | None:
        """A free whole-only slot (zeroed in every whole-only pool), or None when all are taken."""
        got = self.slots.allocate(1)
        if got is None:
            return None
        slot = int(got[0])
        k = self.num_kv_pools
        for lay, t in zip(self.layouts[k:], self.tensors[k:], strict=True):
            lay.canonical_view(t)[slot].zero_()
        return slot

    def free_slot(self, slot: int) -> None:
        self.slots.free([BlockId(slot)])

    def write_tail(self, slot: int, first_token: int, token_ids: np.ndarray) -> None:
        """The tail record of a prompt (``token_ids``) whose first sampled token is given."""
        words = np.array([first_token, len(token_ids)], dtype="<i8").view(np.uint8)
        digest = np.frombuffer(prompt_digest(token_ids), dtype=np.uint8)
        self._tail_row(slot).copy_(torch.from_numpy(np.concatenate([words, digest])))

    def read_tail(self, slot: int) -> TailRecord:
        raw = self._tail_row(slot).numpy().copy()
        words = raw[:16].view("<i8")
        return TailRecord(int(words[0]), int(words[1]), raw[16:].tobytes())

    def _tail_row(self, slot: int) -> torch.Tensor:
        return self.tail.layout.canonical_view(self.tail.tensor)[slot, 0, 0, 0, 0, :]

    # -- integrity -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        for pool in self.block_pools:
            pool.check_integrity()
        self.slots.check_integrity()

    def check_idle(self) -> None:
        """Integrity plus: no block and no slot is held by any request."""
        self.check_integrity()
        used = (self.num_used_blocks, self.slots.num_used_blocks)
        if used != (0, 0):
            raise BlockStateError(f"pools still hold {used[0]} KV blocks and {used[1]} slots")
