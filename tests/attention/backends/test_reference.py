"""The oracle on a hand-computed example, exactly."""

from __future__ import annotations

import math

import torch

from kvplane.attention import LSEBase, MLAKVCache, MLAQuery, PlanMetadata, mla_problem
from kvplane.attention.backends import ReferenceBackend


def test_hand_computed_weights_three_to_one() -> None:
    # r=2, p=1, one head; keys c_kv = [1,0] and [0,1]; q_nope=[1,0]; sm_scale=ln 3
    # logits ln3 and 0 -> weights 3/4 and 1/4 -> out [0.75, 0.25], lse = ln 4
    pool = torch.full((3, 2, 3), float("nan"))
    pool[2, 0] = torch.tensor([1.0, 0.0, 0.0])
    pool[2, 1] = torch.tensor([0.0, 1.0, 0.0])
    meta = PlanMetadata.from_dense(
        2,
        torch.tensor([[2, 0]], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
    )
    q = MLAQuery.packed(torch.tensor([[[1.0, 0.0, 0.0]]]), 2)
    cache = MLAKVCache(pool, 2)
    problem = mla_problem(q, cache, meta, sm_scale=math.log(3.0), causal=True)
    ref = ReferenceBackend()
    res = ref.run(ref.plan(problem), q, cache)
    assert res.lse_base is LSEBase.E
    assert res.out.tolist() == [[[0.75, 0.25]]]
    assert res.lse.dtype == torch.float32
    assert res.lse.item() == torch.tensor(math.log(4.0), dtype=torch.float32).item()
