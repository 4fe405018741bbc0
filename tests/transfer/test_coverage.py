"""Coverage moments against brute force over every byte."""

from __future__ import annotations

import itertools
from math import comb

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import PlanError
from kvplane.transfer import coverage
from kvplane.transfer.coverage import (
    MOD,
    MONOMIALS,
    SMALL_LIST,
    Coverage,
    coverage_of_descriptors,
    coverage_of_product,
)
from kvplane.transports.base import DescriptorList


def moments_of(byte_pairs: list[tuple[int, int]]) -> Coverage:
    """Moments by definition: ``Σ s^i d^j`` over every listed byte's ``(src, dst)`` offsets."""
    return Coverage(
        len(byte_pairs),
        tuple(sum(s**i * d**j for s, d in byte_pairs) % MOD for i, j in MONOMIALS),
    )


def brute(pairs: list[tuple[int, int, int]]) -> Coverage:
    """Moments by enumerating every byte of ``(src offset, dst offset, length)`` pairs."""
    return moments_of([(s + k, d + k) for s, d, n in pairs for k in range(n)])


def lists(pairs: list[tuple[int, int, int]]) -> tuple[DescriptorList, DescriptorList]:
    src = DescriptorList.of([(0, s, n) for s, _, n in pairs])
    dst = DescriptorList.of([(1, d, n) for _, d, n in pairs])
    return src, dst


offsets = st.integers(0, 1 << 10) | st.integers((1 << 40) - 64, (1 << 40) + 64)


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(offsets, offsets, st.integers(1, 40)), max_size=6))
def test_descriptor_moments_equal_brute_force(pairs) -> None:
    assert coverage_of_descriptors(*lists(pairs)) == brute(pairs)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, (1 << 33) + 1, (1 << 34) + 3, (1 << 40) - 1])
