"""The FP8 codec: KV quantised to float8 e4m3fn with a float32 scale per chunk or per channel.

Scale ``s = amax / 448`` (e4m3fn's largest finite value) over the whole chunk (``chunk``) or
over the tokens of each (layer, K/V, head, dim) channel (``channel``). Decoding is ``q * s``;
the error of a value ``x`` before the cast back to the KV dtype is at most
``s * max(2**-4 * |x / s|, 2**-10)`` (3 mantissa bits: relative 2^-4; subnormals: absolute
2^-10 of the scaled value). Vectorised tensor ops only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.errors import InvalidArgumentError
from kvplane.offload.codecs.base import ChunkFormat, CodecPlan, byte_view, float_reasons, make_plan
from kvplane.offload.codecs.scaled import ScaledFrame, put_scales, safe_scales
from kvplane.verdicts import Verdict, verdict

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GRANULARITIES = ("chunk", "channel")


@dataclass(frozen=True, slots=True)
class FP8Codec:
    """float8 e4m3fn with a ``granularity`` of ``chunk`` or ``channel`` scales."""

    granularity: str = "channel"
    name = "fp8"

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise InvalidArgumentError(
                f"FP8Codec.granularity must be one of {GRANULARITIES}, got {self.granularity!r}"
            )

    @property
    def ident(self) -> str:
        return f"fp8:e4m3fn:scale={self.granularity}"

    def check(self, fmt: ChunkFormat) -> Verdict:
        return verdict(float_reasons("fp8", fmt))

    def _frame(self, fmt: ChunkFormat) -> ScaledFrame:
        return ScaledFrame((_scale_shape(self.granularity, fmt).numel(),), fmt.numel)

    def plan(self, fmt: ChunkFormat) -> CodecPlan:
        return make_plan(self, fmt, lossless=False, encoded_bytes=self._frame(fmt).nbytes)

    def encode(self, plan: CodecPlan, chunk: torch.Tensor) -> memoryview | None:
        fmt = plan.fmt
        x = fmt.view(chunk).float()
        dims = (0, 3) if self.granularity == "channel" else (0, 1, 2, 3, 4, 5)
        scale = safe_scales(x.abs().amax(dim=dims, keepdim=True), FP8_MAX)
        if scale is None:
            return None
        buf, scales, body = self._frame(fmt).allocate()
        put_scales(scales, [scale])
        body.view(FP8).view(fmt.shape).copy_(torch.clamp(x / scale, -FP8_MAX, FP8_MAX))
        return byte_view(buf)

    def decode(self, plan: CodecPlan, payload: memoryview, out: torch.Tensor) -> None:
        fmt = plan.fmt
        (scale,), body = self._frame(fmt).unpack(payload)
        q = body.view(FP8).view(fmt.shape).float()
        fmt.view(out).copy_(q.mul_(scale.view(_scale_shape(self.granularity, fmt))))


def _scale_shape(granularity: str, fmt: ChunkFormat) -> torch.Size:
    """Shape of the scale tensor, broadcastable against ``fmt.shape``."""
    if granularity == "chunk":
        return torch.Size((1, 1, 1, 1, 1, 1))
    return torch.Size((1, fmt.layers, fmt.comps, 1, fmt.heads, fmt.head_dim))
