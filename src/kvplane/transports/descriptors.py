"""Descriptor lists — columnar ``(region, offset, length)`` byte ranges — and their cached facts.

A :class:`DescriptorList` is three read-only int64 arrays; its structural facts
(:class:`DescriptorFacts`: regions and extents, one run length, row maps, overlap, continuations)
are computed once, on first use, and kept with the list, so a list submitted many times is
analysed once. It knows no live region table (``checks`` compares against one). See
docs/transports.md ("Descriptor lists").
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.ma  # numpy 2's ``unique`` imports it on its first call: 7-15 ms inside a slice
import numpy.typing as npt

from kvplane.errors import PlanError
from kvplane.ids import RegionId
from kvplane.layout import MAX_POOL_BYTES

Int64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
OFFSET_BITS = 40
"""Offsets below 1 TiB; :meth:`DescriptorFacts.byte_keys` keys each byte as
``region << OFFSET_BITS | offset`` (for checks across two lists)."""


def _frozen_int64(values: npt.ArrayLike, what: str) -> Int64Array:
    arr = np.ascontiguousarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise PlanError(f"{what} must be one-dimensional, got shape {arr.shape}")
    arr.setflags(write=False)
    return arr


def _frozen(arr: Int64Array) -> Int64Array:
    arr.setflags(write=False)
    return arr


MAX_END = MAX_POOL_BYTES
"""No descriptor ends past this byte (far beyond any region): ``offset + length`` never wraps
int64, so a hostile table cannot pass a bounds check by overflowing it."""


@dataclass(frozen=True, slots=True)
class RowMap:
    """Runs of one ``length`` that all sit a multiple of ``length`` bytes from ``base``: the
    region seen as ``[rows, length]`` bytes from ``base``, and ``index[i]``, the row of run i.
    ``identity``: run i is row i (the runs are back to back). ``inverse`` (when the runs tile
    their rows, each row exactly once, not in order): ``inverse[r]`` is the run on row r. The
    arrays are shared by every user of the map (torch wraps them without a copy): never
    mutate them."""

    base: int
    length: int
    rows: int
    index: Int64Array
    identity: bool
    inverse: Int64Array | None


def row_map(offsets: Int64Array, length: int) -> RowMap | None:
    """``offsets`` (of runs of ``length`` bytes in one buffer) as a :class:`RowMap`, or None
    unless every run sits a multiple of ``length`` from the lowest one."""
    if not len(offsets):
        return None
    base = int(offsets.min())
    rel = offsets - base
    if np.any(rel % length):
        return None
    index = rel // length
    rows, n = int(index.max()) + 1, len(index)
    identity = rows == n and bool(np.all(index == np.arange(n)))
    inverse = None
    if rows == n and not identity and int(np.bincount(index, minlength=rows).max()) == 1:
        inverse = np.empty(n, dtype=np.int64)
        inverse[index] = np.arange(n)
    return RowMap(base, length, rows, index, identity, inverse)


class DescriptorFacts:
    """Structural facts of one descriptor list, each computed on first use and then kept."""

    def __init__(self, regions: Int64Array, offsets: Int64Array, lengths: Int64Array) -> None:
        self._regions, self._offsets, self._lengths = regions, offsets, lengths
        self.proof: object = None
        """The latest pair proof naming this list as its source, kept and read only by
        :mod:`kvplane.transports.checks` (opaque here)."""

    @cached_property
    def single_region(self) -> bool:
        r = self._regions
        return bool(len(r)) and int(r.min()) == int(r.max())

    @cached_property
    def region_ids(self) -> Int64Array:
        """The distinct region ids, ascending."""
        if self.single_region:
            return _frozen(self._regions[:1].copy())
        return _frozen(np.unique(self._regions))

    @cached_property
    def region_ends(self) -> Int64Array:
        """The highest end (offset + length) of any run, per entry of :attr:`region_ids`."""
        ends = self._offsets + self._lengths
        if len(self.region_ids) <= 1:
            return _frozen(ends.max(keepdims=True) if len(ends) else ends)
        out = np.zeros(len(self.region_ids), dtype=np.int64)
        np.maximum.at(out, np.searchsorted(self.region_ids, self._regions), ends)
        return _frozen(out)

    @cached_property
    def one_length(self) -> int | None:
        """The length every run shares, or None (mixed lengths, or no runs)."""
        ln = self._lengths
        if not len(ln) or int(ln.min()) != int(ln.max()):
            return None
        return int(ln[0])

    @cached_property
    def rows(self) -> RowMap | None:
        """The runs as rows of their one region (see :func:`row_map`), or None."""
        length = self.one_length
        if length is None or not self.single_region:
            return None
        return row_map(self._offsets, length)

    @cached_property
    def continues(self) -> BoolArray:
        """``continues[i]``: run ``i + 1`` starts, in the same region, where run ``i`` ends."""
        r, o, ln = self._regions, self._offsets, self._lengths
        out: BoolArray = (r[1:] == r[:-1]) & (o[1:] == o[:-1] + ln[:-1])
        out.setflags(write=False)
        return out

    def byte_keys(self) -> tuple[Int64Array, Int64Array]:
        """``(start, end)`` of every run as one integer per byte address across regions."""
        if len(self._offsets) and int(self.region_ends.max()) >= 1 << OFFSET_BITS:
            raise PlanError(f"descriptor offsets beyond {1 << OFFSET_BITS} bytes are not supported")
        base = self._regions << OFFSET_BITS
        return base + self._offsets, base + self._offsets + self._lengths

    @cached_property
    def overlap(self) -> tuple[int, int] | None:
        """Two runs that share a byte (lower index first), or None if all are disjoint: the
        first such neighbours in ``(region, offset)`` order. The one overlap search of kvplane.

        Paged blocks (one length, each row at most once) are disjoint by counting, no sort;
        otherwise one sort by ``(region, offset)`` and a neighbour compare: O(n log n), no
        Python loop, any offset below :data:`MAX_END`."""
        n = len(self._offsets)
        if n < 2:
            return None
        rows = self.rows
        if rows is not None and int(np.bincount(rows.index).max()) <= 1:
            return None
        if self.single_region:
            order = np.argsort(self._offsets, kind="stable")
        else:
            order = np.lexsort((self._offsets, self._regions))
        starts = self._offsets[order]
        bad = starts[:-1] + self._lengths[order][:-1] > starts[1:]
        if not self.single_region:
            regions = self._regions[order]
            bad &= regions[:-1] == regions[1:]
        found = np.flatnonzero(bad)
        if not len(found):
            return None
        i, j = sorted((int(order[found[0]]), int(order[found[0] + 1])))
        return i, j


@dataclass(frozen=True, slots=True, eq=False)
class DescriptorList:
    """Columnar list of ``(region, offset, length)`` byte ranges; arrays are read-only int64."""

    regions: Int64Array
    offsets: Int64Array
    lengths: Int64Array
    _facts: DescriptorFacts | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        regions = _frozen_int64(self.regions, "regions")
        offsets = _frozen_int64(self.offsets, "offsets")
        lengths = _frozen_int64(self.lengths, "lengths")
        if not len(regions) == len(offsets) == len(lengths):
            raise PlanError(
                f"descriptor columns differ in length: {len(regions)}, {len(offsets)}, "
                f"{len(lengths)}"
            )
        if len(offsets) and (int(offsets.min()) < 0 or int(lengths.min()) <= 0):
            raise PlanError("descriptor offsets must be >= 0 and lengths > 0")
        if len(offsets) and bool(np.any(offsets > MAX_END - lengths)):  # no int64 wrap later
            raise PlanError(f"a descriptor ends past {MAX_END} bytes")
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "lengths", lengths)

    @classmethod
    def of(cls, triples: Sequence[tuple[int, int, int]]) -> DescriptorList:
        """Build from ``(region, offset, length)`` tuples (convenience for tests and tools)."""
        if not triples:
            return cls.empty()
        cols = np.asarray(triples, dtype=np.int64).reshape(-1, 3)
        return cls(cols[:, 0], cols[:, 1], cols[:, 2])

    @classmethod
    def empty(cls) -> DescriptorList:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z)

    def __len__(self) -> int:
        return len(self.offsets)

    def parts(
        self, bounds: Sequence[int], *, lengths_of: Sequence[DescriptorList] = ()
    ) -> list[DescriptorList]:
        """The sub-lists ``[bounds[k], bounds[k + 1])`` (``bounds`` non-decreasing, within
        ``[0, len]``): read-only views of this list, which was checked when it was built, so
        they are not checked again (one check for a plan's ops instead of one per op).
        ``lengths_of``: parts of a list with these very lengths whose length arrays to share
        (so pairing them is an identity test)."""
        out = []
        for k, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            part = object.__new__(DescriptorList)
            object.__setattr__(part, "regions", self.regions[lo:hi])
            object.__setattr__(part, "offsets", self.offsets[lo:hi])
            shared = lengths_of[k].lengths if lengths_of else self.lengths[lo:hi]
            object.__setattr__(part, "lengths", shared)
            object.__setattr__(part, "_facts", None)
            out.append(part)
        return out

    @classmethod
    def proved(
        cls, region: int, offsets: Int64Array, lengths: Int64Array, end: int
    ) -> DescriptorList:
        """Runs ``offsets``/``lengths`` (int64, equally long) in region ``region``, the highest
        ending at ``end``, whose invariants (offsets >= 0, lengths > 0, ends within
        :data:`MAX_END`) a proof already guarantees: frozen, not checked again, the region
        facts known. For :mod:`~kvplane.transports.checks`, which copies a checked template."""
        out = object.__new__(cls)
        regions = np.full(len(offsets), region, dtype=np.int64)
        for name, arr in (("regions", regions), ("offsets", offsets), ("lengths", lengths)):
            arr.setflags(write=False)
            object.__setattr__(out, name, arr)
        facts = DescriptorFacts(regions, offsets, lengths)
        if len(offsets):
            known = facts.__dict__  # what the cached properties would compute
            known["single_region"] = True
            known["region_ids"] = _frozen(np.array([region], dtype=np.int64))
            known["region_ends"] = _frozen(np.array([end], dtype=np.int64))
        object.__setattr__(out, "_facts", facts)
        return out

    @property
    def facts(self) -> DescriptorFacts:
        """This list's structural facts (computed lazily, kept; safe to share across threads:
        two threads racing on a fact both compute the same value)."""
        found = self._facts
        if found is None:
            found = DescriptorFacts(self.regions, self.offsets, self.lengths)
            object.__setattr__(self, "_facts", found)
        return found

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum())

    def equals(self, other: DescriptorList) -> bool:
        return (
            np.array_equal(self.regions, other.regions)
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.lengths, other.lengths)
        )

    def check_bounds(self, region_lengths: Mapping[RegionId, int], side: str) -> None:
        """Raise ``PlanError`` if a descriptor names an unknown region or runs past its end.
        O(distinct regions) once the list's extents are known."""
        if not len(self):
            return
        ids, ends = self.facts.region_ids, self.facts.region_ends
        if len(ids) == 1:  # the common case, in scalars (errors are named below)
            limit = region_lengths.get(RegionId(int(ids[0])))
            if limit is not None and int(ends[0]) <= min(limit, MAX_END):
                return
        unknown = [int(r) for r in ids if RegionId(int(r)) not in region_lengths]
        if unknown:
            raise PlanError(f"{side} descriptors name unknown region(s) {unknown}")
        limits = np.array(  # a longer region cannot hold a descriptor past MAX_END anyway
            [min(region_lengths[RegionId(int(r))], MAX_END) for r in ids], dtype=np.int64
        )
        if bool(np.all(ends <= limits)):
            return
        per_desc = limits[np.searchsorted(ids, self.regions)]
        i = int(np.flatnonzero(self.offsets + self.lengths > per_desc)[0])
        raise PlanError(
            f"{side} descriptor {i} (region {int(self.regions[i])}, offset "
            f"{int(self.offsets[i])}, length {int(self.lengths[i])}) runs past the region "
            f"end {int(per_desc[i])}"
        )


def concat_descriptors(lists: Sequence[DescriptorList]) -> DescriptorList:
    """One descriptor list holding every element of ``lists`` in order (a lone list is handed
    back unchanged, so its cached facts and proofs stay with it)."""
    if not lists:
        return DescriptorList.empty()
    if len(lists) == 1:
        return lists[0]
    return DescriptorList(
        np.concatenate([d.regions for d in lists]),
        np.concatenate([d.offsets for d in lists]),
        np.concatenate([d.lengths for d in lists]),
    )


def check_pairing(src: DescriptorList, dst: DescriptorList) -> None:
    """Raise ``PlanError`` unless ``src[i]`` and ``dst[i]`` exist pairwise with equal lengths."""
    if len(src) != len(dst):
        raise PlanError(f"{len(src)} source descriptors but {len(dst)} destination descriptors")
    if src.lengths is dst.lengths:
        return
    bad = np.nonzero(src.lengths != dst.lengths)[0]
    if len(bad):
        i = int(bad[0])
        raise PlanError(
            f"descriptor pair {i}: source length {int(src.lengths[i])} != destination length "
            f"{int(dst.lengths[i])}"
        )
