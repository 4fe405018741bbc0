"""Typed attention inputs: MLA queries and latent caches, GQA queries and K/V pools.

Constructors validate shapes and take zero-copy views; nothing here copies a cache. Shapes:
docs/attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.errors import InvalidArgumentError
from kvplane.validators import is_int, require_int

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim or t.dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"{name} must be a {ndim}-D floating tensor, got {t.dtype} of shape {tuple(t.shape)}"
        )
    if t.stride(-1) != 1:
        raise InvalidArgumentError(
            f"{name} must be contiguous in its last dim, strides {t.stride()}"
        )
    return t


def _heads(name: str, t: torch.Tensor, dim: int) -> None:
    if int(t.shape[dim]) < 1:
        raise InvalidArgumentError(
            f"{name} needs >= 1 head (dim {dim}), got shape {tuple(t.shape)}"
        )


def _same_kind(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype or a.device != b.device:
        raise InvalidArgumentError(
            f"{name}: dtypes/devices differ ({a.dtype}@{a.device} vs {b.dtype}@{b.device})"
        )


def packed_view(nope: torch.Tensor, pe: torch.Tensor) -> torch.Tensor | None:
    """The ``[..., r + p]`` view two halves were cut from, or ``None`` if they are not adjacent."""
    r = nope.shape[-1]
    if (
        nope.shape[:-1] != pe.shape[:-1]
        or nope.stride() != pe.stride()
        or nope.untyped_storage().data_ptr() != pe.untyped_storage().data_ptr()
        or pe.storage_offset() != nope.storage_offset() + r
    ):
        return None
    shape = (*nope.shape[:-1], r + pe.shape[-1])
    if any(s < shape[-1] for s in nope.stride()[:-1] if s > 0):
        return None  # rows overlap: the halves were not cut from one packed buffer
    return nope.as_strided(shape, nope.stride(), nope.storage_offset())


@dataclass(frozen=True, slots=True)
class MLAQuery:
    """An MLA query; build with :meth:`packed` or :meth:`split`. ``nope``/``pe`` are views."""

    nope: torch.Tensor
    pe: torch.Tensor
    packed_data: torch.Tensor | None

    @classmethod
    def packed(cls, q: torch.Tensor, nope_dim: int) -> MLAQuery:
        """From ``q [T, H, nope_dim + rope_dim]`` (``nope_dim`` = r absorbed, d_nope otherwise)."""
        _tensor("q", q, 3)
        _heads("q", q, 1)
        require_int("nope_dim", nope_dim)
        if not 0 < nope_dim < q.shape[-1]:
            raise InvalidArgumentError(f"nope_dim must be in (0, {q.shape[-1]}), got {nope_dim}")
        return cls(q[..., :nope_dim], q[..., nope_dim:], q)

    @classmethod
    def split(cls, q_nope: torch.Tensor, q_pe: torch.Tensor) -> MLAQuery:
        """From ``q_nope [T, H, nope_dim]`` and ``q_pe [T, H, rope_dim]``; never copies."""
        _tensor("q_nope", q_nope, 3)
        _tensor("q_pe", q_pe, 3)
        _same_kind("q_nope/q_pe", q_nope, q_pe)
        if q_nope.shape[:2] != q_pe.shape[:2]:
            raise InvalidArgumentError(
                f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} differ in [T, H]"
            )
        _heads("q_nope", q_nope, 1)
        return cls(q_nope, q_pe, packed_view(q_nope, q_pe))

    @property
    def num_tokens(self) -> int:
        return int(self.nope.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.nope.shape[1])

    @property
    def nope_dim(self) -> int:
        return int(self.nope.shape[2])

    @property
    def rope_dim(self) -> int:
        return int(self.pe.shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.nope.dtype

    @property
    def device(self) -> torch.device:
        return self.nope.device


@dataclass(frozen=True, slots=True)
class MLAUpProjection:
    """Per-head decompression of the latent: ``w_uk [H, r, d_nope]``, ``w_uv [H, r, d_v]``.

    ``k_nope[h] = c_kv @ w_uk[h]`` and ``v[h] = c_kv @ w_uv[h]`` (DeepSeek's ``kv_b_proj``).
    """

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    def __post_init__(self) -> None:
        _tensor("w_uk", self.w_uk, 3)
        _tensor("w_uv", self.w_uv, 3)
        _same_kind("w_uk/w_uv", self.w_uk, self.w_uv)
        if self.w_uk.shape[:2] != self.w_uv.shape[:2]:
            raise InvalidArgumentError(
                f"w_uk {tuple(self.w_uk.shape)} and w_uv {tuple(self.w_uv.shape)} differ in [H, r]"
            )
        _heads("w_uk", self.w_uk, 0)

    @property
    def num_heads(self) -> int:
        return int(self.w_uk.shape[0])

    @property
    def kv_lora_rank(self) -> int:
        return int(self.w_uk.shape[1])

    @property
    def qk_nope_dim(self) -> int:
        return int(self.w_uk.shape[2])

    @property
    def v_head_dim(self) -> int:
        return int(self.w_uv.shape[2])

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope [T, H, d_nope]`` -> latent ``[T, H, r]`` (the matrix-absorption trick)."""
        return torch.einsum("thd,hrd->thr", q_nope, self.w_uk)

    def project_output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Latent attention output ``[T, H, r]`` -> per-head values ``[T, H, d_v]``."""
        return torch.einsum("thr,hrv->thv", out_latent, self.w_uv)


@dataclass(frozen=True, slots=True)
class MLAKVCache:
    """Packed paged latent cache ``data [pages, page_size, r + p]``; views, never copies."""

    data: torch.Tensor
    kv_lora_rank: int
    up_proj: MLAUpProjection | None = None

    def __post_init__(self) -> None:
        _tensor("cache", self.data, 3)
        r = self.kv_lora_rank
        if not is_int(r) or not 0 < r < self.data.shape[-1]:
            raise InvalidArgumentError(
                f"kv_lora_rank must be an int in (0, {self.data.shape[-1]}), got {r!r}"
            )
        if self.data.shape[0] < 1 or self.data.shape[1] < 1:
            raise InvalidArgumentError(
                f"cache needs >= 1 page of >= 1 token, got {self.data.shape}"
            )
        up = self.up_proj
        if up is not None and up.kv_lora_rank != r:
            raise InvalidArgumentError(f"up_proj has rank {up.kv_lora_rank}, cache has {r}")

    @property
    def ckv(self) -> torch.Tensor:
        """``[pages, page_size, r]`` view of the compressed KV."""
        return self.data[..., : self.kv_lora_rank]

    @property
    def kpe(self) -> torch.Tensor:
        """``[pages, page_size, p]`` view of the rope keys."""
        return self.data[..., self.kv_lora_rank :]

    @property
    def num_pages(self) -> int:
        return int(self.data.shape[0])

    @property
    def page_size(self) -> int:
        return int(self.data.shape[1])

    @property
    def rope_dim(self) -> int:
        return int(self.data.shape[2]) - self.kv_lora_rank


@dataclass(frozen=True, slots=True)
class GQAQuery:
    """A GQA/MHA query ``q [T, Hq, D]``."""

    q: torch.Tensor

    def __post_init__(self) -> None:
        _tensor("q", self.q, 3)
        _heads("q", self.q, 1)


@dataclass(frozen=True, slots=True)
class GQAKVCache:
    """Paged K and V pools, ``[pages, page_size, Hkv, D]`` each, same dtype and device."""

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        _tensor("k", self.k, 4)
        _tensor("v", self.v, 4)
        _same_kind("k/v", self.k, self.v)
        if self.k.shape != self.v.shape:
            raise InvalidArgumentError(
                f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must have one shape"
            )
        _heads("k", self.k, 2)

    @property
    def num_pages(self) -> int:
        return int(self.k.shape[0])

    @property
    def page_size(self) -> int:
        return int(self.k.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[3])
