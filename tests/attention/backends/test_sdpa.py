"""sdpa specifics: packed queries only, and the kernel's empty rows fixed to 0 / -inf."""

from __future__ import annotations

import pytest
import torch

from kvplane.attention import QueryLayout
from kvplane.attention.backends import SDPABackend
from kvplane.attention.backends.sdpa import kv_splits
from kvplane.attention.paged import merge_splits
from kvplane.errors import InvalidArgumentError
from kvplane.verdicts import Unsupported


def test_split_queries_are_unsupported(mla_inputs) -> None:
    v = SDPABackend().check(mla_inputs([1], [5], layout=QueryLayout.SPLIT).problem)
    assert v == Unsupported(("split query not supported",))
    assert SDPABackend().check(mla_inputs([1], [5], dtype=torch.float16).problem) == Unsupported(
        ("dtype torch.float16 not supported",)
    )


def test_rows_seeing_nothing(mla_inputs, run_backend) -> None:
    inputs = mla_inputs([3], [2], causal=True)  # first row sees no key
    res = run_backend("sdpa", inputs)
    assert torch.equal(res.out[0], torch.zeros_like(res.out[0]))
    assert bool(torch.isneginf(res.lse[0]).all()) and bool(torch.isfinite(res.lse[1:]).all())


def test_kv_splits_give_every_thread_work() -> None:
    assert kv_splits(1, 8192, 16, 2, 256) == 2  # one long decode on two threads
    assert kv_splits(2, 8192, 16, 2, 256) == 1  # two requests: work enough
    assert kv_splits(1, 8192, 16, 8, 256) == 8
    assert kv_splits(1, 768, 16, 4, 256) == 3  # at least 256 tokens a split
    assert kv_splits(1, 7 * 16, 16, 4, 4) == 1  # 7 pages: no equal page-aligned cut
    assert kv_splits(3, 1 << 20, 16, 4, 256) == 2


def test_merge_splits_is_attention_over_the_union() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 12, dtype=torch.float64)
    values = torch.randn(12, 3, dtype=torch.float64)
    parts = [slice(0, 5), slice(5, 12)]
    outs = torch.stack([torch.softmax(logits[:, sl], -1) @ values[sl] for sl in parts], 1).float()
    lses = torch.stack([torch.logsumexp(logits[:, sl], -1) for sl in parts], 1).float()
    lses[1, 0] = float("-inf")  # request 1 sees nothing of split 0 ...
    o, lse = merge_splits(outs, lses)
    torch.testing.assert_close(o[0], (torch.softmax(logits[0], -1) @ values).float())
    torch.testing.assert_close(lse[0], torch.logsumexp(logits[0], -1).float())
    assert torch.equal(o[1], outs[1, 1]) and lse[1] == lses[1, 1]  # ... so only split 1 counts
    o2, lse2 = merge_splits(outs, torch.full_like(lses, float("-inf")))
    assert torch.equal(o2, torch.zeros_like(o2)) and bool(torch.isneginf(lse2).all())


def test_split_settings_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="min_split_tokens must be a positive int"):
        SDPABackend(min_split_tokens=0)
    with pytest.raises(InvalidArgumentError, match="work_items must be a positive int, got -2"):
        SDPABackend(work_items=-2)
