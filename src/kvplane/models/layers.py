"""Shared decoder layers as frozen weight holders with pure forward functions.

Shapes: activations are ``[T, hidden]`` (the packed tokens of one step, no batch axis); weights
follow the HF ``nn.Linear`` convention ``[out, in]``. Nothing here keeps state or mutates its
input; every function returns a new tensor in the input's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch.nn import functional

from kvplane.models.hf_fields import DecoderConfig
from kvplane.models.weights import TensorSource, WeightKind


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim, normalised in float32 like HF's RMSNorm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(frozen=True, slots=True)
class Linear:
    """``y = x @ weight.T (+ bias)``; ``weight [out, in]``, ``bias [out]`` or ``None``."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @classmethod
    def load(
        cls, src: TensorSource, prefix: str, out_dim: int, in_dim: int, bias: bool = False
    ) -> Linear:
        w = src.take(f"{prefix}.weight", (out_dim, in_dim), WeightKind.MATRIX)
        b = src.take(f"{prefix}.bias", (out_dim,), WeightKind.BIAS) if bias else None
        return cls(w, b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, self.weight, self.bias)


@dataclass(frozen=True, slots=True)
class RMSNorm:
    weight: torch.Tensor
    eps: float

    @classmethod
    def load(cls, src: TensorSource, name: str, dim: int, eps: float) -> RMSNorm:
        return cls(src.take(f"{name}.weight", (dim,), WeightKind.NORM), eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True, slots=True)
class SwiGLU:
    """The gated MLP ``down(silu(gate(x)) * up(x))``."""

    gate: Linear
    up: Linear
    down: Linear

    @classmethod
    def load(
        cls, src: TensorSource, prefix: str, hidden: int, inner: int, bias: bool = False
    ) -> SwiGLU:
        return cls(
            Linear.load(src, f"{prefix}.gate_proj", inner, hidden, bias),
            Linear.load(src, f"{prefix}.up_proj", inner, hidden, bias),
            Linear.load(src, f"{prefix}.down_proj", hidden, inner, bias),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(functional.silu(self.gate(x)) * self.up(x))


@dataclass(frozen=True, slots=True)
class Embedding:
    """Token embeddings ``[vocab, hidden]``: int64 ids ``[T]`` -> ``[T, hidden]``."""

    weight: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        return functional.embedding(token_ids, self.weight)


def load_lm_head(src: TensorSource, embed: Embedding, tie: bool) -> Linear:
    """``lm_head.weight``, or the embedding matrix when the config ties them and it is absent."""
    vocab, hidden = embed.weight.shape
    if tie and not src.has("lm_head.weight"):
        return Linear(embed.weight)
    return Linear.load(src, "lm_head", int(vocab), int(hidden))


L = TypeVar("L")


@dataclass(frozen=True, slots=True)
class Trunk(Generic[L]):
    """A decoder's weights around its layers: embeddings, the layers, final norm and head."""

    embed: Embedding
    layers: tuple[L, ...]
    norm: RMSNorm
    lm_head: Linear


def load_trunk(
    src: TensorSource, config: DecoderConfig, load_layer: Callable[[int], L], norm_name: str
) -> Trunk[L]:
    """Read the tensors of ``config``'s decoder in checkpoint order (embeddings,
    ``load_layer(i)`` for each layer, the final norm ``norm_name``, the head) and
    :meth:`~TensorSource.finish` ``src``: ``CheckpointError`` for a missing, mis-shaped or
    unused tensor."""
    shape = (config.vocab_size, config.hidden_size)
    embed = Embedding(src.take("model.embed_tokens.weight", shape, WeightKind.MATRIX))
    layers = tuple(load_layer(i) for i in range(config.num_layers))
    norm = RMSNorm.load(src, norm_name, config.hidden_size, config.rms_norm_eps)
    lm_head = load_lm_head(src, embed, config.tie_word_embeddings)
    src.finish()
    return Trunk(embed, layers, norm, lm_head)
