"""Byte-set arithmetic over descriptor lists: concatenation, overlap search and coverage moments.

Theory of operation
-------------------
A transfer plan is a mapping from source bytes to destination bytes, written as pairs of
descriptors ``src[i] → dst[i]`` (equal lengths). ``TransferPlan.validate`` must show that this
mapping is exactly the one that was requested, without re-running the planner. Three facts
together do that:

1. no two destination descriptors overlap and no two source descriptors overlap
   (:func:`first_overlap`: sort by ``(region, offset)`` and compare neighbours, vectorised);
2. the number of bytes moved equals the analytic number of logical bytes requested;
3. the *moments* of the mapping agree with the analytic moments of the request:
   ``Σ src``, ``Σ dst`` and ``Σ src·dst`` over every moved byte (its offset on each side).

With (1) and (2) the plan is a bijection between two byte sets of the right size; (3) pins those
sets and their pairing: a descriptor that is shifted, points at the wrong block, or two
destinations that are swapped change ``Σ dst`` or ``Σ src·dst``. The moments of a descriptor are
closed-form (``Σ_k (s+k)(d+k)`` over ``k < n``), and the moments of a request are separable over
its logical axes (token, layer, component, head, byte-in-row), so both sides are a handful of
vectorised numpy reductions. Moments are kept modulo 2**64 (numpy ``uint64`` wraps), which is a
ring, so every product and sum agrees exactly on both sides. This is a checksum, not a
cryptographic proof: it catches every realistic planner or wire bug, not an adversary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvplane.errors import PlanError
from kvplane.transports.base import DescriptorList, Int64Array

MOD = 1 << 64
U64Array = npt.NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class Coverage:
    """Moments of a byte mapping: the byte count and, modulo 2**64, ``Σ src``, ``Σ dst`` and
    ``Σ src·dst`` over every moved byte's offsets within their regions."""

    num_bytes: int
    src_sum: int
    dst_sum: int
    cross_sum: int

    def __post_init__(self) -> None:
        for name in ("num_bytes", "src_sum", "dst_sum", "cross_sum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MOD:
                raise PlanError(f"Coverage.{name} must be an int in [0, 2**64), got {value!r}")

    @classmethod
    def zero(cls) -> Coverage:
        return cls(0, 0, 0, 0)


def concat_descriptors(lists: Sequence[DescriptorList]) -> DescriptorList:
    """One descriptor list holding every element of ``lists`` in order."""
    if not lists:
        return DescriptorList.empty()
    if len(lists) == 1:
        return lists[0]
    return DescriptorList(
        np.concatenate([d.regions for d in lists]),
        np.concatenate([d.offsets for d in lists]),
        np.concatenate([d.lengths for d in lists]),
    )


def first_overlap(descs: DescriptorList) -> tuple[int, int] | None:
    """Indices of two descriptors that share a byte (the first found in address order), or None.

    Sorts by ``(region, offset)``; ranges ``[offset, offset + length)`` overlap iff a neighbour
    starts before the previous one ends. O(n log n), no Python loop.
    """
    if len(descs) < 2:
        return None
    order = np.lexsort((descs.offsets, descs.regions))
    regions = descs.regions[order]
    starts = descs.offsets[order]
    ends = starts + descs.lengths[order]
    clash = np.flatnonzero((regions[1:] == regions[:-1]) & (starts[1:] < ends[:-1]))
    if not len(clash):
        return None
    i = int(clash[0])
    return int(order[i]), int(order[i + 1])


def _u64(values: Int64Array) -> U64Array:
    return values.astype(np.uint64)


def _sum(values: U64Array) -> int:
    """Wrapping (mod 2**64) sum as a Python int."""
    return int(np.sum(values, dtype=np.uint64))


def _triangular(n: U64Array) -> U64Array:
    """``n(n-1)/2`` mod 2**64, exact: halve the even factor before multiplying."""
    even = n % np.uint64(2) == 0
    half_n = np.where(even, n // np.uint64(2), n)
    half_m = np.where(even, n - np.uint64(1), (n - np.uint64(1)) // np.uint64(2))
    return half_n * half_m


def _square_pyramidal(n: U64Array) -> U64Array:
    """``Σ_{k<n} k² = (n-1)·n·(2n-1)/6`` mod 2**64, exact: divide factors before multiplying."""
    one, two, three = np.uint64(1), np.uint64(2), np.uint64(3)
    a, b, c = n - one, n.copy(), two * n - one
    a_even = a % two == 0
    a = np.where(a_even, a // two, a)
    b = np.where(a_even, b, b // two)
    a3 = a % three == 0
    b3 = ~a3 & (b % three == 0)
    c3 = ~a3 & ~b3
    a = np.where(a3, a // three, a)
    b = np.where(b3, b // three, b)
    c = np.where(c3, c // three, c)
    return a * b * c


SMALL_LIST = 32
"""Up to this many descriptors, moments are summed as exact Python ints (a slice's plan: 16
descriptors); numpy's per-call cost would dominate the twenty reductions of the array path."""


def coverage_of_descriptors(src: DescriptorList, dst: DescriptorList) -> Coverage:
    """Moments of the mapping ``src[i] → dst[i]`` (the lists must be paired, equal lengths)."""
    if not len(src):
        return Coverage.zero()
    if len(src) <= SMALL_LIST:
        return _small_coverage(src.lengths.tolist(), src.offsets.tolist(), dst.offsets.tolist())
    n = _u64(src.lengths)
    s = _u64(src.offsets)
    d = _u64(dst.offsets)
    t1 = _triangular(n)
    t2 = _square_pyramidal(n)
    return Coverage(
        num_bytes=int(src.lengths.sum()),
        src_sum=_sum(n * s + t1),
        dst_sum=_sum(n * d + t1),
        cross_sum=_sum(n * s * d + (s + d) * t1 + t2),
    )


def _small_coverage(lengths: list[int], src: list[int], dst: list[int]) -> Coverage:
    """:func:`coverage_of_descriptors` in exact integer arithmetic, reduced mod 2**64 at the end
    (the same ring, so the same moments as the array path)."""
    total = src_sum = dst_sum = cross = 0
    for n, a, b in zip(lengths, src, dst, strict=True):
        t1 = n * (n - 1) // 2
        total += n
        src_sum += n * a + t1
        dst_sum += n * b + t1
        cross += n * a * b + (a + b) * t1 + (n - 1) * n * (2 * n - 1) // 6
    return Coverage(total, src_sum % MOD, dst_sum % MOD, cross % MOD)


def coverage_of_product(axes: Sequence[tuple[Int64Array, Int64Array]]) -> Coverage:
    """Moments of a request whose byte offsets are separable sums over logical axes.

    Each axis ``a`` is a pair of equal-length arrays ``(src_a, dst_a)``: the contribution of its
    index ``i`` to the source and destination offsets. The byte set is the Cartesian product of
    the axes; a byte's offsets are ``Σ_a src_a[i_a]`` and ``Σ_a dst_a[i_a]``.
    """
    counts = [len(s) for s, _ in axes]
    total = 1
    for c in counts:
        total *= c
    if total == 0:
        return Coverage.zero()
    # per-axis sums in three reductions over the axes laid end to end (wrapping uint64)
    s_all = _u64(np.concatenate([s for s, _ in axes]))
    d_all = _u64(np.concatenate([d for _, d in axes]))
    starts = np.cumsum([0, *counts[:-1]])
    sums_s = [int(v) for v in np.add.reduceat(s_all, starts)]
    sums_d = [int(v) for v in np.add.reduceat(d_all, starts)]
    paired = [int(v) for v in np.add.reduceat(s_all * d_all, starts)]
    src_sum = sum(sums_s[a] * (total // counts[a]) for a in range(len(axes)))
    dst_sum = sum(sums_d[a] * (total // counts[a]) for a in range(len(axes)))
    cross = 0
    for a in range(len(axes)):
        cross += paired[a] * (total // counts[a])
        for b in range(len(axes)):
            if a != b:
                cross += sums_s[a] * sums_d[b] * (total // (counts[a] * counts[b]))
    return Coverage(total, src_sum % MOD, dst_sum % MOD, cross % MOD)
