"""Real models behind the PD workers: a ``KVProducer`` and a ``KVDecoder`` over a
:class:`~kvplane.models.CausalLM`.

Both sides build the model from one :class:`ModelSpec`, so their weights are bit-identical. A
hybrid model (Bamba: attention + Mamba2) keeps only its attention layers' KV in the paged pool
and each request's Mamba2 conv + SSM state in the worker's whole-only state pool (one slot per
request): the prefill leaves the state after the prompt there, the final slice carries it, the
decoder continues from it. A model mixing windows served with ``kv_groups`` reads and writes one
paged pool per KV cache group and drops each window group's out-of-window blocks while decoding.
See docs/serving.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Self, runtime_checkable

import numpy as np
import torch

from kvplane.attention import default_registry
from kvplane.attention.selection import AUTO, check_backend
from kvplane.blocks import after_step, grow_groups, short_group
from kvplane.errors import CheckpointError, ConfigError, InvalidArgumentError, UnsupportedError
from kvplane.ids import TokenRange
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.models import (
    TINY_MODELS,
    PagedDecoder,
    PagedKVCache,
    StepBatch,
    StepRequest,
    greedy_token,
    load_model,
)
from kvplane.models.bamba import BambaModel
from kvplane.models.generate import group_peaks
from kvplane.models.kv import GroupedKVCache
from kvplane.models.kv_groups import KVGroups
from kvplane.models.recurrent import HybridKVCache, RecurrentState
from kvplane.serving.producers.base import (
    DecodeJob,
    DecodeOutput,
    PoolTensor,
    ProduceStep,
    StepOutput,
)
from kvplane.validators import require_int

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_GROUPS = True
"""Whether a model mixing windows is served with one paged pool per KV cache group unless told
otherwise: the one default of :attr:`ModelSpec.kv_groups` and :class:`ModelKV`."""


@runtime_checkable
class PromptChecker(Protocol):
    """Optional: a producer/decoder that can refuse a prompt before any memory is taken."""

    def check_prompt(self, token_ids: np.ndarray, max_new_tokens: int = 0) -> None:
        """``InvalidArgumentError`` naming the first bad value; changes nothing."""
        ...


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Which model a worker serves: an embedded name (``tiny-llama``, ``tiny-deepseek``) with the
    weights ``seed``, or a checkpoint directory; ``dtype`` of weights, activations and KV;
    ``attention``: how its attention backends are chosen (``auto``, ``measured`` or backend
    names, one per attention kind; it never changes the weights, so it is not part of
    :meth:`identity`); ``kv_groups``: a model whose layers have different windows is served
    with one paged pool per KV cache group (window blocks freed as they slide out), else with
    one pool of every layer (``kvplane serve --kv-groups on|off``; on by default). The PD
    handshake and the router pair paged pools by the layers they hold, so either side may run
    either (docs/attention.md)."""

    source: str
    seed: int = 0
    dtype: str = "float32"
    attention: str = AUTO
    kv_groups: bool = KV_GROUPS

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError(f"ModelSpec.source must name a model, got {self.source!r}")
        require_int("ModelSpec.seed", self.seed, min=0, error=ConfigError)
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"ModelSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        try:
            check_backend(default_registry(), self.attention)
        except InvalidArgumentError as exc:
            raise ConfigError(f"ModelSpec.{exc}") from None

    @property
    def embedded(self) -> bool:
        return self.source in TINY_MODELS

    def identity(self) -> str:
        """What the weights are: ``name-seedS`` for an embedded model, else the directory's
        ``config.json`` + ``*.safetensors`` content hash (so a moved copy has the same id)."""
        if self.embedded:
            return f"{self.source}-seed{self.seed}-{self.dtype}"
        root = Path(self.source)
        if not root.is_dir():
            raise CheckpointError(f"checkpoint directory {self.source!r} does not exist")
        digest = hashlib.blake2b(digest_size=12)
        for path in sorted([root / "config.json", *root.glob("*.safetensors")]):
            if not path.is_file():
                raise CheckpointError(f"checkpoint {self.source!r} has no {path.name}")
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
        return f"ckpt-{digest.hexdigest()}-{self.dtype}"

    def load(self, metrics: MetricsRegistry | None = None) -> PagedDecoder:
        """Build the model (``CheckpointError`` for a bad or unsupported checkpoint)."""
        return load_model(
            self.source, dtype=DTYPES[self.dtype], seed=self.seed, backend=self.attention,
            metrics=metrics,
        )  # fmt: skip


