"""A hybrid model's per-request recurrent state: one STATE pool (``KVLayout.state``), one slot
per request, one row per Mamba layer.

Shape contract of a row (float32, ``state_dim = conv_dim * (K - 1) + H * P * N``): the last
``K - 1`` conv inputs ``[conv_dim, K - 1]`` (oldest first), then the SSM state ``[H, P, N]``.
``num_tokens[slot]`` counts the tokens the slot has consumed; a slot is only advanced by a step
that starts exactly there (or restarts it at 0). Snapshot/restore copy a slot's rows whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.errors import InvalidArgumentError
from kvplane.layout import KVLayout
from kvplane.models.bamba_config import MambaShape
from kvplane.models.kv import PagedKVCache
from kvplane.state_split import MambaGeometry, StateSplit


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """One slot's state, copied: ``rows [num_mamba_layers, state_dim]`` after ``num_tokens``."""

    rows: torch.Tensor
    num_tokens: int


def state_layout(
    shape: MambaShape, layer_ids: tuple[int, ...], num_slots: int, tp: tuple[int, int] = (1, 0)
) -> KVLayout:
    """The STATE layout of ``num_slots`` requests of the Mamba layers ``layer_ids`` (float32
    rows of ``conv_dim * (K - 1) + H * P * N`` elements; see the module docstring), of which
    TP rank ``tp[1]`` of ``tp[0]`` holds its :class:`~kvplane.state_split.StateSplit`
    (``LayoutError`` for a split vLLM refuses)."""
    s = shape  # as a plain geometry: a StateSplit compares geometries by class and value
    geometry = MambaGeometry(s.num_heads, s.head_dim, s.num_groups, s.state_size, s.conv_kernel)
    return KVLayout.state(
        num_slots=num_slots,
        layer_ids=layer_ids,
        state_dim=geometry.row_dim,
        dtype=torch.float32,
        split=StateSplit(geometry, *tp),
    )


class RecurrentState:
    """The STATE pool of ``num_slots`` requests; see the module docstring. ``pool`` (default: a
    new zeroed one on ``device``) may belong to someone else (a worker's transport-registered
    state pool): this class only takes views of it."""

    def __init__(
        self,
        shape: MambaShape,
        layer_ids: tuple[int, ...],
        num_slots: int,
        device: torch.device | str = "cpu",
        pool: torch.Tensor | None = None,
    ) -> None:
        self.shape = shape
        self.conv_width = shape.conv_kernel - 1
        self.conv_size = shape.conv_dim * self.conv_width
        self.layout = state_layout(shape, layer_ids, num_slots)
        if pool is None:
            pool = self.layout.allocate(device)
        self.layout.check_pool(pool)
        self.pool = pool
        self.num_tokens = [0] * num_slots

    @property
    def num_slots(self) -> int:
        return self.layout.num_blocks

    def check_advance(self, slot: int, start: int) -> None:
        """``InvalidArgumentError`` unless a step starting at ``start`` may run on ``slot``:
        the slot exists and ``start`` is 0 (a restart) or the tokens it has consumed."""
        if not 0 <= slot < self.num_slots:
            raise InvalidArgumentError(
                f"state slot {slot} is outside the {self.num_slots} slots of the state pool"
            )
        have = self.num_tokens[slot]
        if start not in (0, have):
            raise InvalidArgumentError(
                f"state slot {slot} holds the state after {have} tokens; a step starting at "
                f"{start} needs the state after {start} (a prefix hit without its state)"
            )

    def conv(self, layer_id: int, slot: int) -> torch.Tensor:
        """View ``[conv_dim, K - 1]`` of one layer's conv inputs for ``slot``."""
        row = self.layout.state_view(self.pool, layer_id)[slot]
        return row[: self.conv_size].view(self.shape.conv_dim, self.conv_width)

    def ssm(self, layer_id: int, slot: int) -> torch.Tensor:
        """View ``[H, P, N]`` of one layer's SSM state for ``slot``."""
        s = self.shape
        row = self.layout.state_view(self.pool, layer_id)[slot]
        return row[self.conv_size :].view(s.num_heads, s.head_dim, s.state_size)

    def reset(self, slot: int) -> None:
        """Zero ``slot`` (the state before any token)."""
        for layer in self.layout.layer_ids:
            self.layout.state_view(self.pool, layer)[slot].zero_()
        self.num_tokens[slot] = 0

    def snapshot(self, slot: int) -> StateSnapshot:
        rows = [self.layout.state_view(self.pool, i)[slot].clone() for i in self.layout.layer_ids]
        return StateSnapshot(torch.stack(rows), self.num_tokens[slot])

    def restore(self, slot: int, snap: StateSnapshot) -> None:
        """Write ``snap`` into ``slot``; ``InvalidArgumentError`` for a foreign shape."""
        want = (self.layout.num_layers, self.layout.head_dim)
        if tuple(snap.rows.shape) != want:
            raise InvalidArgumentError(f"snapshot rows {tuple(snap.rows.shape)}, pool needs {want}")
        for k, layer in enumerate(self.layout.layer_ids):
            self.layout.state_view(self.pool, layer)[slot].copy_(snap.rows[k])
        self.num_tokens[slot] = snap.num_tokens

    def resume(self, slot: int, num_tokens: int) -> None:
        """Declare that ``slot`` holds the state after ``num_tokens`` tokens, written there by
        someone else (received over PD, restored from a prefix snapshot); the caller vouches
        for it. ``InvalidArgumentError`` for a slot outside the pool or a negative count."""
        if not 0 <= slot < self.num_slots:
            raise InvalidArgumentError(
                f"state slot {slot} is outside the {self.num_slots} slots of the state pool"
            )
        if num_tokens < 0:
            raise InvalidArgumentError(f"a state holds >= 0 tokens, got {num_tokens}")
        self.num_tokens[slot] = num_tokens


class HybridKVCache(PagedKVCache):
    """A paged KV pool for the attention layers plus the :class:`RecurrentState` of the Mamba
    layers: what a hybrid model's ``forward_step`` reads and writes."""

    def __init__(
        self,
        layout: KVLayout,
        state: RecurrentState,
        pool: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(layout, pool, device)
        if state.pool.device != self.device:
            raise InvalidArgumentError(f"state on {state.pool.device}, KV on {self.device}")
        self.state = state
