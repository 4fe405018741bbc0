"""One prefill rank of a TP × PP layout over a real model, by simulation.

:class:`RankProducer` does NOT shard the model's compute. It runs the whole model (every
head, every layer) into a full-layout *shadow* pool that mirrors the rank pool's block ids, then
keeps this rank's share in the rank pool: its TP heads (``tp_head_range``) and its pipeline
stage's layers (``stage_layers``, both in :mod:`kvplane.transfer.resharding`). The models run
all layers in one call, with no hidden-state hand-off between stages, so a stage computes every
layer and keeps its own: exactly a real rank's share of the one-process model's KV; the compute
and the shadow's memory are those of one whole process. A hybrid (Bamba)'s state pool holds
the stage's Mamba layers, each row the TP rank's part (``StateSplit``), kept from a full shadow
state; TP must not replicate its KV heads (each rank must be in the gathers it has state for).
"""

from __future__ import annotations

import torch

from kvplane.errors import ConfigError, LayoutError, PlanError, UnsupportedError
from kvplane.ids import RequestId
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.models import PagedDecoder, PagedKVCache
from kvplane.models.bamba import BambaModel
from kvplane.models.recurrent import state_layout
from kvplane.pd.handshake import Placement
from kvplane.serving.producers.base import PoolTensor, ProduceStep, StepOutput
from kvplane.serving.producers.model import ModelProducer, ModelSpec
from kvplane.transfer.resharding import Parallelism, stage_layers


