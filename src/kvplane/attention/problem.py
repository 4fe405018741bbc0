"""The attention problem a backend is asked about, and the result it returns.

:class:`AttentionProblem` holds no data; build it with :func:`mla_problem` (explicit
``absorbed=``) or :func:`gqa_problem`. ``sm_scale`` is required, never defaulted. See
docs/attention.md.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from kvplane.attention.inputs import GQAKVCache, GQAQuery, MLAKVCache, MLAQuery, MLAUpProjection
from kvplane.attention.metadata import PlanMetadata
from kvplane.errors import BackendError, InvalidArgumentError
from kvplane.validators import require_bool, require_int, require_number


class AttentionKind(enum.Enum):
    MLA = "mla"  # absorbed MLA: queries in latent space, output [T, H, r]
    MLA_MHA = "mla_mha"  # non-absorbed MLA: latent decompressed per head, output [T, H, d_v]
    GQA = "gqa"  # grouped-query (or multi-head) attention over K/V pools


class QueryLayout(enum.Enum):
    PACKED = "packed"  # one [T, H, nope + rope] tensor is available without a copy
    SPLIT = "split"  # only separate q_nope / q_pe tensors exist


class LSEBase(enum.Enum):
    """Base of the returned log-sum-exp: FlashInfer returns base 2, torch backends base e."""

    E = "e"
    TWO = "2"


@dataclass(frozen=True, slots=True)
class MLAShape:
    """MLA heads: absorbed when ``qk_nope_dim``/``v_head_dim`` are ``None``, else non-absorbed
    (both set, even when ``qk_nope_dim == kv_lora_rank``)."""

    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    qk_nope_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        if (self.qk_nope_dim is None) != (self.v_head_dim is None):
            raise InvalidArgumentError(
                "qk_nope_dim and v_head_dim are both set (non-absorbed) or both None (absorbed),"
                f" got {self.qk_nope_dim!r} and {self.v_head_dim!r}"
            )

    @property
    def absorbed(self) -> bool:
        return self.qk_nope_dim is None

    @property
    def kind(self) -> AttentionKind:
        return AttentionKind.MLA if self.absorbed else AttentionKind.MLA_MHA

    @property
    def v_dim(self) -> int:
        return self.kv_lora_rank if self.v_head_dim is None else self.v_head_dim


@dataclass(frozen=True, slots=True)
class GQAShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def kind(self) -> AttentionKind:
        return AttentionKind.GQA

    @property
    def v_dim(self) -> int:
        return self.head_dim


@dataclass(frozen=True, slots=True)
class AttentionProblem:
    """Structural description of one attention call; see the module docstring."""

    shape: MLAShape | GQAShape
    metadata: PlanMetadata
    dtype: torch.dtype
    device: torch.device
    sm_scale: float
    causal: bool
    query_layout: QueryLayout = QueryLayout.PACKED
    window: int | None = None
    """Sliding window (causal only): a query at position ``p`` sees keys ``(p - window, p]``,
    at most ``window`` keys, itself included; ``None``: every causal key."""

    def __post_init__(self) -> None:
        require_number("sm_scale", self.sm_scale, above=0)
        require_bool("causal", self.causal)
        if self.window is not None:
            require_int("window", self.window, min=1)
            if not self.causal:
                raise InvalidArgumentError("a sliding window needs a causal problem")

    @property
    def kind(self) -> AttentionKind:
        return self.shape.kind

    @property
    def num_heads(self) -> int:
        return self.shape.num_heads

    def mla_shape(self) -> MLAShape:
        if not isinstance(self.shape, MLAShape):
            raise BackendError(f"an MLA backend was given a {self.kind.value} problem")
        return self.shape

    def gqa_shape(self) -> GQAShape:
        if not isinstance(self.shape, GQAShape):
            raise BackendError(f"a GQA backend was given a {self.kind.value} problem")
        return self.shape

    def validate_inputs(self, query: object, cache: object) -> None:
        """Raise ``BackendError`` unless ``query``/``cache`` are what this problem describes:
        kinds, dims, dtype, device, token count, page size and pool size, and for non-absorbed
        MLA the cache's ``up_proj`` (heads, ``d_nope``, ``d_v``, dtype, device)."""
        s = self.metadata.structure()
        if isinstance(self.shape, MLAShape):
            if not isinstance(query, MLAQuery) or not isinstance(cache, MLAKVCache):
                raise BackendError(
                    f"{self.kind.value} needs MLAQuery and MLAKVCache, got "
                    f"{type(query).__name__} and {type(cache).__name__}"
                )
            want_nope = self.shape.qk_nope_dim or self.shape.kv_lora_rank
            got = (query.num_heads, query.nope_dim, query.rope_dim, cache.kv_lora_rank)
            want = (self.num_heads, want_nope, self.shape.rope_dim, self.shape.kv_lora_rank)
            tensors = (query.nope, cache.data)
            if self.kind is AttentionKind.MLA_MHA:
                self._validate_up_proj(cache.up_proj)
            if self.query_layout is QueryLayout.PACKED and query.packed_data is None:
                raise BackendError("the plan expects a packed query; this one is split")
        else:
            if not isinstance(query, GQAQuery) or not isinstance(cache, GQAKVCache):
                raise BackendError(
                    f"gqa needs GQAQuery and GQAKVCache, got {type(query).__name__} and "
                    f"{type(cache).__name__}"
                )
            got = (int(query.q.shape[1]), int(query.q.shape[2]), cache.num_kv_heads, cache.head_dim)
            want = (
                self.num_heads,
                self.shape.head_dim,
                self.shape.num_kv_heads,
                self.shape.head_dim,
            )
            tensors = (query.q, cache.k)
        if got != want:
            raise BackendError(f"input dims {got} do not match the planned dims {want}")
        for t in tensors:
            if t.dtype != self.dtype or t.device != self.device:
                raise BackendError(
                    f"input is {t.dtype}@{t.device}, planned for {self.dtype}@{self.device}"
                )
        if int(tensors[0].shape[0]) != s.num_tokens:
            raise BackendError(
                f"query has {tensors[0].shape[0]} tokens, metadata says {s.num_tokens}"
            )
        if int(tensors[1].shape[1]) != s.page_size or int(tensors[1].shape[0]) <= s.max_page:
            raise BackendError(
                f"cache of {tensors[1].shape[0]} pages x {tensors[1].shape[1]} tokens cannot "
                f"serve page size {s.page_size} and page id {s.max_page}"
            )

    def _validate_up_proj(self, up: MLAUpProjection | None) -> None:
        """``BackendError`` unless ``up`` is the decompression this MLA_MHA problem planned."""
        if up is None:
            raise BackendError("non-absorbed MLA needs the cache's up_proj weights")
        shape = self.mla_shape()
        got = (up.num_heads, up.qk_nope_dim, up.v_head_dim)
        want = (self.num_heads, shape.qk_nope_dim, shape.v_head_dim)
        if got != want:
            raise BackendError(
                f"up_proj (heads, d_nope, d_v) {got} do not match the planned {want}"
            )
        wrong = _up_proj_placement(up, self.dtype, self.device)
        if wrong is not None:
            raise BackendError(f"{wrong}, planned for {self.dtype}@{self.device}")


