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
3. the *moments* of the mapping agree with the analytic moments of the request: ``Σ s^i d^j``
   over every moved byte (``s``, ``d``: its offsets on each side) for every ``(i, j)`` of
   :data:`MONOMIALS` -- ``Σ s``, ``Σ d``, ``Σ s²``, ``Σ s·d``, ``Σ d²``, ``Σ s²·d``, ``Σ s·d²``.

With (1) and (2) the plan is a bijection between two byte sets of the right size; (3) pins those
sets and their pairing: a descriptor that is shifted, points at the wrong block, or destinations
that are permuted change some moment. The first-degree and ``Σ s·d`` moments alone miss
permutations whose changes cancel (swapping the destinations of blocks 0↔1 and 2↔3 under the
table ``0,1,3,2`` keeps ``Σ s·d``); the third-degree ones catch those. The moments of a
descriptor are closed-form (binomial expansions of ``Σ_k (s+k)^i (d+k)^j`` over ``k < n`` in the
power sums of ``k``), and the moments of a request, whose offsets are sums over its logical axes
(token, layer, component, head, byte-in-row), are built axis by axis by the same binomial
expansion, so both sides are a handful of vectorised numpy reductions. Moments are kept modulo
2**64 (numpy ``uint64`` wraps), which is a ring, so every product and sum agrees exactly on both
sides. This is a checksum, not a cryptographic proof: it catches every realistic planner or wire
bug, not an adversary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import comb

import numpy as np
import numpy.typing as npt

from kvplane.errors import PlanError
from kvplane.transports.base import DescriptorList, Int64Array

MOD = 1 << 64
U64Array = npt.NDArray[np.uint64]
MONOMIALS: tuple[tuple[int, int], ...] = ((1, 0), (0, 1), (2, 0), (1, 1), (0, 2), (2, 1), (1, 2))
"""The ``(i, j)`` of the moments ``Σ s^i d^j`` a :class:`Coverage` holds, in its order."""
_ALL = ((0, 0), *MONOMIALS)
"""The moments the axis-by-axis expansion needs: every ``(i, j)`` below a kept one."""


@dataclass(frozen=True, slots=True)
class Coverage:
    """Moments of a byte mapping: the byte count and, modulo 2**64, ``Σ s^i d^j`` over every
    moved byte's offsets within their regions, for each ``(i, j)`` of :data:`MONOMIALS`."""

    num_bytes: int
    moments: tuple[int, ...]

    def __post_init__(self) -> None:
        n = self.num_bytes
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < MOD:
            raise PlanError(f"Coverage.num_bytes must be an int in [0, 2**64), got {n!r}")
        moments = self.moments
        if not isinstance(moments, tuple) or len(moments) != len(MONOMIALS):
            raise PlanError(
                f"Coverage.moments must be a tuple of {len(MONOMIALS)} ints, got {moments!r}"
            )
        for (i, j), value in zip(MONOMIALS, moments, strict=True):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MOD:
                raise PlanError(
                    f"Coverage moment Σ s^{i} d^{j} must be an int in [0, 2**64), got {value!r}"
                )

    @classmethod
    def zero(cls) -> Coverage:
        return cls(0, (0,) * len(MONOMIALS))

    @classmethod
    def of(cls, sums: dict[tuple[int, int], int]) -> Coverage:
        """From every moment of :data:`_ALL`: ``(0, 0)`` is the exact byte count, the others are
        reduced mod 2**64."""
        return cls(sums[(0, 0)], tuple(sums[m] % MOD for m in MONOMIALS))

    def describe(self) -> str:
        """``bytes=…, Σs^1d^0=…`` (for error messages)."""
        parts = [f"bytes={self.num_bytes}"]
        parts += [f"Σs^{i}d^{j}={v}" for (i, j), v in zip(MONOMIALS, self.moments, strict=True)]
        return "(" + ", ".join(parts) + ")"


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


def _terms(i: int, j: int) -> list[tuple[int, int, int, int]]:
    """``Σ_k (s+k)^i (d+k)^j = Σ coef · s^x · d^y · Σ_k k^c`` as ``(coef, x, y, c)`` terms."""
    return [
        (comb(i, a) * comb(j, b), i - a, j - b, a + b) for a in range(i + 1) for b in range(j + 1)
    ]


_TERMS = {m: _terms(*m) for m in _ALL}


SMALL_LIST = 32
"""Up to this many descriptors, moments are summed as exact Python ints (a slice's plan: 16
descriptors); numpy's per-call cost would dominate the reductions of the array path."""


