"""What every paged decoder shares: input checks, embedding, final norm and logits, per-step
attention planning and greedy generation.

:class:`StepAttention` plans each attention kind once per step through the injected selector.
See docs/attention.md.
"""

from __future__ import annotations

import abc
from typing import Any, TypedDict

import torch

from kvplane.attention import (
    AUTO,
    AttentionKind,
    AttentionProblem,
    AttentionResult,
    Plan,
    Selector,
    default_registry,
)
from kvplane.errors import InvalidArgumentError
from kvplane.layout import BLOCK_MAJOR, Axis, KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.models.config import ModelConfig
from kvplane.models.generate import greedy_generate
from kvplane.models.kv import GroupedKVCache, PagedKVCache
from kvplane.models.kv_groups import KVGroups
from kvplane.models.layers import Trunk
from kvplane.models.step import StepBatch


class DecoderOptions(TypedDict, total=False):
    """How a decoder picks attention backends; every model family takes these as keywords
    (defaults: :class:`PagedDecoder`'s)."""

    selector: Selector | None
    backend: str
    metrics: MetricsRegistry | None


class StepAttention:
    """Plans attention once per (step, kind, sliding window) and runs the plan for each layer
    (layers with different windows, as Qwen2's ``layer_types`` give, plan apart)."""

    def __init__(self, selector: Selector, backend: str) -> None:
        self._selector = selector
        self._backend = backend
        self._plans: dict[tuple[AttentionKind, int | None], Plan] = {}

    @property
    def plans(self) -> tuple[Plan, ...]:
        """The plans made so far this step (with their selection traces)."""
        return tuple(self._plans.values())

    def run(self, problem: AttentionProblem, query: object, cache: object) -> AttentionResult:
        key = (problem.kind, problem.window)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._selector.plan(problem, self._backend)
            self._plans[key] = plan
        return self._selector.registry.get(plan.backend).run(plan, query, cache)


class PagedDecoder(abc.ABC):
    """Shared machinery of the model families; see the module docstring.

    ``selector`` (default: a fresh one over ``default_registry()`` reporting to ``metrics``)
    and ``backend`` (``"auto"``, ``"measured"`` or a backend name) choose attention backends.
    Weights are never written; ``last_plans`` is per-call diagnostics, so one model object
    serves one thread at a time.
    """

    def __init__(
        self,
        config: ModelConfig,
        trunk: Trunk[Any],
        *,
        selector: Selector | None = None,
        backend: str = AUTO,
        metrics: MetricsRegistry | None = None,
    ) -> None:
        self._config = config
        self.embed = trunk.embed
        self.final_norm = trunk.norm
        self.lm_head = trunk.lm_head
        self.selector = (
            selector if selector is not None else Selector(default_registry(), metrics=metrics)
        )
        self.backend = backend
        self.last_plans: tuple[Plan, ...] = ()

    # -- CausalLM ------------------------------------------------------------------------------
    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def vocab_size(self) -> int:
        return self.embed.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @abc.abstractmethod
    def kv_layout(
        self, num_blocks: int, block_size: int, order: tuple[Axis, ...] = BLOCK_MAJOR
    ) -> KVLayout: ...

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(self.kv_layout(num_blocks, block_size), device=self.device)

    def forward_step(
        self, batch: StepBatch, kv: PagedKVCache, *, all_logits: bool = False
    ) -> torch.Tensor:
        """See :meth:`kvplane.models.base.CausalLM.forward_step`. ``last_plans`` afterwards
        holds this step's attention plans. A failure after the checks (a backend error) may
        leave this step's own slots half written, never any other slot."""
        self.check_step(batch, kv)
        attention = StepAttention(self.selector, self.backend)
        with torch.no_grad():
            x = self.embed(batch.token_ids)
            x = self._run_layers(x, batch, kv, attention)
            if not all_logits:
                x = x[batch.last_rows]
            logits = self.lm_head(self.final_norm(x)).float()
        self.last_plans = attention.plans
        return logits

    @abc.abstractmethod
    def _run_layers(
        self, x: torch.Tensor, batch: StepBatch, kv: PagedKVCache, attention: StepAttention
    ) -> torch.Tensor:
        """Every decoder layer over ``x [T, hidden]``; writes the step's KV; returns ``x``."""

    def check_step(self, batch: StepBatch, kv: PagedKVCache) -> None:
        """Raise ``InvalidArgumentError`` naming what is wrong; touches nothing. ``kv`` is one
        pool of every layer, or a :class:`GroupedKVCache` of this model's KV cache groups with
        ``batch`` carrying each group's pages (:meth:`StepBatch.pages`)."""
        if not isinstance(batch, StepBatch):
            raise InvalidArgumentError(f"expected a StepBatch, got {type(batch).__name__}")
        if not isinstance(kv, PagedKVCache):
            raise InvalidArgumentError(f"expected a PagedKVCache, got {type(kv).__name__}")
        want = self.kv_layout(kv.num_blocks, kv.block_size, kv.layout.order)
        grouped = isinstance(kv, GroupedKVCache)
        wants = KVGroups.of_layout(want).layouts(want) if grouped else (want,)
        caches = kv.caches
        if len(caches) != len(wants) or any(
            c.layout.compat_fingerprint() != w.compat_fingerprint()
            for c, w in zip(caches, wants, strict=True)
        ):
            got = [c.layout.describe() for c in caches]
            need = [w.describe() for w in wants]
            raise InvalidArgumentError(
                f"KV layout {got if grouped else got[0]} does not fit this model, which needs "
                f"{need if grouped else need[0]}"
            )
        if batch.num_groups != len(caches):
            raise InvalidArgumentError(
                f"step carries the pages of {batch.num_groups} KV cache groups; the KV cache "
                f"has {len(caches)}"
            )
        if batch.block_size != kv.block_size:
            raise InvalidArgumentError(
                f"step uses block size {batch.block_size}, the KV pool has {kv.block_size}"
            )
        if batch.token_ids.device != self.device or kv.device != self.device:
            raise InvalidArgumentError(
                f"step on {batch.token_ids.device} and KV on {kv.device}; the model is on "
                f"{self.device}"
            )
        self.check_token_ids(batch.token_ids)
        for g, cache in enumerate(caches):
            pages = batch.pages(g)
            cache.check_slots(pages.slot_mapping)
            max_page = pages.metadata.structure().max_page
            if max_page >= cache.num_blocks:
                raise InvalidArgumentError(
                    f"step reads block {max_page}; the KV pool has {cache.num_blocks} blocks"
                )

    def check_token_ids(self, token_ids: torch.Tensor) -> None:
        """``InvalidArgumentError`` naming the first id outside ``[0, vocab_size)``."""
        bad = ((token_ids < 0) | (token_ids >= self.vocab_size)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise InvalidArgumentError(
                f"token id {int(token_ids[i])} at position {i} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )

    # -- generation -----------------------------------------------------------------------------
    generate = greedy_generate
    """``model.generate(prompt_ids, max_new_tokens, step_size, ...)``: greedy generation in this
    process (:func:`~kvplane.models.greedy_generate` with this model)."""
