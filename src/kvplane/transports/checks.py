"""The one check of a batch of descriptor pairs, and the proof it leaves on the lists it passed.

:func:`check_batch` is the only implementation of the pairing, bounds and overlap rules (plan
validation and a raw ``Transport.submit`` both call it). What it proves of the lists themselves
depends only on their contents, so the proof (:class:`CheckedBatch`) is kept with the source
list and found again by :func:`vouched`: a transport handed vouched lists checks only that their
regions are still there, O(regions). :func:`check_tiles` proves once that a template may be
copied to any distinct units of a lattice per side; :meth:`Tiles.batch` builds such copies
vouched. No region contents, pins or peers here. See docs/transports.md ("Batch checks").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.errors import PlanError
from kvplane.ids import RegionId
from kvplane.transports.descriptors import (
    MAX_END,
    DescriptorList,
    Int64Array,
    check_pairing,
    concat_descriptors,
)


@dataclass(frozen=True, slots=True)
class CheckedBatch:
    """``src[i] → dst[i]`` as :func:`check_batch` proved it: paired, destination bytes pairwise
    disjoint, and source bytes pairwise disjoint when ``sources_disjoint``. ``num_bytes``: bytes
    moved. Built only by this module (:func:`check_batch`, :meth:`part`, :func:`join_batches`,
    :func:`vouched`); holding one is the proof, so nothing re-checks it. Equal when they name
    the same two lists (by identity) with the same facts."""

    src: DescriptorList
    dst: DescriptorList
    num_bytes: int
    sources_disjoint: bool

    def check_regions(
        self,
        src_lengths: Mapping[RegionId, int],
        dst_lengths: Mapping[RegionId, int],
        *,
        tables: tuple[str, str] = ("source", "destination"),
    ) -> None:
        """``PlanError`` unless every region the batch names is in its table (region id →
        length; ids are never reused, so a deregistered one is missing) and long enough.
        O(regions): the lists' per-region extents are cached."""
        _check_bounds(self.src, self.dst, src_lengths, dst_lengths, tables)

    def part(self, src: DescriptorList, dst: DescriptorList) -> CheckedBatch:
        """The proof of a sub-batch -- ``src``/``dst`` are pairs of this batch, in any order
        (the caller's contract: e.g. one op of a validated plan) -- vouched for its lists."""
        return _vouch(CheckedBatch(src, dst, src.total_bytes, self.sources_disjoint))


@dataclass(frozen=True, slots=True, eq=False)
class _Stamp:
    """What a source list keeps of its latest proof: the destination list it pairs with and the
    facts (not the source itself: a list holding itself would be a reference cycle that only
    the cyclic collector frees, and plans' lists are large)."""

    dst: DescriptorList
    num_bytes: int
    sources_disjoint: bool


def vouched(src: DescriptorList, dst: DescriptorList) -> CheckedBatch | None:
    """The proof :func:`check_batch` left on exactly this pair of lists, or None. O(1)."""
    found = src.facts.proof
    if isinstance(found, _Stamp) and found.dst is dst:
        return CheckedBatch(src, dst, found.num_bytes, found.sources_disjoint)
    return None


def _vouch(checked: CheckedBatch) -> CheckedBatch:
    stamp = _Stamp(checked.dst, checked.num_bytes, checked.sources_disjoint)
    checked.src.facts.proof = stamp  # one slot: the latest pair checked with this source
    return checked


def _check_bounds(
    src: DescriptorList,
    dst: DescriptorList,
    src_lengths: Mapping[RegionId, int],
    dst_lengths: Mapping[RegionId, int],
    tables: tuple[str, str],
) -> None:
    src.check_bounds(src_lengths, tables[0])
    dst.check_bounds(dst_lengths, tables[1])


def _refuse_overlap(descs: DescriptorList, side: str) -> None:
    found = descs.facts.overlap  # the one overlap search (cached with the list)
    if found is not None:
        i, j = found
        raise PlanError(
            f"{side} descriptors {i} and {j} overlap: region {int(descs.regions[i])} "
            f"[{int(descs.offsets[i])}, +{int(descs.lengths[i])}) and "
            f"[{int(descs.offsets[j])}, +{int(descs.lengths[j])}) (a byte would be "
            f"{'written' if side == 'destination' else 'read'} twice)"
        )