class ModelKV:
    """The :class:`~kvplane.serving.producers.base.KVModel` face of a model (module docstring)."""

    def __init__(self, model: PagedDecoder, model_id: str, *, kv_groups: bool = KV_GROUPS) -> None:
        """``kv_groups``: as :attr:`ModelSpec.kv_groups` (same default, :data:`KV_GROUPS`)."""
        self.model = model
        self._model_id = model_id
        self._groups = kv_groups  # serve one paged pool per KV cache group
        self._state: RecurrentState | None = None  # a hybrid's views of the worker's state pool

    @classmethod
    def from_spec(cls, spec: ModelSpec, metrics: MetricsRegistry | None = None) -> Self:
        return cls(spec.load(metrics), spec.identity(), kv_groups=spec.kv_groups)

    def kv_groups(self, layout: KVLayout) -> KVGroups | None:
        """``layout``'s KV cache groups when this model serves them (``kv_groups``), else None.
        ``UnsupportedError`` for a hybrid with several (its state pool is not grouped)."""
        if not self._groups:
            return None
        groups = KVGroups.of_layout(layout)
        if not groups.single and isinstance(self.model, BambaModel):
            raise UnsupportedError(f"model {self._model_id}: KV cache groups of a hybrid model")
        return groups

    @property
    def model_id(self) -> str:
        return self._model_id

    def kv_layout(
        self, num_blocks: int, block_size: int, head_range: tuple[int, int] | None = None
    ) -> KVLayout:
        layout = self.model.kv_layout(num_blocks, block_size)
        if head_range is not None and tuple(head_range) != (0, layout.total_heads):
            raise ConfigError(
                f"model {self._model_id} serves every KV head; a TP head range {head_range} "
                f"is not supported (the layout has {layout.total_heads} heads)"
            )
        return layout

    def state_layout(self, num_slots: int) -> KVLayout | None:
        """A hybrid model's recurrent-state pool (:meth:`BambaModel.state_layout`), else None."""
        model = self.model
        return model.state_layout(num_slots) if isinstance(model, BambaModel) else None

    def check_prompt(self, token_ids: np.ndarray, max_new_tokens: int = 0) -> None:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise InvalidArgumentError(f"a prompt must be a non-empty 1-D id list, got {ids.shape}")
        vocab = self.model.vocab_size
        bad = ((ids < 0) | (ids >= vocab)).nonzero()[0]
        if bad.size:
            raise InvalidArgumentError(
                f"prompt token id {int(ids[bad[0]])} at position {int(bad[0])} is outside the "
                f"vocabulary [0, {vocab}) of {self._model_id}"
            )
        limit = self.model.config.max_position_embeddings
        if ids.size + max_new_tokens > limit:
            raise InvalidArgumentError(
                f"{ids.size} prompt + {max_new_tokens} new tokens exceed the model's "
                f"{limit} positions"
            )

    def cache(
        self, kv: PoolTensor, state: PoolTensor | None = None, slot: int | None = None,
        num_tokens: int = 0,
    ) -> PagedKVCache:  # fmt: skip
        """The worker pools as the model's KV cache (views of the same memory). A hybrid model
        also takes ``state`` and declares that its ``slot`` holds the state after
        ``num_tokens`` tokens (the caller vouches: the request's previous step, a restored
        prefix or a received final slice left it there); ``UnsupportedError`` without them."""
        model = self.model
        if kv.groups:
            caches = tuple(PagedKVCache(p.layout, p.tensor) for p in kv.pools)
            groups = KVGroups(tuple(KVGroups.of_layout(c.layout).groups[0] for c in caches))
            return GroupedKVCache(groups, caches)
        if not isinstance(model, BambaModel):
            return PagedKVCache(kv.layout, kv.tensor)
        if state is None or slot is None:
            raise UnsupportedError(
                f"model {self._model_id} has recurrent (Mamba2) state: a step needs the "
                "worker's state pool and the request's slot"
            )
        rec = self._state
        if rec is None or rec.pool is not state.tensor:
            rec = model.new_state(state.layout.num_blocks, state.tensor)
            self._state = rec
        rec.resume(slot, num_tokens)
        return HybridKVCache(kv.layout, rec, kv.tensor)

    @property
    def fallback_counts(self) -> tuple[int, int]:
        """``(plans, plans on a fallback backend)`` of the model's attention selector."""
        sel = self.model.selector
        return int(sel.plans), int(sel.fallbacks)


