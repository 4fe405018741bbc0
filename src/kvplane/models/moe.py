"""DeepSeek's (and Granite's) mixture of experts: a top-k router, routed SwiGLU experts and
shared experts.

Experts run grouped by expert, one batched SwiGLU each; no loop per token. Routing rules and
weight names: docs/attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional

from kvplane.models.config import MoEConfig
from kvplane.models.layers import SwiGLU
from kvplane.models.weights import TensorSource, WeightKind


def route(
    logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, experts [T, k] int64)`` from router ``logits [T, E]`` (fp32)."""
    if cfg.scoring == "topk_softmax":  # transformers' GraniteMoeHybridTopKRouter, same calls
        top, experts = logits.topk(cfg.experts_per_token, dim=-1)
        return torch.softmax(top, dim=-1), experts
    t, e = logits.shape
    g = cfg.num_groups
    if cfg.scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores + bias if bias is not None else scores
        group_scores = choice.view(t, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
        fill = float("-inf")
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        choice = scores
        group_scores = scores.view(t, g, e // g).max(dim=-1).values
        fill = 0.0
    if cfg.topk_method != "greedy" and cfg.topk_groups < g:
        group_idx = torch.topk(group_scores, k=cfg.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        keep = group_mask[:, :, None].expand(t, g, e // g).reshape(t, e)
        choice = choice.masked_fill(~keep, fill)
    experts = torch.topk(choice, k=cfg.experts_per_token, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if cfg.scoring == "sigmoid":
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts
    if cfg.experts_per_token > 1 and cfg.norm_topk_prob:  # DeepSeek-V2: renormalise or scale
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), experts
    return weights * cfg.routed_scaling_factor, experts


@dataclass(frozen=True, slots=True)
class MoE:
    """Router + routed experts (``gate_up [E, 2I, hidden]``, ``down [E, hidden, I]``) + shared."""

    cfg: MoEConfig
    router: torch.Tensor
    correction_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    shared: SwiGLU | None

    @classmethod
    def load(cls, src: TensorSource, prefix: str, cfg: MoEConfig, hidden: int, v3: bool) -> MoE:
        e, inner = cfg.num_experts, cfg.intermediate_size
        router = src.take(f"{prefix}.gate.weight", (e, hidden), WeightKind.MATRIX).float()
        bias = None
        if v3:
            bias = src.take(f"{prefix}.gate.e_score_correction_bias", (e,), WeightKind.BIAS)
            bias = bias.float()
        fused = f"{prefix}.experts.gate_up_proj"
        if src.has(fused):
            gate_up = src.take(fused, (e, 2 * inner, hidden), WeightKind.MATRIX)
            down = src.take(f"{prefix}.experts.down_proj", (e, hidden, inner), WeightKind.MATRIX)
        else:
            per = [SwiGLU.load(src, f"{prefix}.experts.{i}", hidden, inner) for i in range(e)]
            gate_up = torch.stack([torch.cat((m.gate.weight, m.up.weight)) for m in per])
            down = torch.stack([m.down.weight for m in per])
        shared = None
        if cfg.num_shared_experts:
            shared_dim = inner * cfg.num_shared_experts
            shared = SwiGLU.load(src, f"{prefix}.shared_experts", hidden, shared_dim)
        return cls(cfg, router, bias, gate_up, down, shared)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` in ``x``'s dtype."""
        logits = functional.linear(x.float(), self.router)
        weights, experts = route(logits, self.cfg, self.correction_bias)
        k = self.cfg.experts_per_token
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        tokens = order // k
        pair_w = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            gate, up = functional.linear(x[rows], self.gate_up[expert]).chunk(2, dim=-1)
            y = functional.linear(functional.silu(gate) * up, self.down[expert])
            y = y * pair_w[start : start + n, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        if self.shared is not None:
            out = out + self.shared(x)
        return out
