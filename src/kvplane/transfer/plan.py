"""The transfer plan: frozen, inspectable data that any transport executes, and its validated form.

A :class:`TransferPlan` is a tuple of :class:`~kvplane.transfer.op.TransferOp` s plus the
:class:`~kvplane.transfer.coverage.Coverage` of its request; :meth:`TransferPlan.validate` checks
it once, from the descriptors alone and before any byte moves, and returns the
:class:`ValidatedPlan` that the executor runs and transports trust. It builds, sends and runs
nothing (``planner``, ``codec``, ``executor`` do). See docs/transports.md ("Transfer plans").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvplane.errors import InvalidArgumentError, PlanError
from kvplane.ids import RegionId, TokenRange
from kvplane.transfer.coverage import Coverage, coverage_of_descriptors
from kvplane.transfer.op import TransferOp, check_layers, is_index
from kvplane.transfer.stats import PlanStats, compute_stats
from kvplane.transports.base import DescriptorList
from kvplane.transports.checks import CheckedBatch, check_batch, join_batches
from kvplane.transports.descriptors import concat_descriptors

__all__ = [  # TransferOp: re-exported from its own module
    "TransferOp", "TransferPlan", "ValidatedPlan", "joint_ops",
]  # fmt: skip


@dataclass(frozen=True, slots=True, eq=False)
class TransferPlan:
    """Frozen list of ops plus the request it answers.

    ``tokens`` is the effective token range moved (after prefix reuse and sliding window);
    ``layers`` the global layer ids; ``coverage`` the analytic moments of the requested byte
    mapping (``coverage.num_bytes`` is the logical byte count), whose offsets are within
    ``src_region`` and ``dst_region``: every descriptor must name that side's region (the
    moments see offsets only, so this is what ties the bytes to their pools); the fingerprints
    are the two layouts' physical fingerprints (empty when unknown), so a receiver can check the
    plan was built for its pool.
    """

    ops: tuple[TransferOp, ...]
    tokens: TokenRange
    layers: tuple[int, ...]
    coverage: Coverage
    src_region: RegionId
    dst_region: RegionId
    src_fingerprint: bytes = b""
    dst_fingerprint: bytes = b""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        if any(not isinstance(op, TransferOp) for op in self.ops):
            raise PlanError("TransferPlan.ops must hold TransferOps")
        if not isinstance(self.tokens, TokenRange):
            raise PlanError(f"TransferPlan.tokens must be a TokenRange, got {self.tokens!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        check_layers(self.layers, "TransferPlan")
        if not isinstance(self.coverage, Coverage):
            raise PlanError(f"TransferPlan.coverage must be a Coverage, got {self.coverage!r}")
        for name in ("src_region", "dst_region"):
            if not is_index(getattr(self, name)):
                raise PlanError(
                    f"TransferPlan.{name} must be an int >= 0, got {getattr(self, name)!r}"
                )

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def logical_bytes(self) -> int:
        """Bytes the request needs (analytic, from the planner)."""
        return self.coverage.num_bytes

    @property
    def num_bytes(self) -> int:
        """Bytes the descriptors move."""
        return sum(op.num_bytes for op in self.ops)

    @property
    def num_descriptors(self) -> int:
        return sum(op.num_descriptors for op in self.ops)

    @property
    def empty(self) -> bool:
        return not self.ops

    def src_descriptors(self) -> DescriptorList:
        """Every op's source descriptors, concatenated in op order."""
        return concat_descriptors([op.src for op in self.ops])

    def dst_descriptors(self) -> DescriptorList:
        """Every op's destination descriptors, concatenated in op order."""
        return concat_descriptors([op.dst for op in self.ops])

    # -- validation --------------------------------------------------------------------------------
    def validate(
        self,
        src_region_lengths: Mapping[RegionId, int],
        dst_region_lengths: Mapping[RegionId, int],
    ) -> ValidatedPlan:
        """The plan as a :class:`ValidatedPlan`, or ``PlanError`` if it is unsafe or inexact;
        mutates nothing but the descriptor lists' cached facts.

        Proves, by :func:`~kvplane.transports.checks.check_batch` (the one check of pairing,
        bounds and overlap) over every op's descriptors at once: they pair up with equal
        lengths; every descriptor names its side's region (``src_region``/``dst_region``),
        which is in the given table, and lies inside it; no destination byte is written twice
        and no source byte is read twice (across all ops); the bytes moved equal the logical
        bytes requested. Checks, as a checksum rather than a proof, that the moments of the
        byte mapping (:data:`MONOMIALS` of :mod:`~kvplane.transfer.coverage`) equal the
        request's analytic moments: that catches shifted descriptors, wrong blocks, swapped
        destinations and the permutations the tests name, but some permutations of equal-sized
        blocks keep every moment and pass (see the module docstring of
        :mod:`~kvplane.transfer.coverage`). Each op's lists are vouched for the transports
        when :attr:`ValidatedPlan.batches` is first used.
        """
        for i, op in enumerate(self.ops):  # O(ops); their lengths are compared concatenated
            if len(op.src) != len(op.dst):
                raise PlanError(
                    f"op {i}: {len(op.src)} source descriptors but {len(op.dst)} destination "
                    "descriptors"
                )
        src = self.src_descriptors()
        dst = self.dst_descriptors()
        for side, descs, region in (("source", src, self.src_region),
                                    ("destination", dst, self.dst_region)):  # fmt: skip
            ids = descs.facts.region_ids  # cached, and shared with the bounds check below
            if len(ids) > 1 or (len(ids) == 1 and int(ids[0]) != region):
                i = int(np.flatnonzero(descs.regions != region)[0])  # only to name it
                raise PlanError(
                    f"{side} descriptor {i} names region {int(descs.regions[i])}, but the plan "
                    f"was built for region {region}"
                )
        whole = check_batch(src, dst, src_region_lengths, dst_region_lengths, sources_disjoint=True)
        got = coverage_of_descriptors(src, dst)
        if got.num_bytes != self.coverage.num_bytes:
            raise PlanError(
                f"plan moves {got.num_bytes} bytes but the request needs "
                f"{self.coverage.num_bytes} logical bytes"
            )
        if got != self.coverage:
            raise PlanError(
                "plan descriptors do not cover the requested bytes: moments "
                f"{got.describe()} != requested {self.coverage.describe()}"
            )
        return ValidatedPlan(
            (self,), whole, _named(src, src_region_lengths),
            _named(dst, dst_region_lengths), _key=_KEY,
        )  # fmt: skip

    def stats(self) -> PlanStats:
        """Bytes, op count, descriptors per op, transfer amplification and contiguous runs."""
        return compute_stats(
            [op.num_descriptors for op in self.ops],
            self.src_descriptors(),
            self.dst_descriptors(),
            self.logical_bytes,
        )

    def equals(self, other: TransferPlan) -> bool:
        """Value equality (descriptor lists compare by content)."""
        return (
            len(self.ops) == len(other.ops)
            and all(a.equals(b) for a, b in zip(self.ops, other.ops, strict=True))
            and self.tokens == other.tokens
            and self.layers == other.layers
            and self.coverage == other.coverage
            and self.src_region == other.src_region
            and self.dst_region == other.dst_region
            and self.src_fingerprint == other.src_fingerprint
            and self.dst_fingerprint == other.dst_fingerprint
        )

    def describe(self) -> list[dict[str, object]]:
        """One plain-data row per op (for logs, traces and ``kvplane`` inspection output)."""
        return [
            {
                "op": i,
                "tokens": [op.tokens.start, op.tokens.end],
                "layers": list(op.layers),
                "chunk_keys": [k.hex() for k in op.chunk_keys],
                "slice_id": op.slice_id,
                "descriptors": op.num_descriptors,
                "bytes": op.num_bytes,
                "first_src_offset": int(op.src.offsets[0]) if len(op.src) else None,
                "first_dst_offset": int(op.dst.offsets[0]) if len(op.dst) else None,
            }
            for i, op in enumerate(self.ops)
        ]


