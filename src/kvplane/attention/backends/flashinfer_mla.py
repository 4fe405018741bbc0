"""``flashinfer``: an adapter over FlashInfer's ``BatchMLAPagedAttentionWrapper`` (CUDA only).

One wrapper per plan over a shared per-device workspace; LSE base 2. ``flashinfer`` is imported
only inside ``plan``. See docs/attention.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvplane.attention.backends.common import MLABackend, cuda_package_reasons
from kvplane.attention.base import Capabilities, Plan
from kvplane.attention.inputs import MLAKVCache, MLAQuery
from kvplane.attention.metadata import PagedStructure
from kvplane.attention.problem import AttentionKind, AttentionProblem, AttentionResult, LSEBase
from kvplane.errors import UnsupportedError

NAME = "flashinfer"
WORKSPACE_BYTES = 128 << 20
INSTALL_HINT = "install FlashInfer (pip install flashinfer-python) on a machine with an NVIDIA GPU"


@dataclass(frozen=True, slots=True)
class FlashInferState:
    wrapper: Any  # flashinfer.mla.BatchMLAPagedAttentionWrapper, planned for this problem


class FlashInferMLABackend(MLABackend[FlashInferState]):
    """FlashInfer's Batch-MLA paged attention; see the module docstring."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        caps = Capabilities(
            kinds=frozenset({AttentionKind.MLA}),
            devices=frozenset({"cuda"}),
            dtypes=frozenset({torch.float16, torch.bfloat16}),
            lse_base=LSEBase.TWO,
            mla_dims=frozenset({(512, 64)}),
            min_cuda_arch=(8, 0),
            packages=frozenset({"flashinfer"}),
        )
        super().__init__(NAME, caps, FlashInferState)
        self._workspace_bytes = workspace_bytes
        self._workspaces: dict[torch.device, torch.Tensor] = {}

    def environment_reasons(self, problem: AttentionProblem) -> Sequence[str]:
        reasons = []
        if 0 in problem.metadata.structure().kv_lens:
            reasons.append("a request with kv_len 0 (left to the CPU backends)")
        return reasons + cuda_package_reasons("flashinfer", INSTALL_HINT)

    def _workspace(self, device: torch.device) -> torch.Tensor:
        ws = self._workspaces.get(device)
        if ws is None:
            ws = torch.empty(self._workspace_bytes, dtype=torch.uint8, device=device)
            self._workspaces[device] = ws
        return ws

    def prepare(self, problem: AttentionProblem, structure: PagedStructure) -> FlashInferState:
        missing = cuda_package_reasons("flashinfer", INSTALL_HINT)
        if missing:
            raise UnsupportedError("; ".join(missing))
        mla = importlib.import_module("flashinfer.mla")
        shape = problem.mla_shape()
        csr = problem.metadata.csr()
        dev = problem.device

        def i32(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=dev, dtype=torch.int32)

        wrapper = mla.BatchMLAPagedAttentionWrapper(self._workspace(dev), backend="auto")
        wrapper.plan(
            i32(csr.qo_indptr), i32(csr.kv_indptr), i32(csr.kv_indices), i32(csr.kv_len),
            shape.num_heads, shape.kv_lora_rank, shape.rope_dim, structure.page_size,
            problem.causal, problem.sm_scale, problem.dtype, problem.dtype,
        )  # fmt: skip
        return FlashInferState(wrapper)

    def attend(
        self, plan: Plan, state: FlashInferState, query: MLAQuery, cache: MLAKVCache
    ) -> AttentionResult:
        out, lse = state.wrapper.run(query.nope, query.pe, cache.ckv, cache.kpe, return_lse=True)
        return AttentionResult(out, lse, LSEBase.TWO)
