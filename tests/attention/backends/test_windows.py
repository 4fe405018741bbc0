"""Sliding windows in every CPU backend: each equals its float64 oracle on windowed problems."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvplane import native as native_build
from kvplane.attention import AttentionResult, Selector
from kvplane.attention.backends import (
    CPUFusedBackend,
    GQATorchBackend,
    MHABackend,
    SDPABackend,
    TorchMLABackend,
    TorchSplitKVBackend,
)
from kvplane.attention.backends.common import PagedBackend
from kvplane.attention.synthetic import Inputs, twin
from kvplane.verdicts import Supported

CASES = {
    "prefill_no_prefix": ([7, 3], [7, 3]),
    "prefill_chunk": ([4, 2], [11, 9]),
    "decode": ([1, 1, 1], [1, 37, 0]),
    "mixed": ([1, 6, 1], [13, 6, 2]),
}
WINDOWS = [1, 3, 8, 64]  # a single key, not a multiple of the page size 4, a multiple, > context

ABSORBED = {
    "torch": TorchMLABackend,
    "torch/1": lambda: TorchMLABackend(group_bytes=1),  # one request a group: from its window
    "torch_splitkv": TorchSplitKVBackend,
    "torch_splitkv/4": lambda: TorchSplitKVBackend(split_tokens=4),  # many splits, some skipped
    "sdpa": SDPABackend,
    "sdpa/split": lambda: SDPABackend(min_split_tokens=4, work_items=8),  # KV cut into splits
    "sdpa/1/split": lambda: SDPABackend(group_bytes=1, min_split_tokens=4, work_items=8),
    "cpu_fused": CPUFusedBackend,
    "cpu_fused/split": lambda: CPUFusedBackend(threads=3, min_split_tokens=4),
}
Backend = PagedBackend[Any, Any, Any]
NEEDS_CC = pytest.mark.skipif(native_build.compiler() is None, reason="needs a C compiler")


def _run(backend: Backend, inputs: Inputs) -> AttentionResult:
    assert isinstance(backend.check(inputs.problem), Supported)
    return backend.run(backend.plan(inputs.problem), inputs.query, inputs.cache)


def _poison(inputs: Inputs, pools: tuple[torch.Tensor, ...], below: float = 1e4) -> Inputs:
    """Keys below every row's window set to ``below`` (huge and finite for the oracle, which
    masks by bias, so a leak moves the output; NaN for a backend: keys no row sees are never
    read) and positions past each request's end NaN."""
    s = inputs.problem.metadata.structure()
    table = inputs.problem.metadata.dense().block_table
    window = inputs.problem.window
    assert window is not None
    for b, (ql, n) in enumerate(zip(s.q_lens, s.kv_lens, strict=True)):
        for pos in range(table.shape[1] * s.page_size):
            page, slot = int(table[b, pos // s.page_size]), pos % s.page_size
            for pool in pools:
                if pos >= n:
                    pool[page, slot] = float("nan")
                elif ql and pos < n - ql + 1 - window:
                    pool[page, slot] = below
    return inputs


def _backend(name: str) -> Backend:
    factory = ABSORBED[name]
    if name.startswith("cpu_fused") and native_build.compiler() is None:
        pytest.skip("needs a C compiler")
    return factory()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", sorted(ABSORBED))
def test_absorbed_mla_windows_match_reference(  # noqa: PLR0917
    name, case, window, mla_inputs, run_backend, assert_close
) -> None:
    q, kv = CASES[case]
    inputs = mla_inputs(q, kv, window=window)
    _poison(inputs, (inputs.cache.data,))
    want = run_backend("reference", inputs)
    assert torch.isfinite(want.out).all()
    assert_close(_run(_backend(name), inputs), want, torch.float32)
    _poison(inputs, (inputs.cache.data,), float("nan"))
    assert_close(_run(_backend(name), inputs), want, torch.float32)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", WINDOWS)
def test_mha_windows_match_reference(case, window, mla_inputs, run_backend, assert_close) -> None:
    q, kv = CASES[case]
    inputs = mla_inputs(q, kv, nope=8, v_dim=12, window=window)
    _poison(inputs, (inputs.cache.data,))
    want = run_backend("reference", inputs)
    assert_close(_run(MHABackend(), inputs), want, torch.float32)
    _poison(inputs, (inputs.cache.data,), float("nan"))
    assert_close(_run(MHABackend(group_bytes=1), inputs), want, torch.float32)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4)])  # GQA and MHA