_KEY = object()
"""Held only by this module: a :class:`ValidatedPlan` comes from :meth:`TransferPlan.validate`
or :meth:`ValidatedPlan.join`, never from a caller's constructor call."""


def _named(
    descs: DescriptorList, lengths: Mapping[RegionId, int]
) -> tuple[tuple[RegionId, int], ...]:
    """``(region, length)`` of every region ``descs`` names, from the table checked against."""
    return tuple((RegionId(r), lengths[RegionId(r)]) for r in descs.facts.region_ids.tolist())


@dataclass(frozen=True, slots=True, eq=False)
class ValidatedPlan:
    """Plans that validation proved safe and exact against the region tables it was given, with
    the facts it proved, so that nothing downstream checks them again: the executor runs it as
    it is, and a transport finds each batch vouched and checks only that its regions are still
    registered and long enough (O(regions)).

    ``plans``: one (:meth:`TransferPlan.validate`) or several run jointly (:meth:`join`).
    ``whole``: every pair of every op at once, proved paired and free of bytes written or read
    twice; :attr:`batches` are its parts, one transport batch per op position.
    ``src_regions``/``dst_regions``: ``(region, length)`` of every region the
    sources/destinations name, from the tables validation checked bounds against. Only this
    module builds one (``InvalidArgumentError`` otherwise).
    """

    plans: tuple[TransferPlan, ...]
    whole: CheckedBatch
    src_regions: tuple[tuple[RegionId, int], ...]
    dst_regions: tuple[tuple[RegionId, int], ...]
    _key: object = field(default=None, repr=False)
    _batches: tuple[CheckedBatch, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self._key is not _KEY:
            raise InvalidArgumentError(
                "a ValidatedPlan comes from TransferPlan.validate or ValidatedPlan.join"
            )

    @property
    def plan(self) -> TransferPlan:
        """The validated plan (``InvalidArgumentError`` for several run jointly)."""
        if len(self.plans) != 1:
            raise InvalidArgumentError(f"this ValidatedPlan joins {len(self.plans)} plans")
        return self.plans[0]

    @property
    def num_bytes(self) -> int:
        """Bytes the batches move."""
        return self.whole.num_bytes

    @property
    def logical_bytes(self) -> int:
        """Bytes the plans' requests need (equal to :attr:`num_bytes`: validation proved it)."""
        return sum(p.logical_bytes for p in self.plans)

    @property
    def batches(self) -> tuple[CheckedBatch, ...]:
        """The transport batches: batch ``k`` holds op ``k`` of every plan (:func:`joint_ops`),
        each a part of :attr:`whole` (vouched, not checked again). Built on first use: a caller
        that runs :attr:`whole` as one batch never pays for one proof per op."""
        found = self._batches
        if found is None:
            ops = joint_ops(self.plans)
            found = (self.whole,) if len(ops) == 1 else tuple(self.whole.part(*o) for o in ops)
            object.__setattr__(self, "_batches", found)  # a racing build finds the same
        return found

    @property
    def empty(self) -> bool:
        return not any(p.ops for p in self.plans)

    @classmethod
    def join(cls, validated: Sequence[ValidatedPlan]) -> ValidatedPlan:
        """``validated`` run as one (batch ``k``: op ``k`` of every plan, :func:`joint_ops`),
        so a transfer unit of several pools costs one transport batch per op position.
        ``PlanError`` if two of them write the same destination byte or read the same source
        byte (each one's own ops were checked when it was validated); one is handed back."""
        if not validated or any(not isinstance(v, ValidatedPlan) for v in validated):
            raise InvalidArgumentError("join needs one or more ValidatedPlans")
        if len(validated) == 1:
            return validated[0]
        whole = join_batches([v.whole for v in validated], "plans run jointly")
        plans = tuple(p for v in validated for p in v.plans)
        src_regions = dict(r for v in validated for r in v.src_regions)
        dst_regions = dict(r for v in validated for r in v.dst_regions)
        return cls(
            plans, whole, tuple(sorted(src_regions.items())),
            tuple(sorted(dst_regions.items())), _key=_KEY,
        )  # fmt: skip


def joint_ops(plans: Sequence[TransferPlan]) -> tuple[tuple[DescriptorList, DescriptorList], ...]:
    """The batches of running ``plans`` jointly: batch ``k`` moves op ``k`` of every plan that
    has one (their descriptors concatenated in plan order), so a transfer unit made of several
    plans -- a final slice's KV and its whole-only records -- costs one transport batch, not
    one per plan. One plan gives its own ops' lists unchanged."""
    count = max((len(p.ops) for p in plans), default=0)
    out = []
    for k in range(count):  # concat_descriptors hands a lone list back unchanged
        ops = [p.ops[k] for p in plans if k < len(p.ops)]
        out.append(
            (concat_descriptors([o.src for o in ops]), concat_descriptors([o.dst for o in ops]))
        )
    return tuple(out)