class ModelProducer(ModelKV):
    """:class:`~kvplane.serving.producers.base.KVProducer`: chunked prefill with the real model."""

    def produce(self, step: ProduceStep, kv: PoolTensor, state: PoolTensor | None) -> StepOutput:
        """Compute ``step.tokens`` into ``kv`` at ``step.block_ids`` (mutates only those slots;
        a hybrid model also advances ``state`` at ``step.state_slot``, which must hold the state
        after ``step.tokens.start`` tokens); the last step returns the greedy first token."""
        rng = step.tokens
        ids = np.asarray(step.token_ids[rng.start : rng.end], dtype=np.int64)
        slot = step.state_slot
        req = StepRequest(ids, rng.start, step.block_ids, slot or 0, step.group_block_ids)
        batch = StepBatch.build(
            [req],
            kv.layout.block_size,
            self.model.device,
        )
        logits = self.model.forward_step(batch, self.cache(kv, state, slot, rng.start))
        if not step.is_last:
            return StepOutput()
        return StepOutput(first_token=greedy_token(logits)[0])


class ModelDecoder(ModelKV):
    """:class:`~kvplane.serving.producers.base.KVDecoder`: greedy decode from received KV."""

    verifies = False

    def decode(self, job: DecodeJob, kv: PoolTensor, state: PoolTensor | None) -> DecodeOutput:
        """``job.max_new_tokens`` tokens (first token included) by one-token steps; grows each
        KV cache group's table through its pool (the worker marked the received prompt computed
        and releases the tables) and, in a pool with a null block, drops the blocks that slid
        out of every window after each step. ``InvalidArgumentError`` when a pool runs out of
        blocks (checked before any step)."""
        tokens = [int(job.first_token)]
        if job.max_new_tokens <= 1:
            return DecodeOutput(tokens=tuple(tokens[: job.max_new_tokens]))
        tables = job.tables
        if len(tables) != len(kv.pools):
            raise InvalidArgumentError(
                f"request {job.request_id!r}: {len(tables)} block tables for {len(kv.pools)} "
                "KV cache groups"
            )
        layouts = [pt.layout for pt in kv.pools]
        group_tables = [t for t, _ in tables]
        pools = [p for _, p in tables]
        peaks = group_peaks(len(job.token_ids), job.max_new_tokens, layouts, pools, received=True)
        short = short_group(group_tables, pools, peaks)
        if short is not None:
            g = short.group
            raise InvalidArgumentError(
                f"request {job.request_id!r}: decoding {job.max_new_tokens} tokens needs "
                f"{peaks[g] - group_tables[g].num_held_blocks} more blocks; the decode pool has "
                f"{pools[g].num_free_blocks} free"
            )
        slot = job.state_slot
        cache = self.cache(kv, state, slot, len(job.token_ids))  # a hybrid: the received state
        with torch.no_grad():
            while len(tokens) < job.max_new_tokens:
                if grow_groups(group_tables, pools, [tokens[-1]]) is not None:  # pragma: no cover
                    raise InvalidArgumentError("the decode pool ran out of blocks")  # checked
                last = np.array([tokens[-1]], dtype=np.int64)
                table = job.table
                more_ids = tuple(t.block_ids for t in job.group_tables)
                req = StepRequest(last, table.num_tokens - 1, table.block_ids, slot or 0, more_ids)
                batch = StepBatch.build([req], table.block_size, self.model.device)
                logits = self.model.forward_step(batch, cache)
                end = table.num_tokens  # the next step computes from here
                after_step(group_tables, pools, layouts, TokenRange(end - 1, end))
                tokens.append(greedy_token(logits)[0])
        return DecodeOutput(tokens=tuple(tokens))
