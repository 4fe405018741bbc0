"""The transfer plan: frozen, inspectable, validated data that any transport executes.

A :class:`TransferPlan` is a tuple of :class:`TransferOp` s. Each op is one batch for
``Transport.submit``: two aligned columnar descriptor lists (``src[i]`` moves to ``dst[i]``,
equal lengths) plus what the op serves — its token range, its layers, the chunk keys it
contributes to and the pipelined slice it belongs to. The plan also carries the analytic
:class:`~kvplane.transfer.coverage.Coverage` of the request it was built for, so that
:meth:`TransferPlan.validate` can check, from the descriptors alone and before any byte moves,
that the plan stays inside its regions, moves each byte at most once and the requested number
of bytes, and -- by moments, a checksum that catches realistic planner and wire bugs but not
every permutation of blocks -- that they are the requested bytes, paired as requested.

Plans are built by :func:`kvplane.transfer.planner.plan_transfer` (a pure function), sent with
:mod:`kvplane.transfer.codec` and run by :class:`kvplane.transfer.executor.PlanExecutor`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.errors import PlanError
from kvplane.ids import ChunkKey, RegionId, SliceId, TokenRange
from kvplane.transfer.coverage import (
    Coverage,
    concat_descriptors,
    coverage_of_descriptors,
    first_overlap,
)
from kvplane.transfer.stats import PlanStats, compute_stats
from kvplane.transports.base import DescriptorList, check_pairing


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layers(layers: tuple[int, ...], where: str) -> None:
    # element checks in C (a plan names every layer: 61 for DeepSeek-V3, per slice)
    if layers and not (set(map(type, layers)) == {int} and min(layers) >= 0):
        raise PlanError(f"{where}.layers must be non-negative ints, got {layers!r}")


@dataclass(frozen=True, slots=True, eq=False)
class TransferOp:
    """One batch of paired descriptors and what it serves.

    ``tokens``: the sequence positions whose KV this op moves (for whole-only STATE pools, the
    block indices). ``layers``: global layer ids. ``chunk_keys``: keys of the chunks whose token
    range intersects ``tokens`` (empty when the caller gave none). ``slice_id``: the pipelined
    slice this op belongs to, if any. Construction checks the pairing (``PlanError``).
    """

    src: DescriptorList
    dst: DescriptorList
    tokens: TokenRange
    layers: tuple[int, ...]
    chunk_keys: tuple[ChunkKey, ...] = ()
    slice_id: SliceId | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.src, DescriptorList) or not isinstance(self.dst, DescriptorList):
            raise PlanError("TransferOp.src and .dst must be DescriptorLists")
        check_pairing(self.src, self.dst)
        if not isinstance(self.tokens, TokenRange):
            raise PlanError(f"TransferOp.tokens must be a TokenRange, got {self.tokens!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        _check_layers(self.layers, "TransferOp")
        object.__setattr__(self, "chunk_keys", tuple(self.chunk_keys))
        if any(not isinstance(k, bytes) for k in self.chunk_keys):
            raise PlanError(f"TransferOp.chunk_keys must be bytes, got {self.chunk_keys!r}")
        if self.slice_id is not None and not _is_index(self.slice_id):
            raise PlanError(
                f"TransferOp.slice_id must be None or an int >= 0, got {self.slice_id!r}"
            )

    @property
    def num_bytes(self) -> int:
        return self.src.total_bytes

    @property
    def num_descriptors(self) -> int:
        return len(self.src)

    def equals(self, other: TransferOp) -> bool:
        """Value equality (descriptor lists compare by content)."""
        return (
            self.src.equals(other.src)
            and self.dst.equals(other.dst)
            and self.tokens == other.tokens
            and self.layers == other.layers
            and self.chunk_keys == other.chunk_keys
            and self.slice_id == other.slice_id
        )


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
        _check_layers(self.layers, "TransferPlan")
        if not isinstance(self.coverage, Coverage):
            raise PlanError(f"TransferPlan.coverage must be a Coverage, got {self.coverage!r}")
        for name in ("src_region", "dst_region"):
            if not _is_index(getattr(self, name)):
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
    ) -> None:
        """Raise ``PlanError`` unless the plan is safe and exact; mutates nothing.

        Proves: every op's descriptors pair up with equal lengths; every descriptor names its
        side's region (``src_region``/``dst_region``), which is known, and lies inside it; no
        destination byte is written twice and no source byte is read twice (across all ops);
        the bytes moved equal the logical bytes requested. Checks, as a checksum rather than a
        proof, that the moments of the byte mapping (:data:`MONOMIALS` of
        :mod:`~kvplane.transfer.coverage`) equal the request's analytic moments: that catches
        shifted descriptors, wrong blocks, swapped destinations and the permutations the tests
        name, but some permutations of equal-sized blocks keep every moment and pass (see the
        module docstring of :mod:`~kvplane.transfer.coverage`).
        """
        for i, op in enumerate(self.ops):
            try:
                check_pairing(op.src, op.dst)
            except PlanError as exc:
                raise PlanError(f"op {i}: {exc}") from None
        src = self.src_descriptors()
        dst = self.dst_descriptors()
        for side, descs, region in (("source", src, self.src_region),
                                    ("destination", dst, self.dst_region)):  # fmt: skip
            ids = descs.facts.region_ids  # cached, and shared with check_bounds below
            if len(ids) > 1 or (len(ids) == 1 and int(ids[0]) != region):
                i = int(np.flatnonzero(descs.regions != region)[0])  # only to name it
                raise PlanError(
                    f"{side} descriptor {i} names region {int(descs.regions[i])}, but the plan "
                    f"was built for region {region}"
                )
        src.check_bounds(dict(src_region_lengths), "source")
        dst.check_bounds(dict(dst_region_lengths), "destination")
        for side, descs in (("destination", dst), ("source", src)):
            clash = first_overlap(descs)
            if clash is not None:
                i, j = clash
                raise PlanError(
                    f"{side} descriptors {i} and {j} overlap: region {int(descs.regions[i])} "
                    f"[{int(descs.offsets[i])}, +{int(descs.lengths[i])}) and "
                    f"[{int(descs.offsets[j])}, +{int(descs.lengths[j])})"
                )
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


def check_disjoint(plans: Sequence[TransferPlan]) -> None:
    """``PlanError`` if two of ``plans`` write the same destination byte or read the same source
    byte (each plan's own ops are checked by :meth:`TransferPlan.validate`); mutates nothing."""
    if len(plans) < 2:
        return
    for side, descs in (
        ("destination", concat_descriptors([p.dst_descriptors() for p in plans])),
        ("source", concat_descriptors([p.src_descriptors() for p in plans])),
    ):
        clash = first_overlap(descs)
        if clash is not None:
            i = clash[0]
            raise PlanError(
                f"plans run jointly share {side} bytes: region {int(descs.regions[i])} "
                f"[{int(descs.offsets[i])}, +{int(descs.lengths[i])})"
            )
