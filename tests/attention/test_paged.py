"""Padded-batch machinery: visibility limits, masked softmax with LSE, and the LSE merge."""

from __future__ import annotations

import torch

from kvplane.attention import merge_states
from kvplane.attention.paged import (
    BatchGroup,
    batch_groups,
    build_batch_index,
    gather_group,
    pad_queries,
    softmax_lse,
    unpad_rows,
)
from kvplane.attention.synthetic import synthetic_metadata


def test_limits_bottom_right_causal_and_padding() -> None:
    meta, _ = synthetic_metadata([2, 1, 3], [5, 0, 2], 4)
    s = meta.structure()
    idx = build_batch_index(meta, s, True, torch.device("cpu"))
    # request 0: rows see 4, 5; request 1: nothing; request 2: q_len 3 > kv_len 2 -> 0, 1, 2
    assert idx.limits.tolist() == [[4, 5, 0], [0, 0, 0], [0, 1, 2]]
    full = build_batch_index(meta, s, False, torch.device("cpu"))
    assert full.limits.tolist() == [[5, 5, 0], [0, 0, 0], [2, 2, 2]]
    assert idx.q_rows is not None and idx.q_rows.tolist() == [[0, 1, 0], [2, 0, 0], [3, 4, 5]]
    x = torch.arange(6.0).view(6, 1, 1)
    padded = pad_queries(x, idx)
    assert padded.shape == (3, 3, 1, 1)
    assert torch.equal(unpad_rows(padded, idx), x)
    assert idx.pages[1].tolist() == [0, 0] and idx.kv_tokens == 8


def test_uniform_batches_pad_by_view() -> None:
    meta, _ = synthetic_metadata([2, 2], [3, 4], 4)
    idx = build_batch_index(meta, meta.structure(), True, torch.device("cpu"))
    x = torch.randn(4, 2, 3)
    assert idx.q_rows is None
    assert pad_queries(x, idx).data_ptr() == x.data_ptr()


def test_softmax_lse_masks_and_handles_empty_rows() -> None:
    scores = torch.tensor(
        [[[[0.0, 0.0, 5.0], [1.0, 2.0, 3.0]]]]
    )  # [n=1, t=2, H=1... ] reshaped below
    scores = scores.view(1, 2, 1, 3).clone()
    mask = torch.tensor([[[True, True, False], [False, False, False]]])
    p, lse = softmax_lse(scores, mask)
    assert p[0, 0, 0].tolist() == [0.5, 0.5, 0.0]
    assert p[0, 1, 0].tolist() == [0.0, 0.0, 0.0]
    assert lse[0, 0, 0].item() == torch.log(torch.tensor(2.0)).item()
    assert torch.isneginf(lse[0, 1, 0])


def test_merge_states_equals_attention_over_union() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 10, dtype=torch.float64)
    values = torch.randn(10, 4, dtype=torch.float64)

    def attend(sl: slice) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logsumexp(logits[:, sl], -1)
        return torch.softmax(logits[:, sl], -1) @ values[sl], lse

    o, lse = merge_states(*attend(slice(0, 4)), *attend(slice(4, 10)))
    o_all, lse_all = attend(slice(0, 10))
    torch.testing.assert_close(o, o_all, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, lse_all, atol=1e-12, rtol=1e-12)
    empty_o, empty_lse = (
        torch.zeros(3, 4, dtype=torch.float64),
        torch.full((3,), float("-inf"), dtype=torch.float64),
    )
    o2, lse2 = merge_states(empty_o, empty_lse, o_all, lse_all)
    assert torch.equal(o2, o_all) and torch.equal(lse2, lse_all)
    o3, lse3 = merge_states(empty_o, empty_lse, empty_o, empty_lse)
    assert torch.equal(o3, empty_o) and bool(torch.isneginf(lse3).all())


