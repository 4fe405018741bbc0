"""The payload frame of the lossy codecs: float32 scale tensors, then the quantised body.

One frame per (codec, chunk format): its size is fixed, so a payload of another length is
corrupt. Encoders write scales and body straight into the frame's views (no second copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvplane.errors import CorruptChunkError
from kvplane.validators import require_int

SCALE_DTYPE = torch.float32
"""Scales are stored as float32: the error bounds of docs/offload.md assume exact scales."""


@dataclass(frozen=True, slots=True)
class ScaledFrame:
    """``scale_counts[i]`` float32 scales of tensor ``i``, back to back, then ``body_bytes``
    bytes of quantised values."""

    scale_counts: tuple[int, ...]
    body_bytes: int

    def __post_init__(self) -> None:
        for n in self.scale_counts:
            require_int("ScaledFrame.scale_counts[i]", n, min=1)
        require_int("ScaledFrame.body_bytes", self.body_bytes, min=1)

    @property
    def scale_bytes(self) -> int:
        return sum(self.scale_counts) * SCALE_DTYPE.itemsize

    @property
    def nbytes(self) -> int:
        return self.scale_bytes + self.body_bytes

    def allocate(self) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """A new frame buffer (1-D uint8) with its scale views (float32) and body view (uint8)."""
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        scales, body = self.views(buf)
        return buf, scales, body

    def views(self, buf: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The scale tensors (1-D float32) and the body (1-D uint8) of frame ``buf``."""
        scales = buf[: self.scale_bytes].view(SCALE_DTYPE)
        out, at = [], 0
        for n in self.scale_counts:
            out.append(scales[at : at + n])
            at += n
        return out, buf[self.scale_bytes :]

    def unpack(self, payload: memoryview) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The views of a stored ``payload``; ``CorruptChunkError`` unless it is one frame
        long or when a scale is not finite and > 0 (no encoder writes one)."""
        if len(payload) != self.nbytes:
            raise CorruptChunkError(f"a lossy payload of {len(payload)} bytes, not {self.nbytes}")
        data = bytearray(payload) if payload.readonly else payload
        scales, body = self.views(torch.frombuffer(data, dtype=torch.uint8))
        for s in scales:
            if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
                raise CorruptChunkError("a lossy payload holds a scale that is not finite and > 0")
        return scales, body


def safe_scales(amax: torch.Tensor, qmax: float) -> torch.Tensor | None:
    """``amax / qmax`` with 1 where ``amax`` is 0 (an all-zero channel decodes to zeros), or
    ``None`` when some ``amax`` is not finite (inf or NaN KV: the chunk is stored raw)."""
    if not bool(torch.isfinite(amax).all()):
        return None
    scale = amax / qmax
    return torch.where(scale > 0, scale, torch.ones((), dtype=scale.dtype))


def put_scales(views: Sequence[torch.Tensor], scales: Sequence[torch.Tensor]) -> None:
    """Copy each scale tensor (any shape) flat into its frame view."""
    for view, s in zip(views, scales, strict=True):
        view.copy_(s.reshape(-1))
