"""sdpa specifics: packed queries only, and the kernel's empty rows fixed to 0 / -inf."""

from __future__ import annotations

import torch

from kvplane.attention import QueryLayout, Unsupported
from kvplane.attention.backends import SDPABackend


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
