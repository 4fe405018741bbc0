"""The FP8 codec: KV quantised to float8 e4m3fn with a float32 scale per chunk or per channel,
optionally after a block Hadamard rotation of each head vector (:mod:`.rotation`).

Scale ``s = amax / 448`` (e4m3fn's largest finite value) over the whole chunk (``chunk``) or
over the tokens of each (layer, K/V, head, dim) channel (``channel``) of the values coded:
``y = x`` or, with ``rotate``, ``y = x H``. Decoding is ``q * s`` (then ``H^T / b``). The error
of a coded value ``y`` before the cast back to the KV dtype is at most ``e = s * max(2**-4 *
|y / s|, 2**-10)`` (3 mantissa bits: relative 2^-4; subnormals: absolute 2^-10 of the scaled
value); rotated, a value ``x`` is off by at most ``sum(e) / b`` over its run of ``b``.
Vectorised tensor ops only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.errors import InvalidArgumentError
from kvplane.offload.codecs.base import ChunkFormat, CodecPlan, byte_view, float_reasons, make_plan
from kvplane.offload.codecs.rotation import rotate, unrotate_
from kvplane.offload.codecs.scaled import ScaledFrame, put_scales, safe_scales
from kvplane.validators import require_bool
from kvplane.verdicts import Verdict, verdict

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GRANULARITIES = ("chunk", "channel")


@dataclass(frozen=True, slots=True)
class FP8Codec:
    """float8 e4m3fn with a ``granularity`` of ``chunk`` or ``channel`` scales, of the head
    vectors themselves or (``rotate``) of their block Hadamard rotation."""

    granularity: str = "channel"
    rotate: bool = True
    name = "fp8"

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise InvalidArgumentError(
                f"FP8Codec.granularity must be one of {GRANULARITIES}, got {self.granularity!r}"
            )
        require_bool("FP8Codec.rotate", self.rotate)

    @property
    def ident(self) -> str:
        turn = ":rotate=hadamard" if self.rotate else ""
        return f"fp8:e4m3fn:scale={self.granularity}{turn}"

    def check(self, fmt: ChunkFormat) -> Verdict:
        return verdict(float_reasons("fp8", fmt))

    def _frame(self, fmt: ChunkFormat) -> ScaledFrame:
        return ScaledFrame((_scale_shape(self.granularity, fmt).numel(),), fmt.numel)

    def plan(self, fmt: ChunkFormat) -> CodecPlan:
        return make_plan(self, fmt, lossless=False, encoded_bytes=self._frame(fmt).nbytes)

    def encode(self, plan: CodecPlan, chunk: torch.Tensor) -> memoryview | None:
        fmt = plan.fmt
        x = fmt.view(chunk).float()
        if not bool(torch.isfinite(x).all()):
            return None  # a rotation would smear inf or NaN over its run: store raw
        y = rotate(x) if self.rotate else x
        dims = (0, 3) if self.granularity == "channel" else (0, 1, 2, 3, 4, 5)
        scale = safe_scales(y.abs().amax(dim=dims, keepdim=True), FP8_MAX)
        if scale is None:
            return None
        buf, scales, body = self._frame(fmt).allocate()
        put_scales(scales, [scale])
        body.view(FP8).view(fmt.shape).copy_(torch.clamp(y / scale, -FP8_MAX, FP8_MAX))
        return byte_view(buf)

    def decode(self, plan: CodecPlan, payload: memoryview, out: torch.Tensor) -> None:
        fmt = plan.fmt
        (scale,), body = self._frame(fmt).unpack(payload)
        y = (
            body.view(FP8)
            .view(fmt.shape)
            .float()
            .mul_(scale.view(_scale_shape(self.granularity, fmt)))
        )
        fmt.view(out).copy_(unrotate_(y) if self.rotate else y)


def _scale_shape(granularity: str, fmt: ChunkFormat) -> torch.Size:
    """Shape of the scale tensor, broadcastable against ``fmt.shape``."""
    if granularity == "chunk":
        return torch.Size((1, 1, 1, 1, 1, 1))
    return torch.Size((1, fmt.layers, fmt.comps, 1, fmt.heads, fmt.head_dim))