def check_batch(
    src: DescriptorList,
    dst: DescriptorList,
    src_lengths: Mapping[RegionId, int],
    dst_lengths: Mapping[RegionId, int],
    *,
    tables: tuple[str, str] = ("source", "destination"),
    sources_disjoint: bool = False,
) -> CheckedBatch:
    """Raise ``PlanError`` unless ``src[i] → dst[i]`` is a safe batch against the region tables
    ``src_lengths``/``dst_lengths`` (region id → length; ``tables`` names them in errors):
    paired with equal lengths, every descriptor inside a known region, no destination byte
    written twice and, with ``sources_disjoint``, no source byte read twice. Checked in that
    order. Returns the proof and vouches it for the pair (see the module docstring); a pair
    already vouched pays only for the bounds. Mutates nothing but the lists' cached facts."""
    found = vouched(src, dst)
    if found is None:
        check_pairing(src, dst)
    _check_bounds(src, dst, src_lengths, dst_lengths, tables)
    if found is not None and (found.sources_disjoint or not sources_disjoint):
        return found
    if found is None:
        _refuse_overlap(dst, "destination")
    if sources_disjoint:
        _refuse_overlap(src, "source")
    return _vouch(CheckedBatch(src, dst, src.total_bytes, sources_disjoint))


def refuse_shared(
    pairs: Sequence[tuple[DescriptorList, DescriptorList]], what: str, *, sources: bool = True
) -> tuple[DescriptorList, DescriptorList]:
    """Every ``(src, dst)`` of ``pairs`` concatenated in order; ``PlanError`` naming ``what`` if
    two destination runs of them share a byte (and, with ``sources``, two source runs)."""
    src = concat_descriptors([s for s, _ in pairs])
    dst = concat_descriptors([d for _, d in pairs])
    for side, descs in (("destination", dst), ("source", src))[: 2 if sources else 1]:
        found = descs.facts.overlap  # the one overlap search
        if found is not None:
            i = found[0]
            raise PlanError(
                f"{what} share {side} bytes: region {int(descs.regions[i])} "
                f"[{int(descs.offsets[i])}, +{int(descs.lengths[i])})"
            )
    return src, dst


def join_batches(batches: Sequence[CheckedBatch], what: str) -> CheckedBatch:
    """The proof of ``batches`` run together (their lists concatenated in order): each is
    proved already, so only bytes shared *between* them remain to refuse (``PlanError`` naming
    ``what``): destinations always, sources when every batch proved its own disjoint."""
    if len(batches) == 1:
        return batches[0]
    sources = all(b.sources_disjoint for b in batches)
    src, dst = refuse_shared([(b.src, b.dst) for b in batches], what, sources=sources)
    return _vouch(CheckedBatch(src, dst, src.total_bytes, sources))


@dataclass(frozen=True, slots=True)
class Lattice:
    """One level of where copies of a template's runs lie on one side: copy ``k`` (``0 <= k <
    count``) of what the levels below it cover is ``k * step`` bytes further on."""

    step: int
    count: int


@dataclass(frozen=True, slots=True, eq=False)
class _Side:
    """One side of :class:`Tiles`: the template's region and offsets, the shift of every copy
    the inner levels make of it (innermost fastest) and the outer level, whose units a batch
    names."""

    region: int
    offsets: Int64Array
    end: int
    """Where the template's highest run ends."""
    inner: Int64Array
    outer: Lattice

    def shifts(self, units: Int64Array, what: str) -> Int64Array:
        """How far each copy of the template lies for ``units`` (each covering every copy of
        the inner levels, innermost fastest); ``PlanError`` unless distinct and in range."""
        units = np.asarray(units, dtype=np.int64)
        if units.ndim != 1:
            raise PlanError(f"{what} must be one-dimensional, got shape {units.shape}")
        _check_units(units, self.outer.count, what)
        if len(self.inner) == 1:  # no inner level (its one shift is 0)
            return units * self.outer.step
        return (units[:, None] * self.outer.step + self.inner[None, :]).ravel()


SMALL_UNITS = 64
"""Up to this many units are checked as a Python list (a few C-level passes, ~1 us) rather
than by NumPy calls (~1 us each, and a sort takes several)."""


def _check_units(units: Int64Array, count: int, what: str) -> None:
    """``PlanError`` unless every unit lies in ``0..count-1`` and none repeats."""
    n = len(units)
    if n <= SMALL_UNITS:
        seen = units.tolist()
        low, high = (min(seen), max(seen)) if n else (0, 0)
        repeated = len(set(seen)) != n
    else:
        low, high = int(units.min()), int(units.max())
        ordered = np.sort(units)
        repeated = bool((ordered[1:] == ordered[:-1]).any())
    if low < 0 or high >= count:
        raise PlanError(f"{what} must lie in 0..{count - 1}, got {low}..{high}")
    if repeated:
        ordered = np.sort(units)
        raise PlanError(f"{what} repeat {int(ordered[1:][ordered[1:] == ordered[:-1]][0])}")


