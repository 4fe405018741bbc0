"""The synthetic model: a deterministic ``KVProducer`` and a verifying ``KVDecoder``.

Compute is a sleep; the decoder proves every received byte. See docs/serving.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvplane.errors import ConfigError
from kvplane.ids import TokenRange
from kvplane.layout import BLOCK_MAJOR, LAYER_MAJOR, KVLayout
from kvplane.serving.producers.base import (
    DecodeJob,
    DecodeOutput,
    PoolTensor,
    ProduceStep,
    StepOutput,
)
from kvplane.serving.producers.synthetic_kv import SyntheticKV
from kvplane.validators import require_int, require_number

KINDS = ("gqa", "mla")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """Shape of the synthetic model's KV (what ``--layout`` and friends set on the CLI).

    ``kind`` gqa: ``kv_heads`` × ``head_dim`` K and V; mla: one packed ``latent_dim + rope_dim``
    latent. ``sliding_window`` (gqa only): only the final window is moved and checked.
    ``state_dim`` > 0 adds a whole-only per-request state pool of that many bytes per layer.
    """

    kind: str = "mla"
    num_layers: int = 2
    kv_heads: int = 4
    head_dim: int = 32
    latent_dim: int = 64
    rope_dim: int = 16
    dtype: str = "bfloat16"
    sliding_window: int | None = None
    state_dim: int = 0
    vocab_size: int = 32000
    seed: int = 0
    order: str = "block"
    compute_s_per_token: float = 0.0
    compute_s_per_step: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"SyntheticSpec.kind must be one of {KINDS}, got {self.kind!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"SyntheticSpec.dtype must be one of {sorted(_DTYPES)}")
        if self.order not in ("block", "layer"):
            raise ConfigError(f"SyntheticSpec.order must be 'block' or 'layer', got {self.order!r}")
        for name in ("num_layers", "kv_heads", "head_dim", "latent_dim", "rope_dim", "vocab_size"):
            require_int(f"SyntheticSpec.{name}", getattr(self, name), min=1, error=ConfigError)
        require_int("SyntheticSpec.state_dim", self.state_dim, min=0, error=ConfigError)
        if self.sliding_window is not None and self.kind != "gqa":
            raise ConfigError("SyntheticSpec.sliding_window is a gqa option")
        for name in ("compute_s_per_token", "compute_s_per_step"):
            require_number(f"SyntheticSpec.{name}", getattr(self, name), min=0, error=ConfigError)

    @property
    def model_id(self) -> str:
        return f"synthetic-{self.kind}-seed{self.seed}"


class SyntheticModel:
    """Layouts of a :class:`SyntheticSpec` (shared by the producer and the decoder)."""

    def __init__(self, spec: SyntheticSpec) -> None:
        self.spec = spec
        self.kv = SyntheticKV(spec.seed)

    @property
    def model_id(self) -> str:
        return self.spec.model_id

    def retime(self, compute_s_per_step: float, compute_s_per_token: float = 0.0) -> None:
        """Change the simulated compute time (benches calibrate it on a running worker)."""
        self.spec = replace(
            self.spec, compute_s_per_step=compute_s_per_step,
            compute_s_per_token=compute_s_per_token,
        )  # fmt: skip

    def kv_layout(
        self, num_blocks: int, block_size: int, head_range: tuple[int, int] | None = None
    ) -> KVLayout:
        s = self.spec
        order = LAYER_MAJOR if s.order == "layer" else BLOCK_MAJOR
        if s.kind == "mla":
            if head_range not in (None, (0, 1)):
                raise ConfigError(f"an MLA pool holds its one latent head, got {head_range}")
            return KVLayout.mla(
                num_blocks=num_blocks,
                block_size=block_size,
                num_layers=s.num_layers,
                latent_dim=s.latent_dim,
                rope_dim=s.rope_dim,
                dtype=_DTYPES[s.dtype],
                order=order,
            )
        return KVLayout.gqa(
            num_blocks=num_blocks,
            block_size=block_size,
            num_layers=s.num_layers,
            kv_heads=s.kv_heads,
            head_dim=s.head_dim,
            dtype=_DTYPES[s.dtype],
            head_range=head_range,
            order=order,
            sliding_window=s.sliding_window,
        )

    def state_layout(self, num_slots: int) -> KVLayout | None:
        if not self.spec.state_dim:
            return None
        return KVLayout.state(
            num_slots=num_slots,
            num_layers=self.spec.num_layers,
            state_dim=self.spec.state_dim,
            dtype=torch.uint8,
        )

    def expected_state(self, token_ids: np.ndarray, layout: KVLayout) -> torch.Tensor:
        """The state slot's bytes ``[layers, state_dim]`` for a prompt."""
        nbytes = layout.num_layers * layout.head_dim
        return self.kv.state_bytes(token_ids, nbytes).view(layout.num_layers, layout.head_dim)


class SyntheticProducer(SyntheticModel):
    """:class:`~kvplane.serving.producers.base.KVProducer` writing synthetic KV (see module doc)."""

    def produce(self, step: ProduceStep, kv: PoolTensor, state: PoolTensor | None) -> StepOutput:
        s = self.spec
        begin = time.perf_counter()
        self.kv.write(kv, step.token_ids, step.block_ids, step.tokens)
        if not step.is_last:
            _sleep_until(begin + s.compute_s_per_step + s.compute_s_per_token * len(step.tokens))
            return StepOutput()
        if state is not None and step.state_slot is not None:
            view = state.layout.canonical_view(state.tensor)[step.state_slot, :, 0, 0, 0, :]
            view.copy_(self.expected_state(step.token_ids, state.layout))
        _sleep_until(begin + s.compute_s_per_step + s.compute_s_per_token * len(step.tokens))
        return StepOutput(first_token=self.kv.first_token(step.token_ids, s.vocab_size))


class SyntheticDecoder(SyntheticModel):
    """:class:`~kvplane.serving.producers.base.KVDecoder` that verifies instead of generating."""

    verifies = True

    def decode(self, job: DecodeJob, kv: PoolTensor, state: PoolTensor | None) -> DecodeOutput:
        n = len(job.token_ids)
        bad = self.kv.mismatches(
            kv,
            job.token_ids,
            job.table.block_ids,
            TokenRange(kv.layout.window_start(n), n),  # what the pool must hold
        )
        if state is not None and job.state_slot is not None:
            got = state.layout.canonical_view(state.tensor)[job.state_slot, :, 0, 0, 0, :]
            bad += int((got != self.expected_state(job.token_ids, state.layout)).sum())
        expected_first = self.kv.first_token(job.token_ids, self.spec.vocab_size)
        bad += int(job.first_token != expected_first)
        return DecodeOutput(tokens=(job.first_token,), mismatches=bad)


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)
