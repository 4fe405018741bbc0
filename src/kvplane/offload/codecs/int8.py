"""The int8 codec (KIVI-style): K with a scale per channel, V with a scale per token.

K's outliers sit in a few channels, so each (layer, head, dim) channel of K gets its scale over
the chunk's tokens; V's error matters per token, so each (block, layer, token, head) vector of V
gets its own. Symmetric: ``s = amax / 127``, ``q = round(x / s)``; the error before the cast
back to the KV dtype is at most half a step, ``s / 2``. MHA/GQA layouts only (K and V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.offload.codecs.base import ChunkFormat, CodecPlan, byte_view, float_reasons, make_plan
from kvplane.offload.codecs.scaled import ScaledFrame, put_scales, safe_scales
from kvplane.verdicts import Verdict, verdict

QMAX = 127.0


@dataclass(frozen=True, slots=True)
class Int8Codec:
    """Symmetric int8, per-channel K scales and per-token V scales."""

    name = "int8"

    @property
    def ident(self) -> str:
        return "int8:k=channel:v=token"

    def check(self, fmt: ChunkFormat) -> Verdict:
        reasons = float_reasons("int8", fmt)
        if fmt.comps != 2:
            reasons.append("int8 scales K per channel and V per token: it needs an MHA/GQA "
                           "layout (K and V), not a single latent; use fp8")  # fmt: skip
        return verdict(reasons)

    def plan(self, fmt: ChunkFormat) -> CodecPlan:
        return make_plan(self, fmt, lossless=False, encoded_bytes=_frame(fmt).nbytes)

    def encode(self, plan: CodecPlan, chunk: torch.Tensor) -> memoryview | None:
        fmt = plan.fmt
        x = fmt.view(chunk).float()
        k, v = x[:, :, 0], x[:, :, 1]  # [blocks, layers, tokens, heads, dim]
        ks = safe_scales(k.abs().amax(dim=(0, 2), keepdim=True), QMAX)
        vs = safe_scales(v.abs().amax(dim=-1, keepdim=True), QMAX)
        if ks is None or vs is None:
            return None
        buf, scales, body = _frame(fmt).allocate()
        put_scales(scales, [ks, vs])
        q = body.view(torch.int8).view(fmt.shape)
        q[:, :, 0].copy_(torch.round(k / ks).clamp_(-QMAX, QMAX))
        q[:, :, 1].copy_(torch.round(v / vs).clamp_(-QMAX, QMAX))
        return byte_view(buf)

    def decode(self, plan: CodecPlan, payload: memoryview, out: torch.Tensor) -> None:
        fmt = plan.fmt
        (ks, vs), body = _frame(fmt).unpack(payload)
        q = body.view(torch.int8).view(fmt.shape).float()
        b, layers, _, t, h, d = fmt.shape
        dst = fmt.view(out)
        dst[:, :, 0].copy_(q[:, :, 0].mul_(ks.view(1, layers, 1, h, d)))
        dst[:, :, 1].copy_(q[:, :, 1].mul_(vs.view(b, layers, t, h, 1)))


def _frame(fmt: ChunkFormat) -> ScaledFrame:
    """K scales ``[layers, heads, dim]``, V scales ``[blocks, layers, tokens, heads]``, body."""
    k = fmt.layers * fmt.heads * fmt.head_dim
    v = fmt.blocks * fmt.layers * fmt.tokens * fmt.heads
    return ScaledFrame((k, v), fmt.numel)
