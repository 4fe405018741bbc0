"""descriptors: a list's cached facts are exact, kept, and drive the checks submit makes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import PlanError
from kvplane.ids import RegionId
from kvplane.transports.descriptors import (
    DescriptorList,
    check_pairing,
    concat_descriptors,
    row_map,
)
from kvplane.transports.rows import copy_rows_numpy, copy_rows_torch
from kvplane.transports.workers import CopyWorkers

triples = st.lists(
    st.tuples(st.integers(1, 3), st.integers(0, 200), st.integers(1, 40)), min_size=1, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(triples=triples)
def test_facts_match_brute_force(triples):
    d = DescriptorList.of(triples)
    f = d.facts
    regions = sorted({r for r, _, _ in triples})
    assert f.region_ids.tolist() == regions
    assert f.region_ends.tolist() == [max(o + n for r, o, n in triples if r == g) for g in regions]
    lengths = {n for _, _, n in triples}
    assert f.one_length == (lengths.pop() if len(lengths) == 1 else None)
    assert f.single_region == (len(regions) == 1)
    cont = [b[0] == a[0] and b[1] == a[1] + a[2] for a, b in itertools.pairwise(triples)]
    assert f.continues.tolist() == cont
    touched: dict[tuple[int, int], int] = {}
    first = None
    for i, (r, o, n) in enumerate(triples):
        for b in range(o, o + n):
            if (r, b) in touched and first is None:
                first = (touched[(r, b)], i)
            touched.setdefault((r, b), i)
    assert (f.overlap is None) == (first is None)
    if f.overlap is not None:  # the pair found really shares a byte
        (ra, oa, na), (rb, ob, nb) = triples[f.overlap[0]], triples[f.overlap[1]]
        assert f.overlap[0] < f.overlap[1] and ra == rb and oa < ob + nb and ob < oa + na


def test_overlap_names_the_first_neighbours_in_address_order() -> None:
    """The one overlap search (``plan.validate`` and ``submit`` both use it), across regions and
    past the 1 TiB that byte keys reach."""
    touching = DescriptorList.of([(0, 10, 5), (0, 0, 10), (0, 15, 1)])
    assert touching.facts.overlap is None
    other_region = DescriptorList.of([(0, 0, 10), (1, 5, 10)])
    assert other_region.facts.overlap is None
    clash = DescriptorList.of([(0, 30, 4), (1, 0, 8), (0, 0, 10), (0, 9, 2)])
    assert clash.facts.overlap == (2, 3)
    inside = DescriptorList.of([(0, 0, 100), (0, 40, 1)])
    assert inside.facts.overlap == (0, 1)
    assert DescriptorList.of([(0, 0, 1)]).facts.overlap is None
    far = 1 << 50
    assert DescriptorList.of([(2, far + 8, 8), (1, far, 16), (2, far, 9)]).facts.overlap == (0, 2)


def test_concat_descriptors() -> None:
    a = DescriptorList.of([(0, 0, 4)])
    b = DescriptorList.of([(1, 8, 2), (1, 20, 3)])
    both = concat_descriptors([a, b])
    assert both.regions.tolist() == [0, 1, 1]
    assert both.offsets.tolist() == [0, 8, 20]
    assert both.lengths.tolist() == [4, 2, 3]
    assert concat_descriptors([a]) is a
    assert len(concat_descriptors([])) == 0


def test_facts_are_computed_once_and_kept():
    d = DescriptorList.of([(1, 0, 8), (1, 16, 8)])
    assert d.facts is d.facts
    assert d.facts.rows is d.facts.rows
    assert not d.facts.region_ids.flags.writeable


def test_row_map_of_paged_blocks():
    m = row_map(np.array([48, 16, 32, 64], dtype=np.int64), 16)
    assert m is not None
    assert (m.base, m.length, m.rows, m.index.tolist(), m.identity) == (
        16,
        16,
        4,
        [2, 0, 1, 3],
        False,
    )
    assert m.inverse is not None and m.inverse.tolist() == [1, 2, 0, 3]
    b2b = row_map(np.array([8, 12, 16], dtype=np.int64), 4)
    assert b2b is not None and b2b.identity and b2b.inverse is None
    sparse = row_map(np.array([0, 32], dtype=np.int64), 16)
    assert sparse is not None and sparse.rows == 3 and sparse.inverse is None
    assert row_map(np.array([0, 24], dtype=np.int64), 16) is None  # off the rows
    one_region = DescriptorList.of([(1, 0, 4), (2, 4, 4)])
    assert one_region.facts.rows is None  # two regions: no single row view


def test_check_bounds_uses_extents_and_names_the_first_bad_descriptor():
    d = DescriptorList.of([(1, 0, 8), (2, 0, 4), (1, 8, 8), (1, 12, 8)])
    d.check_bounds({RegionId(1): 20, RegionId(2): 4}, "local")
    with pytest.raises(PlanError, match=r"local descriptor 3 .* runs past the region end 19"):
        d.check_bounds({RegionId(1): 19, RegionId(2): 4}, "local")
    with pytest.raises(PlanError, match=r"unknown region\(s\) \[2\]"):
        d.check_bounds({RegionId(1): 20}, "local")


def test_check_pairing_refuses_unequal_pairs():
    a = DescriptorList.of([(1, 0, 8), (1, 8, 8)])
    check_pairing(a, a)
    with pytest.raises(PlanError, match="pair 1"):
        check_pairing(a, DescriptorList.of([(1, 0, 8), (1, 8, 4)]))
    with pytest.raises(PlanError, match="2 source descriptors but 1"):
        check_pairing(a, DescriptorList.of([(1, 0, 8)]))


@pytest.mark.parametrize("use_torch", [True, False])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), order=st.sampled_from(["b2b", "perm", "sparse"]))
def test_row_copies_match_reference(seed, order, use_torch):
    """One-pass moves (a back-to-back source, or a destination that tiles its rows) give the
    reference bytes; rows this long scattered on both sides are refused untouched (per-run
    copies take them)."""
    rng = np.random.default_rng(seed)
    n, length = 24, 64 << 10  # rows long enough for the NumPy path
    s_idx = {"b2b": np.arange(n), "perm": rng.permutation(n),
             "sparse": rng.choice(2 * n, n, replace=False)}[order]  # fmt: skip
    d_idx = rng.permutation(2 * n)[:n] if seed % 2 else rng.permutation(n)
    src = torch.randint(0, 256, (2 * n * length,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))  # fmt: skip
    dst = torch.zeros(2 * n * length, dtype=torch.uint8)
    expected = dst.clone().view(-1, length)
    expected[torch.from_numpy(d_idx)] = src.view(-1, length)[torch.from_numpy(s_idx)]
    sm = row_map(s_idx.astype(np.int64) * length, length)
    dm = row_map(d_idx.astype(np.int64) * length, length)
    assert sm is not None and dm is not None
    one_pass = sm.identity or (dm.rows == n and (dm.identity or dm.inverse is not None))
    if use_torch:
        took = copy_rows_torch(src, sm, dst, dm)
    else:
        workers = CopyWorkers(2)
        try:
            took = copy_rows_numpy(src.numpy(), sm, dst.numpy(), dm, workers=workers)
        finally:
            workers.close()
    assert took == one_pass
    if took:
        assert torch.equal(dst.view(-1, length), expected)
    else:
        assert not bool(dst.any())


def test_short_rows_scattered_on_both_sides_take_two_passes():
    n, length = 16, 512
    s_idx, d_idx = np.arange(1, 2 * n, 2), np.arange(0, 2 * n, 2)[::-1].copy()
    src = torch.arange(2 * n * length, dtype=torch.int64).to(torch.uint8)
    dst = torch.zeros_like(src)
    sm, dm = row_map(s_idx * length, length), row_map(d_idx * length, length)
    assert sm is not None and dm is not None and not sm.identity and dm.inverse is None
    assert copy_rows_torch(src, sm, dst, dm)
    expected = torch.zeros_like(src).view(-1, length)
    expected[torch.from_numpy(d_idx)] = src.view(-1, length)[torch.from_numpy(s_idx)]
    assert torch.equal(dst.view(-1, length), expected)


def test_row_copies_refuse_shared_memory():
    buf = torch.arange(64, dtype=torch.uint8)
    m = row_map(np.array([0, 16], dtype=np.int64), 16)
    assert m is not None
    before = buf.clone()
    assert not copy_rows_torch(buf, m, buf, m)
    assert torch.equal(buf, before)


def test_a_descriptor_whose_end_would_wrap_int64_is_refused():
    """``offset + length`` past 2**62 is refused at construction: an end that wraps negative
    once passed ``check_bounds`` for a 1 MiB region (a hostile tcp DATA table)."""
    from kvplane.transports.descriptors import MAX_END

    for offset, length in (((1 << 63) - 16, 32), (MAX_END, 1), (MAX_END - 8, 16)):
        with pytest.raises(PlanError, match="ends past"):
            DescriptorList.of([(1, 0, 16), (1, offset, length)])
    assert len(DescriptorList.of([(1, MAX_END - 16, 16)])) == 1


def test_parts_are_unchecked_views_and_can_share_lengths() -> None:
    src = DescriptorList.of([(1, 0, 8), (1, 16, 8), (1, 64, 4), (2, 0, 4)])
    dst = DescriptorList(np.full(4, 3), np.array([0, 8, 16, 20]), src.lengths)
    s_parts = src.parts([0, 1, 1, 4])
    d_parts = dst.parts([0, 1, 1, 4], lengths_of=s_parts)
    assert [p.offsets.tolist() for p in s_parts] == [[0], [], [16, 64, 0]]
    assert [p.regions.tolist() for p in s_parts] == [[1], [], [1, 1, 2]]
    assert all(d.lengths is s.lengths for s, d in zip(s_parts, d_parts, strict=True))
    assert [p.total_bytes for p in d_parts] == [8, 0, 16]
    assert s_parts[2].offsets.base is not None  # a view of the checked list, not a copy
    assert not s_parts[2].offsets.flags.writeable
