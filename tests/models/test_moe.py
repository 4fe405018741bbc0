"""DeepSeek MoE: exact routing decisions and the grouped expert computation against a
per-token reference."""

from __future__ import annotations

import math

import pytest
import torch
from models_testlib import small_moe
from torch.nn import functional

from kvplane.models.moe import MoE, route
from kvplane.models.weights import RandomTensors


def _sorted(weights: torch.Tensor, experts: torch.Tensor) -> tuple[list[int], list[float]]:
    order = torch.argsort(experts[0])
    return experts[0][order].tolist(), weights[0][order].tolist()


def test_softmax_greedy_scales_the_top_k() -> None:
    cfg = small_moe(
        scoring="softmax", topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=2.0
    )
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    p = torch.softmax(logits, -1)[0]
    experts, weights = _sorted(*route(logits, cfg, None))
    assert experts == [2, 3]
    assert weights == pytest.approx([2 * float(p[2]), 2 * float(p[3])], rel=1e-6)


def test_softmax_renormalised_is_not_scaled() -> None:
    cfg = small_moe(
        scoring="softmax", topk_method="greedy", norm_topk_prob=True, routed_scaling_factor=2.0
    )
    experts, weights = _sorted(*route(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), cfg, None))
    assert experts == [2, 3]
    assert weights == pytest.approx([1 / (1 + math.e), math.e / (1 + math.e)], rel=1e-6)


def test_group_limited_greedy_keeps_the_best_group() -> None:
    cfg = small_moe(scoring="softmax", topk_method="group_limited_greedy", num_groups=2,
                    topk_groups=1, norm_topk_prob=False)  # fmt: skip
    # group 0 = experts {0, 1} holds the single best score; plain greedy would pick {0, 3}
    experts, _ = _sorted(*route(torch.tensor([[5.0, 0.0, 4.0, 4.5]]), cfg, None))
    assert experts == [0, 1]
    greedy = small_moe(scoring="softmax", topk_method="greedy", norm_topk_prob=False)
    assert _sorted(*route(torch.tensor([[5.0, 0.0, 4.0, 4.5]]), greedy, None))[0] == [0, 3]


def test_sigmoid_bias_steers_choice_not_weights() -> None:
    cfg = small_moe(num_experts=4, routed_scaling_factor=1.0, norm_topk_prob=False)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    experts, weights = _sorted(*route(logits, cfg, bias))
    assert experts == [0, 2]
    assert weights == pytest.approx([1 / (1 + math.exp(-2.0)), 0.5], rel=1e-6)
    normed = small_moe(routed_scaling_factor=3.0, norm_topk_prob=True)
    w, _ = route(logits, normed, bias)
    assert float(w.sum()) == pytest.approx(3.0, rel=1e-6)


def test_sigmoid_groups_rank_by_their_top_two() -> None:
    cfg = small_moe(num_experts=6, num_groups=2, topk_groups=1, experts_per_token=2)
    # group 0 = {0,1,2} holds the best expert but group 1 = {3,4,5} has the better top-2 sum
    logits = torch.tensor([[9.0, -9.0, -9.0, 3.0, 3.0, -9.0]])
    experts, _ = _sorted(*route(logits, cfg, None))
    assert experts == [3, 4]


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert, in plain Python."""
    weights, experts = route(functional.linear(x.float(), moe.router), moe.cfg, moe.correction_bias)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for w, e in zip(weights[t].tolist(), experts[t].tolist(), strict=True):
            gate, up = (moe.gate_up[e] @ x[t]).chunk(2)
            acc += w * (moe.down[e] @ (functional.silu(gate) * up))
        rows.append(acc)
    out = torch.stack(rows)
    return out + moe.shared(x) if moe.shared is not None else out


@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_grouped_experts_match_the_per_token_reference(shared: int, scoring: str) -> None:
    method = "noaux_tc" if scoring == "sigmoid" else "greedy"
    cfg = small_moe(num_experts=6, experts_per_token=3, num_shared_experts=shared,
                    scoring=scoring, topk_method=method)  # fmt: skip
    moe = MoE.load(RandomTensors(5), "m", cfg, 12, v3=scoring == "sigmoid")
    assert moe.gate_up.shape == (6, 32, 12) and moe.down.shape == (6, 12, 16)
    assert (moe.shared is None) == (shared == 0)
    x = torch.randn(9, 12, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), _reference(moe, x), rtol=1e-5, atol=1e-6)