def _up_proj_placement(up: MLAUpProjection, dtype: torch.dtype, device: torch.device) -> str | None:
    """``None`` when ``up``'s weights have ``dtype`` and ``device``, else what they have (the
    one check behind building an MLA_MHA problem and running its plan)."""
    if up.w_uk.dtype == dtype and up.w_uk.device == device:
        return None
    return f"up_proj is {up.w_uk.dtype}@{up.w_uk.device}"


def window_starts(limits: torch.Tensor, window: int | None) -> torch.Tensor:
    """The first key position each query row sees, for rows that see the keys below ``limits``
    (an int tensor of any shape; a causal query at position ``p`` has limit ``p + 1``): a
    ``window`` keeps ``[limit - window, limit)``, i.e. ``(p - window, p]`` as transformers'
    sliding window does, clamped at 0; ``0`` without a window. The one home of this rule."""
    if window is None:
        return torch.zeros_like(limits)
    return torch.clamp(limits - window, min=0)


def _check_heads(name: str, heads: int, expected: int) -> None:
    if heads != expected:
        raise InvalidArgumentError(f"{name} has {heads} heads, expected {expected}")


def mla_problem(
    query: MLAQuery,
    cache: MLAKVCache,
    metadata: PlanMetadata,
    *,
    sm_scale: float,
    causal: bool,
    absorbed: bool | None = None,
    window: int | None = None,
) -> AttentionProblem:
    """Describe an MLA call: absorbed (a latent query, nope dim ``r``) or non-absorbed (a
    per-head query, nope dim ``up_proj.qk_nope_dim``, decompressed through ``cache.up_proj``).

    ``absorbed`` says which; it is required when the shapes cannot tell (``cache.up_proj`` set
    and ``qk_nope_dim == kv_lora_rank``, where both queries are ``[T, H, r + p]``), and when
    given it must fit the shapes. The kind is never guessed. A non-absorbed call's ``up_proj``
    must have the query's heads, dtype and device. ``window`` (causal only) limits each query
    to its ``window`` most recent keys.
    """
    if query.dtype != cache.data.dtype or query.device != cache.data.device:
        raise InvalidArgumentError(
            f"query is {query.dtype}@{query.device}, "
            f"cache is {cache.data.dtype}@{cache.data.device}"
        )
    if query.rope_dim != cache.rope_dim:
        raise InvalidArgumentError(f"query rope dim {query.rope_dim} != cache {cache.rope_dim}")
    up = _decompression(query, cache, absorbed)
    if up is None:
        shape = MLAShape(query.num_heads, cache.kv_lora_rank, cache.rope_dim)
    else:
        _check_heads("up_proj", up.num_heads, query.num_heads)
        wrong = _up_proj_placement(up, query.dtype, query.device)
        if wrong is not None:
            raise InvalidArgumentError(f"{wrong}, query is {query.dtype}@{query.device}")
        shape = MLAShape(
            query.num_heads, cache.kv_lora_rank, cache.rope_dim, up.qk_nope_dim, up.v_head_dim
        )
    _check_structure(metadata, cache.page_size, query.num_tokens)
    layout = QueryLayout.PACKED if query.packed_data is not None else QueryLayout.SPLIT
    return AttentionProblem(
        shape, metadata, query.dtype, query.device, sm_scale, causal, layout, window
    )


