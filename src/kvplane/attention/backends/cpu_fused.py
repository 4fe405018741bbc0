"""``cpu_fused``: absorbed MLA by a fused flash-decoding C kernel that reads pages in place.

The kernel (``native/mla_decode.c``) reads the cache once and never copies it; a short batch is
split by key range and merged by LSE. Float32 and bf16 caches; CPU only; Unsupported without a
C compiler. See docs/attention.md.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvplane.attention.backends.common import MLABackend
from kvplane.attention.backends.torch_mla import padded_query
from kvplane.attention.base import Capabilities, Plan
from kvplane.attention.inputs import MLAKVCache, MLAQuery
from kvplane.attention.metadata import PagedStructure
from kvplane.attention.paged import BatchIndex, build_batch_index, merge_splits, padded_result
from kvplane.attention.problem import (
    AttentionKind,
    AttentionProblem,
    AttentionResult,
    LSEBase,
    window_starts,
)
from kvplane.errors import BackendError, UnsupportedError
from kvplane.native import KernelBuild, load_kernel
from kvplane.validators import require_int

NAME = "cpu_fused"
SOURCE = Path(__file__).parent / "native" / "mla_decode.c"
DTYPES = frozenset({torch.float32, torch.bfloat16})
MIN_SPLIT_TOKENS = 512
"""By default a request is cut into key ranges of at least this many positions."""

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURE: list[type[ctypes.c_int64 | ctypes.c_void_p | ctypes.c_int]] = [
    _PTR, _I64, _I64, _I64, _I64, _I64, _INT, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR,
    _I64, _PTR, _PTR, _INT,
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class FusedPlan:
    """The padded batch index, each query row's visible keys ``[firsts, limits)`` (``[B, t_max *
    H]``; ``firsts`` ``None`` without a sliding window), the work items ``[B * splits, 3]``
    (request, first key, end key) over the keys some row sees and ``splits`` per request."""

    index: BatchIndex
    limits: torch.Tensor
    firsts: torch.Tensor | None
    items: torch.Tensor
    splits: int


def splits_for(batch: int, max_kv_len: int, threads: int, min_tokens: int) -> int:
    """Key ranges per request: 1 for a batch of >= 2 x ``threads``, else enough ranges for
    every thread to have about two items, none shorter than ``min_tokens``."""
    if batch >= 2 * threads:
        return 1
    want = -(-2 * threads // batch)
    return max(1, min(want, max_kv_len // min_tokens))


class CPUFusedBackend(MLABackend[FusedPlan]):
    """Fused split-KV MLA decode/prefill in C; see the module docstring. ``threads`` (default
    ``torch.get_num_threads()`` at run time) and ``min_split_tokens`` shape the work items."""

    def __init__(
        self, *, threads: int | None = None, min_split_tokens: int = MIN_SPLIT_TOKENS
    ) -> None:
        if threads is not None:
            require_int("threads", threads, min=1)
        require_int("min_split_tokens", min_split_tokens, min=1)
        self._threads, self._min_split = threads, min_split_tokens
        caps = Capabilities(
            kinds=frozenset({AttentionKind.MLA}), devices=frozenset({"cpu"}), dtypes=DTYPES,
            lse_base=LSEBase.E, sliding_window=True,
        )  # fmt: skip
        super().__init__(NAME, caps, FusedPlan)
        self._lock = threading.Lock()
        self._build: KernelBuild | None = None

    def _kernel(self) -> KernelBuild:
        with self._lock:
            if self._build is None:
                self._build = load_kernel(SOURCE, {"kvp_mla_attend": (_SIGNATURE, ctypes.c_int)})
            return self._build

    def _thread_count(self) -> int:
        return self._threads if self._threads is not None else torch.get_num_threads()

    def environment_reasons(self, problem: AttentionProblem) -> Sequence[str]:
        reason = self._kernel().reason
        return () if reason is None else (f"the C kernel is unavailable: {reason}",)

    def _library(self) -> ctypes.CDLL:
        build = self._kernel()
        if build.library is None:
            raise UnsupportedError(f"backend {NAME!r} cannot run: {build.reason}")
        return build.library

    def prepare(self, problem: AttentionProblem, structure: PagedStructure) -> FusedPlan:
        self._library()
        s, heads = structure, problem.num_heads
        cpu = torch.device("cpu")
        index = build_batch_index(problem.metadata, s, problem.causal, cpu, problem.window)
        kv, lim, low = index.kv_lens, index.limits, index.lows
        longest = int((kv - low).max()) if s.batch_size else 0
        splits = splits_for(s.batch_size, longest, self._thread_count(), self._min_split)
        span = -(-longest // splits)
        starts = low[:, None] + torch.arange(splits, dtype=torch.long)[None, :] * span
        begin = torch.minimum(starts, kv[:, None])
        end = torch.minimum(starts + span, kv[:, None])
        b = torch.arange(s.batch_size, dtype=torch.long)[:, None].expand(-1, splits)
        items = torch.stack([b, begin, end], dim=-1).reshape(-1, 3).contiguous()
        firsts = None
        if problem.window is not None:
            firsts = window_starts(lim, problem.window).repeat_interleave(heads, dim=1)
        limits = lim.repeat_interleave(heads, dim=1)  # new contiguous tensors
        return FusedPlan(index, limits, firsts, items, splits)

    def attend(
        self, plan: Plan, state: FusedPlan, query: MLAQuery, cache: MLAKVCache
    ) -> AttentionResult:
        p, idx, pool = plan.problem, state.index, cache.data  # pool rows: unit stride
        fn = self._library()
        r, dim = cache.kv_lora_rank, pool.shape[-1]
        b, t, heads = idx.batch, idx.t_max, p.num_heads
        rows = t * heads
        packed, nope, pe = padded_query(query, idx, torch.float32)
        q = packed if packed is not None else torch.cat([nope, pe], dim=-1)
        q = (q * p.sm_scale).reshape(b, rows, dim).contiguous()
        n = state.items.shape[0]
        firsts = None if state.firsts is None else state.firsts.data_ptr()
        out = torch.empty((n, rows, r), dtype=torch.float32)
        lse = torch.empty((n, rows), dtype=torch.float32)
        failed = fn.kvp_mla_attend(
            pool.data_ptr(), pool.stride(0), pool.stride(1), idx.page_size, dim, r,
            int(pool.dtype == torch.bfloat16), q.data_ptr(), rows, idx.pages.data_ptr(),
            idx.pages.stride(0), idx.kv_lens.data_ptr(), state.limits.data_ptr(),
            firsts, state.items.data_ptr(), n, out.data_ptr(), lse.data_ptr(),
            self._thread_count(),
        )  # fmt: skip
        if failed:
            raise BackendError(f"{NAME}: the kernel could not get its scratch memory")
        if state.splits > 1:
            out, lse = merge_splits(out.view(b, state.splits, rows, r), lse.view(b, -1, rows))
        return padded_result(out.view(b, t, heads, r), lse.view(b, t, heads), idx, p.dtype)
