"""What every attention backend shares: identity, capability check, planning, the run prologue.

A backend subclasses :class:`MLABackend` or :class:`GQABackend` and supplies its capabilities,
``prepare`` and ``attend``; the base class does ``check``, ``plan`` and ``run``'s validation.
:class:`Scratch` is the reused gather workspace. See docs/attention.md.
"""

from __future__ import annotations

import importlib.util
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from kvplane.attention.base import Capabilities, Plan, plan_state
from kvplane.attention.inputs import GQAKVCache, GQAQuery, MLAKVCache, MLAQuery
from kvplane.attention.metadata import PagedStructure
from kvplane.attention.paged import (
    GroupedBatch,
    batch_groups,
    build_batch_index,
    empty_state,
    gather_group,
    padded_result,
)
from kvplane.attention.problem import AttentionKind, AttentionProblem, AttentionResult, LSEBase
from kvplane.errors import BackendError
from kvplane.validators import require_int
from kvplane.verdicts import Verdict, verdict

CPU_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
"""Dtypes the torch backends accept (low precision is computed in float32)."""

S = TypeVar("S")
Q = TypeVar("Q", MLAQuery, GQAQuery)
C = TypeVar("C", MLAKVCache, GQAKVCache)

GROUP_BYTES = 64 << 20
"""Gathered-KV bytes (with any compute-dtype copy) of one group of requests; at least one
request per group."""

Take = Callable[[str, int, torch.dtype, torch.device], torch.Tensor]
"""``take(name, numel, dtype, device)``: a flat scratch tensor of ``numel`` elements."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Low-precision inputs are computed in float32; float32/64 stay as they are."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def torch_capabilities(kind: AttentionKind) -> Capabilities:
    """The torch backends' capabilities: ``kind`` on CPU or CUDA in :data:`CPU_DTYPES`, any
    query class, causality, query layout and sliding window, LSE base e."""
    return Capabilities(
        kinds=frozenset({kind}), devices=frozenset({"cpu", "cuda"}), dtypes=CPU_DTYPES,
        lse_base=LSEBase.E, sliding_window=True,
    )  # fmt: skip


def grouped_batch(
    problem: AttentionProblem, s: PagedStructure, width: int, group_bytes: int
) -> GroupedBatch:
    """The padded batch index of ``problem`` and its groups of at most about ``group_bytes``,
    for ``width`` gathered elements per KV position (all pools), the groups a multiple of
    torch's intra-op threads when possible."""
    cdt = compute_dtype(problem.dtype)
    size = problem.dtype.itemsize + (0 if cdt == problem.dtype else cdt.itemsize)
    index = build_batch_index(problem.metadata, s, problem.causal, problem.device, problem.window)
    threads, window = torch.get_num_threads(), problem.window
    groups = batch_groups(
        s, problem.causal, width * size, group_bytes, threads, window=window, lows=index.lows
    )
    return GroupedBatch(index, groups)