def _decompression(
    query: MLAQuery, cache: MLAKVCache, absorbed: bool | None
) -> MLAUpProjection | None:
    """The up-projection a non-absorbed call decompresses with, ``None`` for an absorbed call:
    ``absorbed`` checked against the shapes, or the only kind the shapes allow;
    ``InvalidArgumentError`` when it does not fit or cannot be told."""
    if absorbed is not None and not isinstance(absorbed, bool):
        raise InvalidArgumentError(f"absorbed must be a bool or None, got {absorbed!r}")
    nope, r, up = query.nope_dim, cache.kv_lora_rank, cache.up_proj
    latent = nope == r
    per_head = up is not None and nope == up.qk_nope_dim
    if absorbed is None:
        if latent and per_head:
            raise InvalidArgumentError(
                f"query nope dim {nope} is both the latent rank and up_proj's d_nope: pass "
                "absorbed=True (a latent query) or absorbed=False (a per-head query)"
            )
        if not (latent or per_head):
            raise InvalidArgumentError(
                f"query nope dim {nope} is neither the latent rank {r} nor an up_proj d_nope"
            )
        absorbed = latent
    if absorbed and not latent:
        raise InvalidArgumentError(
            f"an absorbed query needs nope dim == latent rank {r}, got {nope}"
        )
    if not absorbed and not per_head:
        have = "no up_proj" if up is None else f"up_proj d_nope {up.qk_nope_dim}"
        raise InvalidArgumentError(
            f"a non-absorbed query needs the cache's up_proj with d_nope == its nope dim {nope},"
            f" the cache has {have}"
        )
    return None if absorbed else up


def gqa_problem(
    query: GQAQuery,
    cache: GQAKVCache,
    metadata: PlanMetadata,
    *,
    sm_scale: float,
    causal: bool,
    window: int | None = None,
) -> AttentionProblem:
    """Describe a GQA call over K/V pools; ``Hq`` must be a multiple of ``Hkv``; ``window``
    (causal only) limits each query to its ``window`` most recent keys."""
    q = query.q
    if q.dtype != cache.k.dtype or q.device != cache.k.device:
        raise InvalidArgumentError(
            f"query is {q.dtype}@{q.device}, cache is {cache.k.dtype}@{cache.k.device}"
        )
    hq, d = int(q.shape[1]), int(q.shape[2])
    if d != cache.head_dim or hq % cache.num_kv_heads:
        raise InvalidArgumentError(
            f"query [*, {hq}, {d}] does not fit K/V [*, *, {cache.num_kv_heads}, {cache.head_dim}]"
        )
    _check_structure(metadata, cache.page_size, int(q.shape[0]))
    shape = GQAShape(hq, cache.num_kv_heads, d)
    return AttentionProblem(
        shape, metadata, q.dtype, q.device, sm_scale, causal, QueryLayout.PACKED, window
    )


def _check_structure(metadata: PlanMetadata, page_size: int, num_tokens: int) -> None:
    if metadata.page_size != page_size:
        raise InvalidArgumentError(
            f"metadata page_size {metadata.page_size} != cache page_size {page_size}"
        )
    s = metadata.structure()
    if s.num_tokens != num_tokens:
        raise InvalidArgumentError(
            f"query has {num_tokens} tokens, metadata sums to {s.num_tokens}"
        )


@dataclass(frozen=True, slots=True)
class AttentionResult:
    """``out [T, H, v_dim]`` in the query dtype; ``lse [T, H]`` float32 in base ``lse_base``.

    Rows that see no KV have ``out == 0`` and ``lse == -inf``.
    """

    out: torch.Tensor
    lse: torch.Tensor
    lse_base: LSEBase

    def lse_natural(self) -> torch.Tensor:
        """The log-sum-exp in base e, whatever base the backend produced."""
        return self.lse if self.lse_base is LSEBase.E else self.lse * math.log(2.0)
