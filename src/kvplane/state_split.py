"""A Mamba2 layer's state row and the TP rule of which parts of it a rank holds.

:class:`MambaGeometry` names the row: the conv inputs ``[conv_dim, K - 1]`` (channels
``x ‖ B ‖ C``, ``x`` ``H·P`` wide, ``B`` and ``C`` ``G·N`` each) then the SSM state
``[H, P, N]``. :class:`StateSplit` is TP rank ``tp_rank`` of ``tp_size``'s share of it, as
vLLM's ``MambaMixer2`` shards it: TP divides the heads (``x`` and the SSM state split by head);
it divides the groups (``B``/``C`` split by group) or there is one group, which every rank holds.
A rank's row is its four :class:`RowSpan` s in row order. Pure data: no tensors, no plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvplane.errors import LayoutError
from kvplane.validators import require_int

PARTS = ("x", "B", "C", "ssm")
"""The four parts of a row, in row order: conv ``x`` channels, conv ``B``, conv ``C``, SSM."""


@dataclass(frozen=True, slots=True)
class MambaGeometry:
    """One Mamba2 layer's state: ``num_heads`` (H) of ``head_dim`` (P), ``num_groups`` (G) of
    ``state_size`` (N), a causal conv of ``conv_kernel`` (K) taps; ``LayoutError`` unless every
    field is a positive int, K >= 2 and G divides H."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "num_groups", "state_size"):
            require_int(f"MambaGeometry.{name}", getattr(self, name), min=1, error=LayoutError)
        require_int("MambaGeometry.conv_kernel", self.conv_kernel, min=2, error=LayoutError)
        if self.num_heads % self.num_groups:
            raise LayoutError(
                f"MambaGeometry: {self.num_groups} groups do not divide {self.num_heads} heads"
            )

    @property
    def conv_dim(self) -> int:
        """Conv channels: ``H·P + 2·G·N``."""
        return self.num_heads * self.head_dim + 2 * self.num_groups * self.state_size

    @property
    def row_dim(self) -> int:
        """Elements of a whole row: ``conv_dim·(K - 1) + H·P·N``."""
        return (
            self.conv_dim * (self.conv_kernel - 1)
            + self.num_heads * self.head_dim * self.state_size
        )

    def parts(self) -> tuple[tuple[int, int, int], ...]:
        """Per part of :data:`PARTS`: ``(first element, units, elements per unit)``; a unit is
        a head (``x``, SSM) or a group (``B``, ``C``)."""
        w, h, g = self.conv_kernel - 1, self.num_heads, self.num_groups
        x, bc = self.head_dim * w, self.state_size * w
        return (
            (0, h, x),
            (h * x, g, bc),
            (h * x + g * bc, g, bc),
            (self.conv_dim * w, h, self.head_dim * self.state_size),
        )


@dataclass(frozen=True, slots=True)
class RowSpan:
    """Elements ``[start, start + length)`` of a whole row, at ``local`` in a rank's row."""

    start: int
    local: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def units_held(units: int, part: str, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The half-open units (heads or groups) of ``part`` TP rank ``tp_rank`` of ``tp_size``
    holds: an even contiguous split, or the one group on every rank. ``LayoutError`` for heads
    TP does not divide, or groups it does not divide that are not one (vLLM refuses both)."""
    if units % tp_size == 0:
        per = units // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if part in ("B", "C") and units == 1:
        return 0, 1
    what = "heads" if part in ("x", "ssm") else "groups (and not one)"
    raise LayoutError(f"TP {tp_size} does not divide the state's {units} {what}")


@dataclass(frozen=True, slots=True)
class StateSplit:
    """TP rank ``tp_rank`` of ``tp_size``'s share of every row of ``geometry`` (module
    docstring); ``tp_size`` 1 is the whole row. ``LayoutError`` for a split vLLM refuses."""

    geometry: MambaGeometry
    tp_size: int = 1
    tp_rank: int = 0
    spans: tuple[RowSpan, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, MambaGeometry):
            raise LayoutError(f"StateSplit.geometry must be a MambaGeometry: {self.geometry!r}")
        require_int("StateSplit.tp_size", self.tp_size, min=1, error=LayoutError)
        top = self.tp_size - 1
        require_int("StateSplit.tp_rank", self.tp_rank, min=0, max=top, error=LayoutError)
        spans, local = [], 0
        for part, (start, units, unit) in zip(PARTS, self.geometry.parts(), strict=True):
            lo, hi = units_held(units, part, self.tp_size, self.tp_rank)
            spans.append(RowSpan(start + lo * unit, local, (hi - lo) * unit))
            local += (hi - lo) * unit
        object.__setattr__(self, "spans", tuple(spans))

    @property
    def sharded(self) -> bool:
        """True when the rank holds part of each row (``tp_size > 1``)."""
        return self.tp_size > 1

    @property
    def local_dim(self) -> int:
        """Elements of the rank's row (its spans, concatenated)."""
        return sum(s.length for s in self.spans)

    def held(self, part: int) -> tuple[int, int]:
        """The half-open units of part ``part`` (an index into :data:`PARTS`) this rank holds."""
        _, units, _ = self.geometry.parts()[part]
        return units_held(units, PARTS[part], self.tp_size, self.tp_rank)

    def describe(self) -> dict[str, Any]:
        """Plain data (for a layout's description and fingerprints)."""
        g = self.geometry
        shape = [g.num_heads, g.head_dim, g.num_groups, g.state_size, g.conv_kernel]
        return {"mamba": shape, "tp": [self.tp_size, self.tp_rank]}
