"""``flashinfer``: an adapter over FlashInfer's ``BatchMLAPagedAttentionWrapper`` (CUDA only).

FlashInfer's planned Batch-MLA API maps one to one onto this contract:

- ``plan``: the metadata's CSR form (``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_len``,
  int32 on the device) goes to ``wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr,
  num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
  kv_data_type)``. Each plan owns a fresh wrapper (FlashInfer keeps plan state in the wrapper),
  all sharing one float workspace per device, so plans of one backend must run on one stream.
- ``run``: ``wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=True)`` with the query's
  split views and the cache's ``ckv``/``kpe`` views of the packed pool (no copy).
  FlashInfer's LSE is base 2; the result says so.

``flashinfer`` is imported here only, inside ``plan``; without a GPU or the package ``check``
reports Unsupported with an install hint. Requests with ``kv_len == 0`` are declared
unsupported (left to the CPU backends) rather than relying on kernel behaviour for them.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from kvplane.attention.backends.torch_mla import check_inputs, empty_result
from kvplane.attention.base import Capabilities, Plan, Verdict, plan_state, verdict
from kvplane.attention.problem import AttentionKind, AttentionProblem, AttentionResult, LSEBase
from kvplane.errors import UnsupportedError

NAME = "flashinfer"
WORKSPACE_BYTES = 128 << 20
INSTALL_HINT = "install FlashInfer (pip install flashinfer-python) on a machine with an NVIDIA GPU"


def environment_reasons() -> list[str]:
    reasons = []
    if not torch.cuda.is_available():
        reasons.append(f"no CUDA device is available; {INSTALL_HINT}")
    if importlib.util.find_spec("flashinfer") is None:
        reasons.append(f"the flashinfer package is not installed; {INSTALL_HINT}")
    return reasons


@dataclass(frozen=True, slots=True)
class FlashInferState:
    wrapper: Any  # flashinfer.mla.BatchMLAPagedAttentionWrapper, planned for this problem


class FlashInferMLABackend:
    """FlashInfer's Batch-MLA paged attention; see the module docstring."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self._workspace_bytes = workspace_bytes
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._caps = Capabilities(
            kinds=frozenset({AttentionKind.MLA}),
            devices=frozenset({"cuda"}),
            dtypes=frozenset({torch.float16, torch.bfloat16}),
            lse_base=LSEBase.TWO,
            mla_dims=frozenset({(512, 64)}),
        )

    @property
    def name(self) -> str:
        return NAME

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def check(self, problem: AttentionProblem) -> Verdict:
        reasons = list(self._caps.reasons(problem))
        if 0 in problem.metadata.structure().kv_lens:
            reasons.append("a request with kv_len 0 (left to the CPU backends)")
        return verdict(reasons + environment_reasons())

    def _workspace(self, device: torch.device) -> torch.Tensor:
        ws = self._workspaces.get(device)
        if ws is None:
            ws = torch.empty(self._workspace_bytes, dtype=torch.uint8, device=device)
            self._workspaces[device] = ws
        return ws

    def plan(self, problem: AttentionProblem) -> Plan:
        missing = environment_reasons()
        if missing:
            raise UnsupportedError("; ".join(missing))
        mla = importlib.import_module("flashinfer.mla")
        s = problem.metadata.structure()
        shape = problem.mla_shape()
        csr = problem.metadata.csr()
        dev = problem.device

        def i32(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=dev, dtype=torch.int32)

        wrapper = mla.BatchMLAPagedAttentionWrapper(self._workspace(dev), backend="auto")
        wrapper.plan(
            i32(csr.qo_indptr), i32(csr.kv_indptr), i32(csr.kv_indices), i32(csr.kv_len),
            shape.num_heads, shape.kv_lora_rank, shape.rope_dim, s.page_size,
            problem.causal, problem.sm_scale, problem.dtype, problem.dtype,
        )  # fmt: skip
        return Plan(NAME, problem, s, FlashInferState(wrapper))

    def run(self, plan: Plan, query: object, cache: object) -> AttentionResult:
        st = plan_state(plan, NAME, FlashInferState)
        q, c = check_inputs(plan, query, cache)
        done = empty_result(plan, plan.problem.mla_shape().v_dim)
        if done is not None:
            return done
        out, lse = st.wrapper.run(q.nope, q.pe, c.ckv, c.kpe, return_lse=True)
        return AttentionResult(out, lse, LSEBase.TWO)