def test_closed_forms_stay_exact_for_huge_descriptors(n: int) -> None:
    s, d = (1 << 39) + 5, (1 << 41) + 11
    t = (n, n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6, (n * (n - 1) // 2) ** 2)  # Σ k^c
    want = Coverage(
        n,
        tuple(
            sum(  # Σ_k (s+k)^i (d+k)^j, binomially expanded by hand in exact integers
                comb(i, a) * comb(j, b) * s ** (i - a) * d ** (j - b) * t[a + b]
                for a in range(i + 1)
                for b in range(j + 1)
            )
            % MOD
            for i, j in MONOMIALS
        ),
    )
    assert coverage_of_descriptors(*lists([(s, d, n)])) == want


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(offsets, offsets, st.integers(1, 12) | st.integers((1 << 33) - 3, 1 << 40)),
        min_size=1,
        max_size=3 * SMALL_LIST,
    ),
    chunk=st.integers(1, 40),
)
def test_descriptor_moments_are_exact_across_reduction_chunks(pairs, chunk) -> None:
    """The lists are reduced DESC_CHUNK descriptors at a time in wrapping uint64; any chunking
    gives the exact moments (against exact integer arithmetic, huge lengths included)."""
    want = Coverage(
        sum(n for _, _, n in pairs),
        tuple(
            sum(  # Σ_k (s+k)^i (d+k)^j per descriptor, expanded in exact integers
                comb(i, a) * comb(j, b) * s ** (i - a) * d ** (j - b) * power_sum(n, a + b)
                for s, d, n in pairs
                for a in range(i + 1)
                for b in range(j + 1)
            )
            % MOD
            for i, j in MONOMIALS
        ),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(coverage, "DESC_CHUNK", chunk)
        assert coverage_of_descriptors(*lists(pairs)) == want
    small = [(s, d, n) for s, d, n in pairs if n <= 12]
    assert coverage_of_descriptors(*lists(small)) == brute(small)


def power_sum(n: int, c: int) -> int:
    return sum(k**c for k in range(n)) if n < 64 else [
        n, n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6, (n * (n - 1) // 2) ** 2
    ][c]  # fmt: skip


axis_values = st.integers(-(1 << 62), 1 << 62) | st.integers(0, 1 << 12)


@settings(max_examples=80, deadline=None)
@given(
    long_axis=st.integers(SMALL_LIST + 1, 3 * SMALL_LIST).flatmap(
        lambda n: st.tuples(
            st.lists(axis_values, min_size=n, max_size=n),
            st.lists(axis_values, min_size=n, max_size=n),
        )
    ),
    short=st.lists(st.integers(0, 1 << 40), min_size=1, max_size=3),
    row=st.integers(1, 5),
)
def test_long_axes_and_the_row_axis_equal_brute_force(long_axis, short, row) -> None:
    """An axis longer than SMALL_LIST is reduced in wrapping uint64 (negative and huge
    contributions included); the int row axis in closed form: both as by definition."""
    s_long, d_long = long_axis
    arrays = [
        (np.array(s_long, dtype=np.int64), np.array(d_long, dtype=np.int64)),
        (np.array(short, dtype=np.int64), np.array(short[::-1], dtype=np.int64)),
        row,
    ]
    bytes_ = [
        (s_long[i] + short[j] + k, d_long[i] + short[::-1][j] + k)
        for i in range(len(s_long))
        for j in range(len(short))
        for k in range(row)
    ]
    assert coverage_of_product(arrays) == moments_of(bytes_)
    row_arange = np.arange(row, dtype=np.int64)
    assert coverage_of_product([*arrays[:2], (row_arange, row_arange)]) == moments_of(bytes_)


def test_a_row_axis_of_zero_bytes_is_an_empty_product() -> None:
    one = np.ones(1, dtype=np.int64)
    assert coverage_of_product([(one, one), 0]) == Coverage.zero()
    assert coverage_of_product([]) == Coverage.zero()


def test_known_blind_spot_a_block_permutation_that_keeps_every_moment() -> None:
    """The moments are a checksum, not a proof: 0..3 → 1,3,0,2 and 0..3 → 2,0,3,1 have equal
    Σ kσ, Σ k²σ and Σ kσ² (so equal moments for equal-sized blocks). Documented in the
    module; if the moment scheme is strengthened this test should be turned around."""
    b = 64
    right = coverage_of_descriptors(*lists([(k * b, t * b, b) for k, t in enumerate([1, 3, 0, 2])]))
    wrong = coverage_of_descriptors(*lists([(k * b, t * b, b) for k, t in enumerate([2, 0, 3, 1])]))
    assert right == wrong


@settings(max_examples=100, deadline=None)
@given(
    axes=st.lists(
        st.integers(1, 3).flatmap(
            lambda n: st.tuples(
                st.lists(st.integers(0, 1 << 42), min_size=n, max_size=n),
                st.lists(st.integers(0, 1 << 42), min_size=n, max_size=n),
            )
        ),
        min_size=1,
        max_size=4,
    )
)
def test_product_moments_equal_brute_force(axes) -> None:
    arrays = [(np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)) for s, d in axes]
    bytes_ = [
        (sum(axes[a][0][i] for a, i in enumerate(combo)),
         sum(axes[a][1][i] for a, i in enumerate(combo)))
        for combo in itertools.product(*[range(len(s)) for s, _ in axes])
    ]  # fmt: skip
    assert coverage_of_product(arrays) == moments_of(bytes_)


def test_product_of_an_empty_axis_is_zero() -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert coverage_of_product([(empty, empty)]) == Coverage.zero()
    empty_lists = coverage_of_descriptors(DescriptorList.empty(), DescriptorList.empty())
    assert empty_lists == Coverage(0, (0,) * len(MONOMIALS))


def test_moments_tell_swapped_destinations_apart() -> None:
    right = coverage_of_descriptors(*lists([(0, 100, 10), (10, 200, 10)]))
    swapped = coverage_of_descriptors(*lists([(0, 200, 10), (10, 100, 10)]))
    assert right.num_bytes == swapped.num_bytes
    assert right.moments[:3] == swapped.moments[:3]  # Σs, Σd, Σs²: the same byte sets
    assert right.moments[3] != swapped.moments[3]  # Σs·d: the pairing differs


def test_third_degree_moments_catch_permutations_that_cancel_in_the_cross_sum() -> None:
    """Blocks 0..3 go to destination blocks 0,1,3,2; swapping the destinations of 0↔1 and of
    2↔3 (1,0,2,3) keeps Σs·d (0+1+6+6 == 0+0+4+9 in block units), not Σs·d²."""
    b = 64
    right = coverage_of_descriptors(*lists([(k * b, t * b, b) for k, t in enumerate([0, 1, 3, 2])]))
    wrong = coverage_of_descriptors(*lists([(k * b, t * b, b) for k, t in enumerate([1, 0, 2, 3])]))
    cross = MONOMIALS.index((1, 1))
    assert right.moments[: cross + 2] == wrong.moments[: cross + 2]
    assert right != wrong


def test_coverage_fields_are_checked() -> None:
    zeros = (0,) * len(MONOMIALS)
    with pytest.raises(PlanError, match="num_bytes"):
        Coverage(-1, zeros)
    with pytest.raises(PlanError, match=r"Σ s\^1 d\^2"):
        Coverage(0, (*zeros[:-1], MOD))
    with pytest.raises(PlanError, match=r"Σ s\^1 d\^0"):
        Coverage(0, (True, *zeros[1:]))
    with pytest.raises(PlanError, match="tuple of 7"):
        Coverage(0, zeros[:4])
    with pytest.raises(PlanError, match="tuple of 7"):
        Coverage(0, list(zeros))  # type: ignore[arg-type]