def test_gqa_windows_match_reference(  # noqa: PLR0917
    case, window, heads, kv_heads, gqa_inputs, run_backend, assert_close
) -> None:
    q, kv = CASES[case]
    inputs = gqa_inputs(q, kv, heads=heads, kv_heads=kv_heads, window=window)
    _poison(inputs, (inputs.cache.k, inputs.cache.v))
    want = run_backend("gqa_reference", inputs)
    assert_close(_run(GQATorchBackend(), inputs), want, torch.float32)
    _poison(inputs, (inputs.cache.k, inputs.cache.v), float("nan"))
    assert_close(_run(GQATorchBackend(group_bytes=1), inputs), want, torch.float32)


@pytest.mark.parametrize("name", ["torch/1", "torch_splitkv/4", "sdpa/1/split", "cpu_fused/split"])
def test_bf16_windows_match_reference(name, mla_inputs, run_backend, assert_close) -> None:
    inputs = mla_inputs([3, 1], [19, 30], dtype=torch.bfloat16, window=6)
    want = run_backend("reference", inputs)
    assert_close(_run(_backend(name), inputs), want, torch.bfloat16)


def test_groups_gather_from_their_window(mla_inputs) -> None:
    """A decode at position 36 with window 8 reads keys [29, 37): its group gathers from page
    7 (key 28), masked (key 28 is outside)."""
    groups = TorchMLABackend().plan(mla_inputs([1], [37], window=8).problem).state.groups
    assert [(g.first, g.pages, g.masked) for g in groups] == [(7, 10, True)]


def test_split_kv_skips_splits_before_every_window(mla_inputs) -> None:
    """A decode at position 36 with window 8 sees keys [29, 37): of the 4-token splits only
    the last three hold any (28..31, 32..35, 36)."""
    inputs = mla_inputs([1], [37], window=8)
    sp = TorchSplitKVBackend(split_tokens=4).plan(inputs.problem).state
    assert sp.live == (False,) * 7 + (True, True, True)
    assert sp.masked[7] and not sp.masked[8] and sp.masked[9]  # 28 is outside; 36: ragged end


@NEEDS_CC
def test_fused_items_start_at_the_window(mla_inputs) -> None:
    """The kernel's items cover only the keys some row sees: request 0's rows see from key
    ``(37 - 3 + 1) - 8 = 27`` on, request 1 (kv 5) everything, request 2 nothing."""
    inputs = mla_inputs([3, 2, 0], [37, 5, 4], window=8)
    st = CPUFusedBackend(threads=2, min_split_tokens=4).plan(inputs.problem).state
    assert st.splits == 2  # about two items per thread, over the 10 keys of request 0
    assert st.items.tolist() == [[0, 27, 32], [0, 32, 37], [1, 0, 5], [1, 5, 5], [2, 4, 4],
                                 [2, 4, 4]]  # fmt: skip
    assert st.firsts is not None and st.firsts.tolist()[0][::4] == [27, 28, 29]


def test_windowed_problems_pick_a_fast_backend_without_fallback(
    registry, mla_inputs, gqa_inputs
) -> None:
    selector = Selector(registry)
    assert selector.plan(mla_inputs([2], [9], window=4).problem).backend == "torch"
    assert selector.plan(mla_inputs([2], [9], nope=8, v_dim=12, window=4).problem).backend == "mha"
    assert selector.plan(gqa_inputs([2], [9], window=4).problem).backend == "gqa_torch"
    assert selector.fallback_ratio == 0.0


def test_a_twin_keeps_the_window(mla_inputs, gqa_inputs) -> None:
    for inputs in (mla_inputs([1], [9], window=5), gqa_inputs([1], [9], window=5)):
        assert twin(inputs.problem).problem.window == 5