class RankProducer(ModelProducer):
    """:class:`~kvplane.serving.producers.base.KVProducer` of rank ``placement`` (module
    docstring). The shadow holds only what this producer computed: a request whose first step
    starts after KV this producer did not compute (a prefix loaded from an offload tier) is
    refused (``UnsupportedError``) before anything is written."""

    def __init__(self, model: PagedDecoder, model_id: str, placement: Placement) -> None:
        tp = placement.tp_size
        if isinstance(model, BambaModel) and model.bamba.num_kv_heads % tp:
            raise ConfigError(
                f"TP {tp} of model {model_id}: its {model.bamba.num_kv_heads} KV heads would be "
                "replicated, so some TP rank would be in no gather to send its part of the "
                "recurrent state"
            )
        super().__init__(model, model_id)
        self.placement = placement
        self._shadow: PagedKVCache | None = None
        self._shadow_state: PoolTensor | None = None
        self._open: set[RequestId] = set()
        try:
            self.kv_layout(1, 1)
            self.state_layout(1)
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
        stages = self._stages(full, "attention (KV)")
        side = Parallelism(at.tp_size, stages, block_size)  # the model's own layer ids
        layout = side.rank_layout(full, at.pp_stage, at.tp_rank, num_blocks)
        if head_range is not None and tuple(head_range) != layout.head_range:
            raise ConfigError(
                f"TP rank {at.tp_rank} of {at.tp_size} holds heads {layout.head_range} of "
                f"model {self.model_id}, not {tuple(head_range)}"
            )
        return layout

    def state_layout(self, num_slots: int) -> KVLayout | None:
        """A hybrid's state pool of this stage's Mamba layers (``stage_layers``), each row this
        TP rank's part (``StateSplit``), else None."""
        full = super().state_layout(num_slots)
        if full is None or not isinstance(self.model, BambaModel):
            return full
        at = self.placement
        mine = self._stages(full, "Mamba (state)")[at.pp_stage]
        return state_layout(self.model.bamba.mamba, mine, num_slots, (at.tp_size, at.tp_rank))

    def _stages(self, full: KVLayout, kind: str) -> tuple[tuple[int, ...], ...]:
        """``full``'s layers per pipeline stage; ``LayoutError`` for a stage holding none."""
        at = self.placement
        stages = stage_layers(full.layer_ids, self.model.config.num_layers, at.pp_size)
        for stage, held in enumerate(stages):
            if not held:
                raise LayoutError(
                    f"pipeline stage {stage} of {at.pp_size} holds no {kind} layer of "
                    f"{full.layer_ids}"
                )
        return stages

    def shadow_bytes(self, num_blocks: int, block_size: int, num_slots: int = 0) -> int:
        """Bytes of the full-layout shadows a rank pool of ``num_blocks`` and, for a hybrid, a
        state pool of ``num_slots`` keep beside them (what a start-up memory check must count on
        top of the rank pools; ``num_slots`` 0 counts no state shadow)."""
        full = super().state_layout(num_slots) if num_slots else None
        state = full.pool_bytes if full is not None else 0
        return self.model.kv_layout(num_blocks, block_size).pool_bytes + state

    def _shadow_for(self, rank: KVLayout) -> PagedKVCache:
        """The full-layout shadow of a pool of ``rank``'s size (allocated on first use)."""
        shadow = self._shadow
        if shadow is None or shadow.num_blocks != rank.num_blocks:
            shadow = PagedKVCache(self.model.kv_layout(rank.num_blocks, rank.block_size))
            self._shadow = shadow
        return shadow

    def produce(self, step: ProduceStep, kv: PoolTensor, state: PoolTensor | None) -> StepOutput:
        """Compute ``step.tokens`` with the whole model into the shadow, then copy this rank's
        share of exactly those positions into ``kv`` (mutates only those slots of ``kv``) and, for
        a hybrid, its stage's rows of the full shadow state into ``state`` at
        ``step.state_slot``; the last step returns the greedy first token."""
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
        full_state = None if state is None else self._state_for(state, step, rng.start)
        out = super().produce(step, PoolTensor(shadow.layout, shadow.pool), full_state)
        slots = _slots(step, kv.layout.block_size, rng.start, rng.end)
        _rank(kv)[slots] = self._share(shadow, kv.layout, slots)
        if state is not None and full_state is not None and step.state_slot is not None:
            part = _row_part(state.layout)
            for layer in state.layout.layer_ids:  # this stage's rows of the request's slot
                row = full_state.layout.state_view(full_state.tensor, layer)[step.state_slot]
                state.layout.state_view(state.tensor, layer)[step.state_slot] = row[part]
        if step.is_last:
            self._open.discard(step.request_id)
        else:
            self._open.add(step.request_id)
        return out

    def _state_for(self, state: PoolTensor, step: ProduceStep, start: int) -> PoolTensor:
        """The full shadow of the state pool ``state`` (every Mamba layer, same slots);
        ``UnsupportedError`` for a request resuming at ``start > 0`` that this producer did not
        start (a restored prefix state: the shadow lacks the other stages' rows)."""
        if start > 0 and step.request_id not in self._open:
            raise UnsupportedError(
                f"request {step.request_id!r}: a hybrid's rank producer cannot resume at "
                f"{start} from a restored state (its shadow lacks the other stages' rows)"
            )
        shadow = self._shadow_state
        if shadow is None or shadow.layout.num_blocks != state.layout.num_blocks:
            layout = super().state_layout(state.layout.num_blocks)
            if layout is None:
                raise UnsupportedError(f"model {self.model_id} keeps no recurrent state")
            shadow = PoolTensor(layout, layout.allocate(state.tensor.device))
            self._shadow_state = shadow
        return shadow

    @staticmethod
    def _share(
        shadow: PagedKVCache, rank: KVLayout, slots: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """The shadow's ``[tokens, layers, comps, heads, dim]`` at ``slots``, cut to ``rank``'s
        layers and heads (a copy)."""
        layers = torch.tensor([shadow.layout.layer_index(i) for i in rank.layer_ids])
        lo, hi = rank.head_range
        return _token_major(shadow.layout, shadow.pool)[slots][:, layers][:, :, :, lo:hi]


def _row_part(layout: KVLayout) -> torch.Tensor | slice:
    """The elements of a whole state row that ``layout``'s rows hold, in their order."""
    split = layout.state_split
    if split is None:
        return slice(None)
    return torch.cat([torch.arange(s.start, s.end) for s in split.spans])


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