def cuda_package_reasons(package: str, hint: str) -> list[str]:
    """Why this process cannot run a CUDA engine from ``package`` (empty when it can)."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append(f"no CUDA device is available; {hint}")
    if importlib.util.find_spec(package) is None:
        reasons.append(f"the {package} package is not installed; {hint}")
    return reasons


def empty_result(plan: Plan) -> AttentionResult | None:
    """Zeros and ``lse = -inf`` when there is nothing to attend to (no query token or no KV at
    all); ``None`` otherwise."""
    s, p = plan.structure, plan.problem
    if s.num_tokens and s.max_kv_len:
        return None
    out = torch.zeros((s.num_tokens, p.num_heads, p.shape.v_dim), dtype=p.dtype, device=p.device)
    lse = torch.full((s.num_tokens, p.num_heads), float("-inf"), device=p.device)
    return AttentionResult(out, lse, LSEBase.E)


class Scratch:
    """Named flat buffers reused across runs of one backend instance.

    :meth:`use` lends them for one run; a buffer grows (is replaced) when a run needs more
    elements, another dtype or another device. A run that overlaps another one on the same
    instance (another thread) gets private buffers instead, so runs never share memory.
    Nothing a run returns may alias a scratch buffer.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    @contextmanager
    def use(self) -> Iterator[Take]:
        shared = self._lock.acquire(blocking=False)
        buffers = self._buffers if shared else {}

        def take(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            buf = buffers.get(name)
            if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
                buf = torch.empty(numel, dtype=dtype, device=device)
                buffers[name] = buf
            return buf[:numel]

        try:
            yield take
        finally:
            if shared:
                self._lock.release()


@dataclass(frozen=True, slots=True)
class GroupKV:
    """One group's gathered KV: ``kv`` holds one ``[n, tokens, ...]`` tensor per pool, of
    positions ``[start, start + tokens)`` (those no row reads zeroed), for the padded-batch
    ``rows``."""

    rows: slice
    tokens: int
    masked: bool
    kv: tuple[torch.Tensor, ...]
    start: int = 0


def group_kv(
    scratch: Scratch, batch: GroupedBatch, pools: Sequence[torch.Tensor], dtype: torch.dtype
) -> Iterator[GroupKV]:
    """The groups of ``batch`` that have KV, each gathered from every pool into ``scratch``
    and converted to ``dtype``; a group's tensors are valid until the next one is yielded."""
    index = batch.index
    with scratch.use() as take:
        for g in batch.groups:
            width = g.pages - g.first
            if width <= 0:
                continue
            kv = []
            for i, pool in enumerate(pools):
                numel = (g.hi - g.lo) * width * pool[0].numel()
                x = gather_group(pool, index, g, take(f"pool{i}", numel, pool.dtype, pool.device))
                if x.dtype != dtype:
                    x = take(f"pool{i}:{dtype}", numel, dtype, pool.device).view(x.shape).copy_(x)
                kv.append(x)
            ps = index.page_size
            yield GroupKV(slice(g.lo, g.hi), width * ps, g.masked, tuple(kv), g.first * ps)


def attend_groups(
    scratch: Scratch,
    plan: Plan,
    batch: GroupedBatch,
    attend: Callable[[GroupKV], tuple[torch.Tensor, torch.Tensor]],
    *,
    pools: Sequence[torch.Tensor],
    dtype: torch.dtype,
    v_dim: int,
    state_dtype: torch.dtype | None = None,
) -> AttentionResult:
    """The grouped backends' run: ``attend(part)`` gives ``(o [n, t, H, v_dim], lse [n, t, H])``
    of each group of :func:`group_kv` (``pools`` gathered in ``dtype``), written into padded
    state of ``state_dtype`` (default ``dtype``) that rows without KV keep at zeros and
    ``-inf``; returns the unpadded result in the problem's dtype."""
    p, index = plan.problem, batch.index
    state = dtype if state_dtype is None else state_dtype
    o, lse = empty_state(index, p.num_heads, v_dim, state, p.device)
    for part in group_kv(scratch, batch, pools, dtype):
        o[part.rows], lse[part.rows] = attend(part)
    return padded_result(o, lse, index, p.dtype)


class PagedBackend(ABC, Generic[S, Q, C]):
    """The shared part of every backend; see the module docstring."""

    def __init__(
        self,
        name: str,
        capabilities: Capabilities,
        state_type: type[S],
        query_type: type[Q],
        cache_type: type[C],
    ) -> None:
        self._name = name
        self._caps = capabilities
        self._types: tuple[type[S], type[Q], type[C]] = (state_type, query_type, cache_type)
        self.scratch = Scratch()

    @property
    def name(self) -> str:
        return self._name

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def environment_reasons(self, problem: AttentionProblem) -> Sequence[str]:
        """Reasons beyond the capabilities why ``problem`` cannot run here (default: none)."""
        return ()

    def check(self, problem: AttentionProblem) -> Verdict:
        return verdict([*self._caps.reasons(problem), *self.environment_reasons(problem)])

    @abstractmethod
    def prepare(self, problem: AttentionProblem, structure: PagedStructure) -> S:
        """The plan state: structural facts only, never query or KV data; raise to refuse."""

    def plan(self, problem: AttentionProblem) -> Plan:
        s = problem.metadata.structure()
        return Plan(self._name, problem, s, self.prepare(problem, s))

    @abstractmethod
    def attend(self, plan: Plan, state: S, query: Q, cache: C) -> AttentionResult:
        """Attention over validated inputs of a batch with at least one token and some KV."""

    def run(self, plan: Plan, query: object, cache: object) -> AttentionResult:
        state_type, query_type, cache_type = self._types
        state = plan_state(plan, self._name, state_type)
        plan.problem.validate_inputs(query, cache)
        if not isinstance(query, query_type) or not isinstance(cache, cache_type):
            raise BackendError(
                f"backend {self._name!r} needs {query_type.__name__} and {cache_type.__name__}, "
                f"got {type(query).__name__} and {type(cache).__name__}"
            )
        done = empty_result(plan)
        return done if done is not None else self.attend(plan, state, query, cache)


class MLABackend(PagedBackend[S, MLAQuery, MLAKVCache]):
    """A backend of MLA problems (absorbed or not) over an :class:`MLAKVCache`."""

    def __init__(self, name: str, capabilities: Capabilities, state_type: type[S]) -> None:
        super().__init__(name, capabilities, state_type, MLAQuery, MLAKVCache)


class GQABackend(PagedBackend[S, GQAQuery, GQAKVCache]):
    """A backend of GQA/MHA problems over a :class:`GQAKVCache`."""

    def __init__(self, name: str, capabilities: Capabilities, state_type: type[S]) -> None:
        super().__init__(name, capabilities, state_type, GQAQuery, GQAKVCache)


class GroupedMLABackend(MLABackend[GroupedBatch]):
    """An MLA backend over the latent pool, planned as a :class:`GroupedBatch` of groups of
    about ``group_bytes`` gathered bytes."""

    def __init__(self, name: str, capabilities: Capabilities, group_bytes: int) -> None:
        super().__init__(name, capabilities, GroupedBatch)
        self.group_bytes = require_int("group_bytes", group_bytes, min=1)

    def prepare(self, problem: AttentionProblem, structure: PagedStructure) -> GroupedBatch:
        shape = problem.mla_shape()
        width = shape.kv_lora_rank + shape.rope_dim
        return grouped_batch(problem, structure, width, self.group_bytes)
