"""Coverage moments of descriptor lists and of requests: the checksum of a plan's byte mapping.

:class:`Coverage` holds a mapping's byte count and its moments ``Σ s^i d^j`` (:data:`MONOMIALS`,
mod 2**64), in closed form from a plan's descriptors (:func:`coverage_of_descriptors`) and axis
by axis from a request (:func:`coverage_of_product`), so ``TransferPlan.validate`` compares the
two without re-running the planner. A checksum, not a proof: what it catches and what it cannot
is in docs/transports.md ("Coverage"). Pure numpy: no regions, no transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import comb
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvplane.errors import PlanError
from kvplane.transports.base import DescriptorList, Int64Array
from kvplane.validators import require_int

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
        require_int("Coverage.num_bytes", self.num_bytes, min=0, max=MOD - 1, error=PlanError)
        moments = self.moments
        if not isinstance(moments, tuple) or len(moments) != len(MONOMIALS):
            raise PlanError(
                f"Coverage.moments must be a tuple of {len(MONOMIALS)} ints, got {moments!r}"
            )
        for (i, j), value in zip(MONOMIALS, moments, strict=True):
            require_int(
                f"Coverage moment Σ s^{i} d^{j}", value, min=0, max=MOD - 1, error=PlanError
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


def _u64(values: Int64Array) -> U64Array:
    return values.astype(np.uint64)


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


def _power_sums(n: int) -> tuple[int, int, int, int]:
    """``Σ_{k<n} k^c`` for ``c = 0..3``, exact."""
    t1 = n * (n - 1) // 2
    return n, t1, (n - 1) * n * (2 * n - 1) // 6, t1 * t1


_Num = TypeVar("_Num", int, U64Array)


def _powers(x: _Num) -> tuple[_Num, _Num]:
    """``(x, x²)``: the powers a monomial of :data:`MONOMIALS` takes (``x^k`` at ``k - 1``)."""
    return x, x * x


def _monomial(ps: tuple[_Num, _Num], pd: tuple[_Num, _Num], i: int, j: int) -> _Num:
    """``s^i · d^j`` from :func:`_powers` of ``s`` and ``d`` (``i + j >= 1``; no factor is
    multiplied in for a zero exponent). Exact for ints, mod 2**64 for uint64 arrays."""
    if not j:
        return ps[i - 1]
    if not i:
        return pd[j - 1]
    return ps[i - 1] * pd[j - 1]


def _terms(i: int, j: int) -> list[tuple[int, int, int, int]]:
    """``Σ_k (s+k)^i (d+k)^j = Σ coef · s^x · d^y · Σ_k k^c`` as ``(coef, x, y, c)`` terms."""
    return [
        (comb(i, a) * comb(j, b), i - a, j - b, a + b) for a in range(i + 1) for b in range(j + 1)
    ]


_BASIS = sorted({(x, y, c) for m in _ALL for _, x, y, c in _terms(*m)})
"""The ``(x, y, c)`` whose sums ``Σ_desc s^x d^y Σ_{k<n} k^c`` the descriptor moments need."""
_DESC_TERMS = {m: [(coef, _BASIS.index((x, y, c))) for coef, x, y, c in _terms(*m)] for m in _ALL}
"""Each moment of :data:`_ALL` as ``(coef, index into _BASIS)`` terms."""
_PRODUCT_TERMS = {
    (i, j): [
        (comb(i, p) * comb(j, q), (p, q), (i - p, j - q))
        for p in range(i + 1)
        for q in range(j + 1)
    ]
    for i, j in _ALL
}
"""``M_{X×Y}[i, j] = Σ coef · M_X[p, q] · M_Y[i-p, j-q]`` as ``(coef, (p, q), (i-p, j-q))``."""

DESC_CHUNK = 8192
"""Descriptors reduced at once: one stacked reduction per chunk, whose products stay in cache
(a slice's plan is one chunk; a 128k-token plan a few dozen)."""
SMALL_LIST = 32
"""Up to this many indices, an axis of :func:`coverage_of_product` is summed as exact Python
ints; numpy's per-call cost would dominate the reductions of the array path."""


def coverage_of_descriptors(src: DescriptorList, dst: DescriptorList) -> Coverage:
    """Moments of the mapping ``src[i] → dst[i]`` (the lists must be paired, equal lengths).

    Per :data:`DESC_CHUNK` descriptors, every sum of :data:`_BASIS` is one row of a stacked
    ``uint64`` table reduced in one call; the moments are combinations of those sums."""
    if not len(src):
        return Coverage.zero()
    lengths, s_off, d_off = src.lengths, src.offsets, dst.offsets
    basis = np.zeros(len(_BASIS), dtype=np.uint64)
    table = np.empty((len(_BASIS), min(DESC_CHUNK, len(lengths))), dtype=np.uint64)
    for lo in range(0, len(lengths), DESC_CHUNK):
        n = _u64(lengths[lo : lo + DESC_CHUNK])
        t1 = _triangular(n)
        power_k = (n, t1, _square_pyramidal(n), t1 * t1)  # Σ_{k<n} k^c, c = 0..3
        ps, pd = (
            _powers(_u64(s_off[lo : lo + DESC_CHUNK])),
            _powers(_u64(d_off[lo : lo + DESC_CHUNK])),
        )
        rows = table[:, : len(n)]
        for r, (x, y, c) in enumerate(_BASIS):
            if x or y:
                np.multiply(_monomial(ps, pd, x, y), power_k[c], out=rows[r])
            else:
                rows[r] = power_k[c]
        basis += rows.sum(axis=1, dtype=np.uint64)
    sums = basis.tolist()
    moments = {m: sum(coef * sums[k] for coef, k in _DESC_TERMS[m]) for m in _ALL}
    moments[(0, 0)] = _exact_total(lengths)
    return Coverage.of(moments)


def _exact_total(lengths: Int64Array) -> int:
    """``Σ lengths`` without int64 wrap-around (exact Python ints when it could overflow)."""
    if int(lengths.max()) < (1 << 63) // len(lengths):
        return int(lengths.sum())
    return sum(lengths.tolist())


Moments = dict[tuple[int, int], int]


def _axis_moments(s_raw: Int64Array, d_raw: Int64Array) -> Moments:
    """``Σ_i s[i]^p d[i]^q`` mod 2**64 for every ``(p, q)`` of :data:`_ALL` (exact ints for a
    short axis, where numpy's per-call cost would dominate; else one stacked reduction)."""
    own: Moments = {(0, 0): len(s_raw)}
    if len(s_raw) <= SMALL_LIST:
        sums = dict.fromkeys(MONOMIALS, 0)
        for a, b in zip(s_raw.tolist(), d_raw.tolist(), strict=True):
            ps, pd = _powers(a), _powers(b)
            for m in MONOMIALS:
                sums[m] += _monomial(ps, pd, *m)
        own.update((m, v % MOD) for m, v in sums.items())
        return own
    ps, pd = _powers(_u64(s_raw)), _powers(_u64(d_raw))
    table = np.empty((len(MONOMIALS), len(s_raw)), dtype=np.uint64)
    for r, (i, j) in enumerate(MONOMIALS):
        table[r] = _monomial(ps, pd, i, j)
    own.update(zip(MONOMIALS, table.sum(axis=1, dtype=np.uint64).tolist(), strict=True))
    return own


_UNIT: Moments = {m: int(m == (0, 0)) for m in _ALL}
"""The moments of an axis of one index with no offset: the product's neutral element."""


def _range_moments(r: int) -> Moments:
    """The moments of the axis ``(k, k)`` for ``k < r``: ``Σ k^(p+q)``, closed-form."""
    power_k = _power_sums(r)
    return {(p, q): power_k[p + q] for p, q in _ALL}


def coverage_of_product(axes: Sequence[tuple[Int64Array, Int64Array] | int]) -> Coverage:
    """Moments of a request whose byte offsets are separable sums over logical axes.

    Each axis ``a`` is a pair of equal-length arrays ``(src_a, dst_a)``: the contribution of its
    index ``i`` to the source and destination offsets; or an int ``r``, the axis ``(k, k)`` for
    ``k < r`` (the bytes of a row, the same on both sides), whose moments are closed-form power
    sums. The byte set is the Cartesian product of the axes; a byte's offsets are
    ``Σ_a src_a[i_a]`` and ``Σ_a dst_a[i_a]``. The moments of the product of a set ``X`` with
    one more axis ``Y`` are ``Σ C(i,p) C(j,q) M_X[p, q] M_Y[i-p, j-q]`` (binomial expansion of
    ``(s_x+s_y)^i (d_x+d_y)^j``, :data:`_PRODUCT_TERMS`)."""
    if not axes or any((ax if isinstance(ax, int) else len(ax[0])) == 0 for ax in axes):
        return Coverage.zero()
    first, *rest = [_range_moments(ax) if isinstance(ax, int) else _axis_moments(*ax)
                    for ax in axes]  # fmt: skip
    acc = first
    for own in rest:
        if own == _UNIT:  # one index contributing 0 to both sides (one head, one component)
            continue
        prev = acc
        acc = {
            m: sum(coef * prev[a] * own[b] for coef, a, b in _PRODUCT_TERMS[m]) % MOD
            for m in MONOMIALS
        }
        acc[(0, 0)] = prev[(0, 0)] * own[(0, 0)]  # exact: the byte count is never reduced
    return Coverage.of(acc)
