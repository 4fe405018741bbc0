"""One prefill rank of a TP × PP layout over a real model, by simulation.

:class:`RankProducer` does NOT shard the model's compute. It runs the whole model (every
head, every layer) into a full-layout *shadow* pool that mirrors the rank pool's block ids, then
keeps this rank's share in the rank pool: its TP heads (``tp_head_range``) and its pipeline
stage's layers (``Parallelism.pipeline``, both in :mod:`kvplane.transfer.resharding`). The models
run all layers in one call, with no hidden-state hand-off between stages, so a stage computes
every layer and keeps its own. The KV bytes are exactly a real rank's share of the one-process
model's KV; the compute and the shadow's memory are those of one whole process.
"""

from __future__ import annotations

import torch

from kvplane.errors import ConfigError, LayoutError, PlanError, UnsupportedError
from kvplane.ids import RequestId
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.models import PagedDecoder, PagedKVCache
from kvplane.models.bamba import BambaModel
from kvplane.pd.handshake import Placement
from kvplane.serving.producers.base import PoolTensor, ProduceStep, StepOutput
from kvplane.serving.producers.model import ModelProducer, ModelSpec
from kvplane.transfer.resharding import Parallelism


class RankProducer(ModelProducer):
    """:class:`~kvplane.serving.producers.base.KVProducer` of rank ``placement`` (module
    docstring). The shadow holds only what this producer computed: a request whose first step
    starts after KV this producer did not compute (a prefix loaded from an offload tier) is
    refused (``UnsupportedError``) before anything is written."""

    def __init__(self, model: PagedDecoder, model_id: str, placement: Placement) -> None:
        if isinstance(model, BambaModel):  # the state is per request, not per head or layer
            raise UnsupportedError(
                f"model {model_id} has recurrent (Mamba2) state: TP/PP prefill ranks of a "
                "hybrid model are not supported (serve it with one prefill process)"
            )
        super().__init__(model, model_id)
        self.placement = placement
        self._shadow: PagedKVCache | None = None
        self._open: set[RequestId] = set()
        try:
            self.kv_layout(1, 1)
        except (LayoutError, PlanError) as exc:
            at = placement
            raise ConfigError(
                f"TP rank {at.tp_rank} of {at.tp_size}, stage {at.pp_stage} of {at.pp_size} of "
                f"model {model_id}: {exc}"
            ) from None

    @classmethod
    def for_rank(
        cls, spec: ModelSpec, placement: Placement, metrics: MetricsRegistry | None = None
    ) -> RankProducer:
        return cls(spec.load(metrics), spec.identity(), placement)

    def kv_layout(
        self, num_blocks: int, block_size: int, head_range: tuple[int, int] | None = None
    ) -> KVLayout:
        """The rank pool: this rank's TP heads × its stage's layers. ``ConfigError`` when
        ``head_range`` is given and is not this rank's."""
        full = self.model.kv_layout(num_blocks, block_size)
        at = self.placement
        even = Parallelism.pipeline(
            tp_size=at.tp_size, num_layers=full.num_layers, pp_size=at.pp_size,
            block_size=block_size,
        )  # fmt: skip
        stages = tuple(tuple(full.layer_ids[i] for i in stage) for stage in even.stages)
        side = Parallelism(at.tp_size, stages, block_size)  # the model's own layer ids
        layout = side.rank_layout(full, at.pp_stage, at.tp_rank, num_blocks)
        if head_range is not None and tuple(head_range) != layout.head_range:
            raise ConfigError(
                f"TP rank {at.tp_rank} of {at.tp_size} holds heads {layout.head_range} of "
                f"model {self.model_id}, not {tuple(head_range)}"
            )
        return layout

    def shadow_bytes(self, num_blocks: int, block_size: int) -> int:
        """Bytes of the full-layout shadow a rank pool of ``num_blocks`` keeps beside it (what
        a start-up memory check must count on top of the rank pool)."""
        return self.model.kv_layout(num_blocks, block_size).pool_bytes

    def _shadow_for(self, rank: KVLayout) -> PagedKVCache:
        """The full-layout shadow of a pool of ``rank``'s size (allocated on first use)."""
        shadow = self._shadow
        if shadow is None or shadow.num_blocks != rank.num_blocks:
            shadow = PagedKVCache(self.model.kv_layout(rank.num_blocks, rank.block_size))
            self._shadow = shadow
        return shadow

    def produce(self, step: ProduceStep, kv: PoolTensor, state: PoolTensor | None) -> StepOutput:
        """Compute ``step.tokens`` with the whole model into the shadow, then copy this rank's
        share of exactly those positions into ``kv`` (mutates only those slots of ``kv``); the
        last step returns the greedy first token."""
        shadow = self._shadow_for(kv.layout)
        rng = step.tokens
        if rng.start > 0 and step.request_id not in self._open:
            slots = _slots(step, kv.layout.block_size, 0, rng.start)
            if not torch.equal(self._share(shadow, kv.layout, slots), _rank(kv)[slots]):
                raise UnsupportedError(
                    f"request {step.request_id!r}: the KV of [0, {rng.start}) in the rank pool "
                    "was not computed by this rank producer (a loaded prefix?): its shadow lacks "
                    "the other ranks' heads and layers"
                )
        out = super().produce(step, PoolTensor(shadow.layout, shadow.pool), None)
        slots = _slots(step, kv.layout.block_size, rng.start, rng.end)
        _rank(kv)[slots] = self._share(shadow, kv.layout, slots)
        if step.is_last:
            self._open.discard(step.request_id)
        else:
            self._open.add(step.request_id)
        return out

    @staticmethod
    def _share(
        shadow: PagedKVCache, rank: KVLayout, slots: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """The shadow's ``[tokens, layers, comps, heads, dim]`` at ``slots``, cut to ``rank``'s
        layers and heads (a copy)."""
        layers = torch.tensor([shadow.layout.layer_index(i) for i in rank.layer_ids])
        lo, hi = rank.head_range
        return _token_major(shadow.layout, shadow.pool)[slots][:, layers][:, :, :, lo:hi]


def _token_major(layout: KVLayout, pool: torch.Tensor) -> torch.Tensor:
    """Zero-copy ``[blocks, tokens, layers, comps, heads, dim]`` view of ``pool``."""
    return layout.canonical_view(pool).permute(0, 3, 1, 2, 4, 5)


def _rank(kv: PoolTensor) -> torch.Tensor:
    return _token_major(kv.layout, kv.tensor)


def _slots(
    step: ProduceStep, block_size: int, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block ids, offsets)`` of positions ``[start, end)`` of ``step``'s request."""
    pos = torch.arange(start, end)
    return torch.as_tensor(step.block_ids, dtype=torch.long)[pos // block_size], pos % block_size
