"""Typed inputs: zero-copy packed/split views, validation naming the bad value, up-projection."""

from __future__ import annotations

import pytest
import torch

from kvplane.attention import GQAKVCache, GQAQuery, MLAKVCache, MLAQuery, MLAUpProjection
from kvplane.errors import InvalidArgumentError


def test_packed_query_splits_by_views() -> None:
    q = torch.arange(2 * 3 * 10, dtype=torch.float32).view(2, 3, 10)
    mq = MLAQuery.packed(q, 8)
    assert mq.nope.data_ptr() == q.data_ptr()
    assert mq.pe.data_ptr() == q.data_ptr() + 8 * 4
    assert (mq.num_tokens, mq.num_heads, mq.nope_dim, mq.rope_dim) == (2, 3, 8, 2)
    assert mq.packed_data is q


def test_adjacent_split_halves_give_back_the_packed_view() -> None:
    q = torch.randn(4, 2, 12)
    mq = MLAQuery.split(q[..., :8], q[..., 8:])
    assert mq.packed_data is not None
    assert mq.packed_data.data_ptr() == q.data_ptr()
    assert torch.equal(mq.packed_data, q)


def test_separate_split_tensors_have_no_packed_view() -> None:
    mq = MLAQuery.split(torch.randn(4, 2, 8), torch.randn(4, 2, 4))
    assert mq.packed_data is None
    swapped = torch.randn(4, 2, 12)
    assert MLAQuery.split(swapped[..., 4:], swapped[..., :4]).packed_data is None


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: MLAQuery.packed(torch.randn(2, 3), 1), "q must be a 3-D floating tensor"),
        (lambda: MLAQuery.packed(torch.randn(2, 3, 4), 4), r"nope_dim must be in \(0, 4\), got 4"),
        (
            lambda: MLAQuery.packed(torch.randn(2, 3, 4).transpose(1, 2), 1),
            "contiguous in its last dim",
        ),
        (lambda: MLAQuery.split(torch.randn(2, 3, 4), torch.randn(2, 2, 4)), "differ in"),
        (
            lambda: MLAQuery.split(torch.randn(2, 3, 4), torch.randn(2, 3, 4).double()),
            "dtypes/devices",
        ),
        (
            lambda: MLAKVCache(torch.randn(2, 4, 10), 10),
            r"kv_lora_rank must be an int in \(0, 10\)",
        ),
        (
            lambda: MLAKVCache(
                torch.randn(2, 4, 10),
                8,
                MLAUpProjection(torch.randn(2, 6, 3), torch.randn(2, 6, 3)),
            ),
            "up_proj has rank 6",
        ),
        (lambda: MLAUpProjection(torch.randn(2, 6, 3), torch.randn(3, 6, 3)), "differ in"),
        (lambda: GQAKVCache(torch.randn(2, 4, 1, 8), torch.randn(2, 4, 2, 8)), "one shape"),
        (lambda: GQAQuery(torch.randint(0, 3, (2, 3, 4))), "floating"),
        (
            lambda: GQAKVCache(torch.zeros(2, 4, 0, 8), torch.zeros(2, 4, 0, 8)),
            r"k needs >= 1 head \(dim 2\), got shape \(2, 4, 0, 8\)",
        ),
        (lambda: GQAQuery(torch.zeros(1, 0, 8)), r"q needs >= 1 head \(dim 1\)"),
        (lambda: MLAQuery.packed(torch.zeros(1, 0, 8), 4), r"q needs >= 1 head \(dim 1\)"),
        (
            lambda: MLAQuery.split(torch.zeros(1, 0, 4), torch.zeros(1, 0, 4)),
            r"q_nope needs >= 1 head \(dim 1\)",
        ),
        (
            lambda: MLAUpProjection(torch.zeros(0, 6, 3), torch.zeros(0, 6, 3)),
            r"w_uk needs >= 1 head \(dim 0\)",
        ),
    ],
)
def test_bad_inputs_are_rejected(make, match) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        make()


def test_cache_views_are_zero_copy() -> None:
    data = torch.randn(3, 4, 10)
    c = MLAKVCache(data, 8)
    assert c.ckv.data_ptr() == data.data_ptr() and c.ckv.shape == (3, 4, 8)
    assert c.kpe.data_ptr() == data.data_ptr() + 8 * 4 and c.kpe.shape == (3, 4, 2)
    assert (c.num_pages, c.page_size, c.rope_dim) == (3, 4, 2)


def test_up_projection_absorb_and_project_exact() -> None:
    w_uk = torch.tensor([[[1.0], [2.0]]])  # [H=1, r=2, d_nope=1]
    w_uv = torch.tensor([[[1.0, 0.0], [0.0, 3.0]]])  # [H=1, r=2, d_v=2]
    up = MLAUpProjection(w_uk, w_uv)
    assert (up.num_heads, up.kv_lora_rank, up.qk_nope_dim, up.v_head_dim) == (1, 2, 1, 2)
    assert up.absorb_query(torch.tensor([[[5.0]]])).tolist() == [[[5.0, 10.0]]]
    assert up.project_output(torch.tensor([[[1.0, 2.0]]])).tolist() == [[[1.0, 6.0]]]


def test_gqa_cache_properties() -> None:
    c = GQAKVCache(torch.zeros(5, 4, 2, 8), torch.zeros(5, 4, 2, 8))
    assert (c.num_pages, c.page_size, c.num_kv_heads, c.head_dim) == (5, 4, 2, 8)