@dataclass(frozen=True, slots=True, eq=False)
class Tiles:
    """A template batch and, per side, the :class:`Lattice` levels placing its copies, proved
    by :func:`check_tiles`: copies at distinct outer units are pairwise disjoint and inside
    their regions. Immutable, so shareable across threads."""

    src: _Side
    dst: _Side
    lengths: Int64Array

    def batch(
        self,
        src_units: Int64Array,
        dst_units: Int64Array,
        what: tuple[str, str] = ("source units", "destination units"),
    ) -> CheckedBatch:
        """The template copied to ``src_units``/``dst_units`` (copy ``i`` of the source pairs
        with copy ``i`` of the destination), vouched with sources disjoint: O(runs)
        arithmetic, no byte check. A one-run template's copies that continue each other on
        both sides are merged, when that at least halves the runs (as ``coalesce`` does).
        ``PlanError`` (naming ``what``) for a repeated or out-of-range unit, or sides of
        different copy counts."""
        src, dst = self.src.shifts(src_units, what[0]), self.dst.shifts(dst_units, what[1])
        n, runs = len(src), len(self.lengths)
        if n != len(dst):
            raise PlanError(f"{n} source copies against {len(dst)} destination copies")
        far = (int(src.max()), int(dst.max())) if n else (0, 0)  # the last copies' shifts
        if runs == 1:
            length = int(self.lengths[0])
            lengths = np.full(n, length, dtype=np.int64)
            if n > 1:
                cont = (src[1:] - src[:-1] == length) & (dst[1:] - dst[:-1] == length)
                merged = int(np.count_nonzero(cont))
                if merged and n >= 2 * (n - merged):
                    first = np.ones(n + 1, dtype=np.bool_)  # copy i starts a run; n: the end
                    np.logical_not(cont, out=first[1:n])
                    bounds = np.flatnonzero(first)
                    lengths = (bounds[1:] - bounds[:-1]) * length
                    src, dst = src[bounds[:-1]], dst[bounds[:-1]]
            src_off, dst_off = src + self.src.offsets[0], dst + self.dst.offsets[0]
        else:
            src_off = (src[:, None] + self.src.offsets[None, :]).ravel()
            dst_off = (dst[:, None] + self.dst.offsets[None, :]).ravel()
            lengths = np.broadcast_to(self.lengths, (n, runs)).reshape(-1)
        lists = (
            DescriptorList.proved(self.src.region, src_off, lengths, self.src.end + far[0]),
            DescriptorList.proved(self.dst.region, dst_off, lengths, self.dst.end + far[1]),
        )
        return _vouch(CheckedBatch(*lists, n * int(self.lengths.sum()), True))


def _tile_side(
    descs: DescriptorList, levels: Sequence[Lattice], lengths: Mapping[RegionId, int], side: str
) -> _Side:
    """``descs`` (one region, runs disjoint) copied by ``levels``: every run inside one
    ``step``-byte cell counted from the lowest run, occupied cells at least ``count`` apart
    (so copies ``k * step`` apart never meet), and the last copy inside the region."""
    if not levels or not descs.facts.single_region:
        raise PlanError(f"a {side} template needs one region and at least one lattice level")
    region = int(descs.regions[0])
    limit = min(lengths.get(RegionId(region), 0), MAX_END)
    off, end = descs.offsets, descs.offsets + descs.lengths
    inner = np.zeros(1, dtype=np.int64)
    for i, level in enumerate(levels):
        step, count = level.step, level.count
        if step < 1 or count < 1:
            raise PlanError(f"{side} lattice {level} needs step and count >= 1")
        if int(end.max()) + (count - 1) * step > limit:
            raise PlanError(f"{side} copies by {level} leave region {region} ({limit} bytes)")
        if count > 1:
            low = int(off.min())
            cells = (off - low) // step
            if bool(np.any(cells != (end - 1 - low) // step)):
                raise PlanError(f"a {side} template run crosses a {step}-byte cell")
            used = np.unique(cells)
            if len(used) > 1 and int(np.diff(used).min()) < count:
                raise PlanError(f"{side} template cells lie closer than {count} cells apart")
        if i < len(levels) - 1:  # what this level covers is the next level's template
            k = np.arange(count, dtype=np.int64)[:, None] * step
            off, end = (k + off[None, :]).ravel(), (k + end[None, :]).ravel()
            inner = (k + inner[None, :]).ravel()
    return _Side(region, descs.offsets, int(descs.facts.region_ends[0]), inner, levels[-1])


def check_tiles(
    template: CheckedBatch,
    src_levels: Sequence[Lattice],
    dst_levels: Sequence[Lattice],
    src_lengths: Mapping[RegionId, int],
    dst_lengths: Mapping[RegionId, int],
) -> Tiles:
    """Prove that ``template`` (checked with sources disjoint, one region per side) may be
    copied, on each side, to any distinct units of the outer level of its ``*_levels``
    (innermost first) -- copies pairwise disjoint, each inside its region of
    ``*_lengths`` -- or raise ``PlanError``. O(template runs x inner copies), once."""
    if not template.sources_disjoint or not len(template.src):
        raise PlanError("a tiled template needs runs and sources proved disjoint")
    return Tiles(
        _tile_side(template.src, src_levels, src_lengths, "source"),
        _tile_side(template.dst, dst_levels, dst_lengths, "destination"),
        template.src.lengths,
    )