def test_batch_groups_fit_the_budget_and_know_their_masks() -> None:
    meta, _ = synthetic_metadata([1, 1, 2, 1, 1], [8, 5, 8, 0, 3], 4)
    s = meta.structure()
    # 2 pages x 4 tokens x 10 B = 80 B per request at the batch's widest
    assert batch_groups(s, True, 10, 160) == (
        BatchGroup(0, 2, 2, True),  # kv 5 sees 5 < 8 positions
        BatchGroup(2, 4, 2, True),  # q_len 2 causal: first row sees 7
        BatchGroup(4, 5, 1, True),  # kv 3 in one page of 4
    )
    assert batch_groups(s, False, 10, 160) == (
        BatchGroup(0, 2, 2, True),
        BatchGroup(2, 4, 2, True),  # kv 8 sees all 8 without causality, but kv 0 sees nothing
        BatchGroup(4, 5, 1, True),
    )
    assert batch_groups(s, False, 10, 1) == tuple(  # under one request: one request per group
        BatchGroup(i, i + 1, p, m)
        for i, (p, m) in enumerate([(2, False), (2, True), (2, False), (0, False), (1, True)])
    )
    assert batch_groups(s, False, 10, 400, align=2) == (  # 5 fit, aligned down to 4
        BatchGroup(0, 4, 2, True),
        BatchGroup(4, 5, 1, True),
    )
    assert batch_groups(s, False, 10, 1 << 20, align=2) == (BatchGroup(0, 5, 2, True),)


def test_gather_group_reads_only_its_requests_and_zeroes_the_tail() -> None:
    meta, pages = synthetic_metadata([1, 1, 1], [3, 6, 2], 2, shuffle_seed=1)
    s = meta.structure()
    idx = build_batch_index(meta, s, True, torch.device("cpu"))
    pool = torch.arange(pages * 2, dtype=torch.float32).view(pages, 2, 1) + 100
    out = torch.full((64,), float("nan"))
    group = BatchGroup(0, 2, 3, True)
    kv = gather_group(pool, idx, group, out)
    assert kv.shape == (2, 6, 1) and kv.data_ptr() == out.data_ptr()
    table = meta.dense().block_table
    for b, n in enumerate((3, 6)):
        want = pool[table[b, :3].long()].reshape(6)
        assert kv[b, :n, 0].tolist() == want[:n].tolist()
        assert kv[b, n:, 0].tolist() == [0.0] * (6 - n)


def test_a_window_sets_lows_masks_groups_and_zeroes_below_them() -> None:
    """Window 3: request 0 (rows at 6, 7) reads keys from 4 on; request 1 (kv 2) from 0;
    request 2 (no query) nothing, so its low is its kv_len."""
    meta, pages = synthetic_metadata([2, 1, 0], [8, 2, 4], 2, shuffle_seed=1)
    s = meta.structure()
    idx = build_batch_index(meta, s, True, torch.device("cpu"), window=3)
    assert idx.lows.tolist() == [4, 0, 4]
    assert build_batch_index(meta, s, True, torch.device("cpu")).lows.tolist() == [0, 0, 0]
    assert batch_groups(s, True, 10, 1, window=3, lows=idx.lows) == (
        BatchGroup(0, 1, 4, True, 2),  # from page 2 (key 4); row 7's window starts at 5
        BatchGroup(1, 2, 1, False),  # kv 2 < window: no key is cut
        BatchGroup(2, 3, 2, False, 2),  # nothing to read
    )
    assert batch_groups(s, True, 10, 1 << 20, window=3, lows=idx.lows) == (
        BatchGroup(0, 3, 4, True, 0),  # request 1 reads from key 0
    )
    pool = torch.arange(pages * 2, dtype=torch.float32).view(pages, 2, 1) + 100
    want = pool[meta.dense().block_table[0, :4].long()].reshape(8)
    kv = gather_group(pool, idx, BatchGroup(0, 1, 4, True, 2), torch.empty(64))
    assert kv[0, :, 0].tolist() == want[4:].tolist()  # only pages 2 and 3 are read
    kv = gather_group(pool, idx, BatchGroup(0, 2, 4, True, 0), torch.empty(64))
    assert kv[0, :, 0].tolist() == [0.0] * 4 + want[4:].tolist()  # below request 0's low
