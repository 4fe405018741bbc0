"""The one check of a batch of descriptor pairs, and the proof it leaves on the lists it passed.

:func:`check_batch` is the only implementation of the pairing, bounds and overlap rules: a
transfer plan's validation and a raw ``Transport.submit`` both call it. What it proves of the
lists themselves -- ``src[i]`` pairs with ``dst[i]`` (equal counts and lengths), no destination
byte is written twice and, when asked, no source byte is read twice -- depends on nothing but
their contents, which never change, so the proof (:class:`CheckedBatch`) is kept with the
source list and found again by :func:`vouched`. A transport handed vouched lists (a validated
plan's ops, or lists it checked before) checks only that their regions are still registered and
long enough: O(regions), never O(descriptors). Bounds are never vouched: regions come and go.
This module does not look at region contents, pins or peers (the transport core owns those).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvplane.errors import PlanError
from kvplane.ids import RegionId
from kvplane.transports.descriptors import DescriptorList, check_pairing, concat_descriptors


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