def coverage_of_descriptors(src: DescriptorList, dst: DescriptorList) -> Coverage:
    """Moments of the mapping ``src[i] → dst[i]`` (the lists must be paired, equal lengths)."""
    if not len(src):
        return Coverage.zero()
    if len(src) <= SMALL_LIST:
        return _small_coverage(src.lengths.tolist(), src.offsets.tolist(), dst.offsets.tolist())
    n = _u64(src.lengths)
    t1 = _triangular(n)
    power_k = (n, t1, _square_pyramidal(n), t1 * t1)  # Σ_{k<n} k^c, c = 0..3
    s1, d1 = _u64(src.offsets), _u64(dst.offsets)
    power_s = (None, s1, s1 * s1)
    power_d = (None, d1, d1 * d1)
    basis: dict[tuple[int, int, int], int] = {}
    sums: dict[tuple[int, int], int] = {}
    for m in _ALL:
        total = 0
        for coef, x, y, c in _TERMS[m]:
            key = (x, y, c)
            if key not in basis:
                prod = power_k[c]
                if x:
                    prod = prod * power_s[x]  # type: ignore[operator]
                if y:
                    prod = prod * power_d[y]  # type: ignore[operator]
                basis[key] = _sum(prod)
            total += coef * basis[key]
        sums[m] = total
    sums[(0, 0)] = _exact_total(src.lengths)
    return Coverage.of(sums)


def _exact_total(lengths: Int64Array) -> int:
    """``Σ lengths`` without int64 wrap-around (exact Python ints when it could overflow)."""
    if int(lengths.max()) < (1 << 63) // len(lengths):
        return int(lengths.sum())
    return sum(lengths.tolist())


def _small_coverage(lengths: list[int], src: list[int], dst: list[int]) -> Coverage:
    """:func:`coverage_of_descriptors` in exact integer arithmetic, reduced mod 2**64 at the end
    (the same ring, so the same moments as the array path)."""
    sums = dict.fromkeys(_ALL, 0)
    for n, a, b in zip(lengths, src, dst, strict=True):
        t1 = n * (n - 1) // 2
        power_k = (n, t1, (n - 1) * n * (2 * n - 1) // 6, t1 * t1)
        for m in _ALL:
            sums[m] += sum(coef * a**x * b**y * power_k[c] for coef, x, y, c in _TERMS[m])
    return Coverage.of(sums)


def _axis_moments(s_raw: Int64Array, d_raw: Int64Array) -> dict[tuple[int, int], int]:
    """``Σ_i s[i]^p d[i]^q`` mod 2**64 for every ``(p, q)`` of :data:`_ALL` (exact ints for a
    short axis, where numpy's per-call cost would dominate)."""
    if len(s_raw) <= SMALL_LIST:
        pairs = list(zip(s_raw.tolist(), d_raw.tolist(), strict=True))
        return {(i, j): sum(a**i * b**j for a, b in pairs) % MOD for i, j in _ALL}
    s, d = _u64(s_raw), _u64(d_raw)
    ps, pd = (None, s, s * s), (None, d, d * d)
    own = {(0, 0): len(s)}
    for i, j in MONOMIALS:
        if not j:
            prod = ps[i]
        elif not i:
            prod = pd[j]
        else:
            prod = ps[i] * pd[j]  # type: ignore[operator]
        own[(i, j)] = _sum(prod)  # type: ignore[arg-type]
    return own


def coverage_of_product(axes: Sequence[tuple[Int64Array, Int64Array]]) -> Coverage:
    """Moments of a request whose byte offsets are separable sums over logical axes.

    Each axis ``a`` is a pair of equal-length arrays ``(src_a, dst_a)``: the contribution of its
    index ``i`` to the source and destination offsets. The byte set is the Cartesian product of
    the axes; a byte's offsets are ``Σ_a src_a[i_a]`` and ``Σ_a dst_a[i_a]``. The moments of the
    product of a set ``X`` with one more axis ``Y`` are
    ``Σ C(i,p) C(j,q) M_X[p, q] M_Y[i-p, j-q]`` (binomial expansion of ``(s_x+s_y)^i (d_x+d_y)^j``).
    """
    if any(len(s) == 0 for s, _ in axes):
        return Coverage.zero()
    acc: dict[tuple[int, int], int] | None = None
    for s_raw, d_raw in axes:
        own = _axis_moments(s_raw, d_raw)
        if acc is None:
            acc = own
            continue
        count = acc[(0, 0)] * own[(0, 0)]  # exact: the byte count is never reduced
        acc = {
            (i, j): sum(
                comb(i, p) * comb(j, q) * acc[(p, q)] * own[(i - p, j - q)]
                for p in range(i + 1)
                for q in range(j + 1)
            )
            % MOD
            for i, j in _ALL
        }
        acc[(0, 0)] = count
    if acc is None:
        return Coverage.zero()
    return Coverage.of(acc)
