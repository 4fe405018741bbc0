"""PlanMetadata: validation naming the bad value, lazy CSR <-> dense conversion, equivalence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.attention import PlanMetadata, QueryClass
from kvplane.errors import InvalidArgumentError


def i32(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def dense_example() -> PlanMetadata:
    # page size 4: request 0 has 5 tokens (pages 7, 3), request 1 has 0, request 2 has 4 (page 9)
    table = torch.tensor([[7, 3, 0], [0, 0, 0], [9, 5, 5]], dtype=torch.int32)
    return PlanMetadata.from_dense(4, table, i32(5, 0, 4), i32(1, 2, 1))


def test_dense_structure_and_csr_conversion() -> None:
    meta = dense_example()
    s = meta.structure()
    assert (s.q_lens, s.kv_lens, s.pages_needed, s.max_page) == ((1, 2, 1), (5, 0, 4), (2, 0, 1), 9)
    assert (s.num_tokens, s.max_q_len, s.max_kv_len, s.query_class) == (4, 2, 5, QueryClass.VARLEN)
    csr = meta.csr()
    assert csr.qo_indptr.tolist() == [0, 1, 3, 4]
    assert csr.kv_indptr.tolist() == [0, 2, 2, 3]
    assert csr.kv_indices.tolist() == [7, 3, 9]
    assert csr.kv_len.tolist() == [5, 0, 4]
    assert csr.kv_indices.dtype == torch.int32
    assert meta.csr() is csr  # memoized
    assert meta.given_forms == ("dense",)


def test_csr_to_dense_pads_with_page_zero() -> None:
    meta = PlanMetadata.from_csr(4, i32(0, 1, 2), i32(0, 3, 4), i32(5, 6, 8, 2, 99), i32(9, 1))
    d = meta.dense()
    assert d.block_table.tolist() == [[5, 6, 8], [2, 0, 0]]
    assert d.q_len.tolist() == [1, 1] and d.kv_len.tolist() == [9, 1]
    assert meta.structure().query_class is QueryClass.SINGLE


def test_extra_csr_pages_are_ignored_but_too_few_rejected() -> None:
    ok = PlanMetadata.from_csr(4, i32(0, 2), i32(0, 3), i32(1, 2, 3), i32(2))
    assert ok.structure().pages_needed == (1,)
    bad = PlanMetadata.from_csr(4, i32(0, 1), i32(0, 1), i32(1), i32(5))
    with pytest.raises(InvalidArgumentError, match="kv_len 5 needing 2 pages"):
        bad.structure()


def test_both_forms_must_agree() -> None:
    d = dense_example()
    same = PlanMetadata(4, csr=d.csr(), dense=d.dense())
    assert same.structure().kv_lens == (5, 0, 4)
    other = PlanMetadata.from_csr(4, i32(0, 1, 3, 4), i32(0, 2, 2, 3), i32(7, 4, 9), i32(5, 0, 4))
    with pytest.raises(InvalidArgumentError, match="different pages"):
        PlanMetadata(4, csr=other.csr(), dense=d.dense()).structure()
    lens = PlanMetadata.from_csr(4, i32(0, 1, 3, 4), i32(0, 2, 2, 3), i32(7, 3, 9), i32(6, 0, 4))
    with pytest.raises(InvalidArgumentError, match="kv lengths"):
        PlanMetadata(4, csr=lens.csr(), dense=d.dense()).structure()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: PlanMetadata(0, dense=dense_example().dense()), "page_size must be a positive"),
        (lambda: PlanMetadata(4), "needs a CSR form"),
        (lambda: PlanMetadata.from_csr(4, i32(0), i32(0), i32(), i32()), "needs >= 2 entries"),
        (
            lambda: PlanMetadata.from_csr(4, i32(0, 1), i32(0, 1), i32(1), i32(1, 1)),
            "kv_len must have 1",
        ),
        (
            lambda: PlanMetadata.from_dense(4, torch.zeros(2, 1), i32(1, 1), i32(1, 1)),
            "block_table must be",
        ),
        (
            lambda: PlanMetadata.from_dense(
                4, torch.zeros(1, 1, dtype=torch.int32), i32(1), torch.ones(1)
            ),
            "q_len must be",
        ),
    ],
)
def test_construction_rejects_bad_input(make, match) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        make()


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        (
            PlanMetadata.from_csr(4, i32(0, 2, 1), i32(0, 1, 2), i32(1, 2), i32(1, 1)),
            "never decrease",
        ),
        (PlanMetadata.from_csr(4, i32(1, 2), i32(0, 1), i32(1), i32(1)), "start at 0"),
        (PlanMetadata.from_csr(4, i32(0, 1), i32(0, 2), i32(1), i32(1)), "exceeds len"),
        (
            PlanMetadata.from_csr(4, i32(0, 1), i32(0, 1), i32(-3), i32(1)),
            "page ids must be >= 0, got -3",
        ),
        (
            PlanMetadata.from_dense(4, torch.zeros(1, 1, dtype=torch.int32), i32(-1), i32(1)),
            r"kv_len must be >= 0, got \[-1\]",
        ),
        (
            PlanMetadata.from_dense(4, torch.zeros(1, 1, dtype=torch.int32), i32(9), i32(1)),
            "block table has 1 columns",
        ),
        (
            PlanMetadata.from_dense(4, torch.zeros(1, 1, dtype=torch.int32), i32(1), i32(-2)),
            r"q_len must be >= 0, got \[-2\]",
        ),
    ],
)
def test_structure_rejects_bad_tables(meta, match) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        meta.structure()


def test_query_classes() -> None:
    table = torch.zeros((2, 1), dtype=torch.int32)
    uniform = PlanMetadata.from_dense(4, table, i32(4, 4), i32(3, 3)).structure()
    assert uniform.query_class is QueryClass.UNIFORM


@st.composite
def batches(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    b = draw(st.integers(1, 6))
    kv = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    q = draw(st.lists(st.integers(0, 5), min_size=b, max_size=b))
    extra = draw(st.integers(0, 3))
    width = max(1, *(-(-n // page_size) for n in kv)) + extra
    table = draw(
        st.lists(
            st.lists(st.integers(0, 500), min_size=width, max_size=width), min_size=b, max_size=b
        )
    )
    return page_size, torch.tensor(table, dtype=torch.int32), i32(*kv), i32(*q)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_dense_csr_dense_roundtrip(batch) -> None:
    page_size, table, kv, q = batch
    meta = PlanMetadata.from_dense(page_size, table, kv, q)
    csr = meta.csr()
    back = PlanMetadata(page_size, csr=csr)
    d = back.dense()
    s = meta.structure()
    assert back.structure() == s
    for b, need in enumerate(s.pages_needed):
        assert d.block_table[b, :need].tolist() == table[b, :need].tolist()
        assert d.block_table[b, need:].tolist() == [0] * (d.block_table.shape[1] - need)
    # the two forms, given together, are accepted as equivalent
    assert PlanMetadata(page_size, csr=csr, dense=meta.dense()).structure() == s
    assert int(csr.kv_indptr[-1]) == sum(s.pages_needed) == csr.kv_indices.numel()


INT64_MAX = 2**63 - 1


def i64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        (
            PlanMetadata.from_dense(
                16, torch.zeros((1, 1), dtype=torch.int64), i64(INT64_MAX), i64(1)
            ),
            rf"kv_len {INT64_MAX} needing 576460752303423488 pages but the block table has 1 col",
        ),
        (
            PlanMetadata.from_csr(16, i64(0, 1), i64(0, 1), i64(0), i64(INT64_MAX)),
            rf"kv_len {INT64_MAX} needing 576460752303423488 pages of 16 but kv_indptr gives it 1",
        ),
    ],
)
def test_kv_len_near_int64_max_does_not_overflow_the_page_count(meta, match) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        meta.structure()


def test_page_count_is_an_exact_ceil_division() -> None:
    meta = PlanMetadata.from_dense(
        4, torch.zeros((5, 2), dtype=torch.int64), i64(0, 1, 4, 5, 8), i64(1, 1, 1, 1, 1)
    )
    assert meta.structure().pages_needed == (0, 1, 1, 2, 2)
    assert meta.csr().kv_indptr.tolist() == [0, 0, 1, 2, 4, 6]
