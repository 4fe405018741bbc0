"""Block Hadamard rotation of a KV vector's last axis, applied before a lossy cast and undone
after it: it spreads a channel's rounding error over its run (why: docs/offload.md, "Codecs").

Sylvester's ``H`` of ``b = ``:func:`hadamard_width` entries of +-1 (exact in every float format)
multiplies each run of ``b`` consecutive elements: ``y = x H``, and ``x = y H^T / b`` (``H H^T
= b I``; dividing by a power of two is exact). An error ``e`` in ``y`` returns as ``e H^T / b``:
element ``i`` of ``x`` is off by at most ``sum_j |e_j| / b`` over its run. Vectorised ops only.
"""

from __future__ import annotations

import torch

from kvplane.validators import require_int

MAX_WIDTH = 64
"""The widest rotation: ``b`` multiply-adds per value on encode and decode each."""


def hadamard_width(dim: int) -> int:
    """The rotation width for a last axis of ``dim``: its largest power-of-two divisor, at
    most :data:`MAX_WIDTH` (1, no rotation, for an odd ``dim``)."""
    require_int("dim", dim, min=1)
    return min(dim & -dim, MAX_WIDTH)


def _sylvester(width: int) -> torch.Tensor:
    """Sylvester's ``width x width`` matrix of +-1 (float32; ``width`` a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < width:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) with each run of :func:`hadamard_width` elements of its last axis
    multiplied by ``H``: a new tensor of ``x``'s shape."""
    b = hadamard_width(x.shape[-1])
    if b == 1:
        return x.clone()
    runs = x.reshape(*x.shape[:-1], -1, b)
    return torch.matmul(runs, _sylvester(b)).reshape(x.shape)


def unrotate_(y: torch.Tensor) -> torch.Tensor:
    """Undo :func:`rotate` (``y H^T / b`` per run; ``H`` is symmetric) in place of ``y``
    (float32, contiguous); returns ``y``."""
    b = hadamard_width(y.shape[-1])
    if b == 1:
        return y
    runs = y.view(*y.shape[:-1], -1, b)
    runs.copy_(torch.matmul(runs, _sylvester(b)))
    return y.mul_(1.0 / b)
