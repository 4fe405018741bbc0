"""Plan statistics: bytes, ops, descriptors per op, transfer amplification and contiguous runs.

``contiguous_runs`` is the fewest descriptors that could express a plan's byte mapping: the
number of maximal runs that are contiguous on *both* sides at once. It is computed from the
descriptors alone (sort by source address, count neighbours that continue each other on both
sides), so comparing it with the descriptor count measures how well a planner coalesced: a
perfectly coalesced single-op plan has ``descriptors == contiguous_runs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.metrics import transfer_amplification
from kvplane.transports.base import DescriptorList


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Summary of one plan (see :meth:`kvplane.transfer.plan.TransferPlan.stats`)."""

    num_bytes: int
    """Bytes the plan moves."""
    logical_bytes: int
    """Bytes the request needs (analytic)."""
    ops: int
    descriptors: int
    max_descriptors_per_op: int
    mean_descriptors_per_op: float
    amplification: float
    """``num_bytes / logical_bytes`` (1.0 for an exact plan, 0.0 for an empty one)."""
    contiguous_runs: int
    """Fewest descriptors that could express the same byte mapping (ignoring op boundaries)."""

    def as_dict(self) -> dict[str, int | float]:
        return {
            "num_bytes": self.num_bytes,
            "logical_bytes": self.logical_bytes,
            "ops": self.ops,
            "descriptors": self.descriptors,
            "max_descriptors_per_op": self.max_descriptors_per_op,
            "mean_descriptors_per_op": self.mean_descriptors_per_op,
            "amplification": self.amplification,
            "contiguous_runs": self.contiguous_runs,
        }


def contiguous_runs(src: DescriptorList, dst: DescriptorList) -> int:
    """Number of maximal runs of the paired lists that are contiguous on both sides.

    Pairs are sorted by source ``(region, offset)``; pair ``j`` continues pair ``i`` when both
    regions match and ``src_i`` and ``dst_i`` end exactly where ``src_j`` and ``dst_j`` start.
    Source ranges of a valid plan do not overlap, so continuing pairs are neighbours in that order.
    """
    n = len(src)
    if n < 2:
        return n
    order = np.lexsort((src.offsets, src.regions))
    s_reg, s_off = src.regions[order], src.offsets[order]
    d_reg, d_off = dst.regions[order], dst.offsets[order]
    length = src.lengths[order]
    joins = (
        (s_reg[1:] == s_reg[:-1])
        & (d_reg[1:] == d_reg[:-1])
        & (s_off[:-1] + length[:-1] == s_off[1:])
        & (d_off[:-1] + length[:-1] == d_off[1:])
    )
    return n - int(np.count_nonzero(joins))


def compute_stats(
    per_op: Sequence[int], src: DescriptorList, dst: DescriptorList, logical_bytes: int
) -> PlanStats:
    """Stats from the descriptor count of each op and the plan's concatenated descriptors."""
    moved = src.total_bytes
    return PlanStats(
        num_bytes=moved,
        logical_bytes=logical_bytes,
        ops=len(per_op),
        descriptors=len(src),
        max_descriptors_per_op=max(per_op, default=0),
        mean_descriptors_per_op=(len(src) / len(per_op)) if per_op else 0.0,
        amplification=transfer_amplification(moved, logical_bytes),
        contiguous_runs=contiguous_runs(src, dst),
    )
