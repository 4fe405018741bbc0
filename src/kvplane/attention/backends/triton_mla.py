"""``triton``: absorbed MLA over the paged latent cache in one Triton kernel (CUDA only).

Triton is imported only through :mod:`~kvplane.attention.backends.triton_mla_kernel`, after
``check`` found a CUDA device and the package. See docs/attention.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from kvplane.attention.backends.common import MLABackend, cuda_package_reasons
from kvplane.attention.base import Capabilities, Plan
from kvplane.attention.inputs import MLAKVCache, MLAQuery
from kvplane.attention.metadata import PagedStructure
from kvplane.attention.paged import build_batch_index, unpad_rows
from kvplane.attention.problem import (
    AttentionKind,
    AttentionProblem,
    AttentionResult,
    LSEBase,
    MLAShape,
)
from kvplane.errors import UnsupportedError

NAME = "triton"
BLOCK_H = 16
BLOCK_N = 32
INSTALL_HINT = "install Triton (pip install triton) on a machine with an NVIDIA GPU"


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


@dataclass(frozen=True, slots=True)
class TritonState:
    block_table: torch.Tensor  # [B, max_pages] int32 on the device
    tok_req: torch.Tensor  # [T] int32: request of each query token
    tok_limit: torch.Tensor  # [T] int32: visible KV positions of each query token


class TritonMLABackend(MLABackend[TritonState]):
    """Absorbed MLA in a Triton kernel; see the module docstring."""

    def __init__(self) -> None:
        caps = Capabilities(
            kinds=frozenset({AttentionKind.MLA}),
            devices=frozenset({"cuda"}),
            dtypes=frozenset({torch.float16, torch.bfloat16}),
            lse_base=LSEBase.E,
            packages=frozenset({"triton"}),
        )
        super().__init__(NAME, caps, TritonState)
        self._kernel_module: ModuleType | None = None

    def environment_reasons(self, problem: AttentionProblem) -> Sequence[str]:
        reasons = []
        if isinstance(problem.shape, MLAShape):
            r, p = problem.shape.kv_lora_rank, problem.shape.rope_dim
            if not (_pow2_at_least_16(r) and _pow2_at_least_16(p)):
                reasons.append(f"MLA dims (r, p)=({r}, {p}) must be powers of two >= 16")
        return reasons + cuda_package_reasons("triton", INSTALL_HINT)

    def _kernel(self) -> ModuleType:
        if self._kernel_module is None:
            missing = cuda_package_reasons("triton", INSTALL_HINT)
            if missing:
                raise UnsupportedError("; ".join(missing))
            self._kernel_module = importlib.import_module(
                "kvplane.attention.backends.triton_mla_kernel"
            )
        return self._kernel_module

    def prepare(self, problem: AttentionProblem, structure: PagedStructure) -> TritonState:
        s = structure
        self._kernel()  # fail here, before anything is published, if Triton cannot load
        idx = build_batch_index(problem.metadata, s, problem.causal, problem.device)
        lens = torch.tensor(s.q_lens, dtype=torch.long, device=problem.device)
        tok_req = torch.repeat_interleave(torch.arange(s.batch_size, device=problem.device), lens)
        tok_limit = unpad_rows(idx.limits, idx)
        return TritonState(idx.pages.int(), tok_req.int(), tok_limit.int())

    def attend(
        self, plan: Plan, state: TritonState, query: MLAQuery, cache: MLAKVCache
    ) -> AttentionResult:
        st, q, c = state, query, cache
        shape = plan.problem.mla_shape()
        kernel = self._kernel().mla_paged_decode_kernel
        t, h, r = q.num_tokens, shape.num_heads, shape.kv_lora_rank
        out = torch.empty((t, h, r), dtype=plan.problem.dtype, device=plan.problem.device)
        lse = torch.empty((t, h), dtype=torch.float32, device=plan.problem.device)
        grid = (t, -(-h // BLOCK_H))
        kernel[grid](
            q.nope, q.pe, c.data, st.block_table, st.tok_req, st.tok_limit, out, lse,
            q.nope.stride(0), q.nope.stride(1), q.pe.stride(0), q.pe.stride(1),
            c.data.stride(0), c.data.stride(1), st.block_table.stride(0),
            out.stride(0), out.stride(1), lse.stride(0),
            h, plan.problem.sm_scale,
            page_size=c.page_size, rank=r, rope=shape.rope_dim,
            block_h=BLOCK_H, block_n=BLOCK_N, num_warps=4, num_stages=1,
        )  # fmt: skip
        return AttentionResult(out, lse, LSEBase.E)
