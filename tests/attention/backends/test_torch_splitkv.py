"""Split-KV specifics: split sizing, request ordering, and equality across split sizes."""

from __future__ import annotations

import pytest
import torch

from kvplane.attention.backends import TorchSplitKVBackend
from kvplane.attention.backends.torch_splitkv import SplitPlan, split_pages_for
from kvplane.attention.problem import QueryLayout
from kvplane.errors import InvalidArgumentError


def test_plan_sorts_requests_and_counts_active(mla_inputs) -> None:
    inputs = mla_inputs([1, 1, 1], [5, 17, 0])
    plan = TorchSplitKVBackend(split_tokens=8).plan(inputs.problem)
    sp = plan.state
    assert isinstance(sp, SplitPlan)
    assert sp.order.tolist() == [1, 0, 2] and sp.inverse.tolist() == [1, 0, 2]
    assert sp.split_pages == 2  # 8 tokens of page size 4
    assert sp.active == (2, 1, 1)  # positions [0,8): 17 and 5; [8,16): 17; [16,24): 17
    assert sp.ragged == (True, False, True)
    assert sp.masked == (True, False, True)  # 5 < 8; 17 >= 16; 17 < 24


@pytest.mark.parametrize("split", [1, 4, 12, 1000])
def test_any_split_size_matches_reference(split, mla_inputs, run_backend, assert_close) -> None:
    inputs = mla_inputs([2, 1, 3], [13, 29, 3])
    b = TorchSplitKVBackend(split_tokens=split)
    assert_close(
        b.run(b.plan(inputs.problem), inputs.query, inputs.cache),
        run_backend("reference", inputs),
        torch.float32,
    )


@pytest.mark.parametrize("layout", list(QueryLayout))
def test_rows_that_see_nothing_and_unmasked_splits(
    layout, mla_inputs, run_backend, assert_close
) -> None:
    # causal q_len 4 over kv_len 2: the first two rows see no key (out 0, lse -inf); the
    # splits [4, 8) and [12, 16) need no mask; the online state is rescaled across splits
    inputs = mla_inputs([4, 1, 3], [2, 16, 11], layout=layout)
    b = TorchSplitKVBackend(split_tokens=4)
    plan = b.plan(inputs.problem)
    assert plan.state.active == (3, 2, 2, 1)
    assert plan.state.masked == (True, False, True, False)
    got = b.run(plan, inputs.query, inputs.cache)
    assert_close(got, run_backend("reference", inputs), torch.float32)
    assert torch.equal(got.out[:2], torch.zeros_like(got.out[:2]))
    assert got.lse_natural()[:2].isneginf().all()


def test_split_sizing() -> None:
    assert split_pages_for(32, 576 * 4, 16, 512) == 7  # 8 MiB / (32 x 2304 B) = 113 tokens
    assert split_pages_for(1, 576 * 4, 16, 512) == 227
    assert split_pages_for(1, 576 * 4, 16, 4) == 4  # never more than the longest request
    assert split_pages_for(4096, 576 * 4, 16, 512) == 4  # at least MIN_SPLIT_TOKENS
    with pytest.raises(InvalidArgumentError, match="split_tokens must be a positive int, got 0"):
        TorchSplitKVBackend(split_tokens=0)
