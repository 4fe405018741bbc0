"""Lossy codecs: every decoded value within its format's stated bound (hypothesis over shapes,
dtypes and magnitudes), exact frames and scales, inf/NaN refused, damaged payloads refused.

Bounds (docs/offload.md, "Codecs"), before the final cast to the KV dtype: fp8 e4m3fn,
``|y - y'| <= e = s * max(2**-4 * |y / s|, 2**-10)`` with ``s = amax / 448`` of the coded
values ``y`` (``x``, or with ``rotate`` its block Hadamard rotation, whose ``x`` is then off by
at most ``sum(e) / b`` over its run of ``b``); int8, half a step,
``|x - x'| <= s / 2`` with ``s = amax / 127`` (K per channel, V per token).
"""

from __future__ import annotations

import pytest
import torch
from codecs_testlib import FLOATS, cast_slack, chunk_of, formats, values
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import CorruptChunkError
from kvplane.offload.codecs import ChunkFormat, FP8Codec, Int8Codec
from kvplane.offload.codecs.rotation import hadamard_width

MAGNITUDES = st.sampled_from([1e-3, 1.0, 300.0])
EPS = 2.0**-20  # float32 arithmetic inside the codecs (x / s, q * s), relative
ROT_EPS = 2.0**-18  # float32 sums of a rotation (b <= 8 terms here), relative to sum(|x|)


def _decode(codec: FP8Codec | Int8Codec, fmt: ChunkFormat, chunk: torch.Tensor) -> torch.Tensor:
    plan = codec.plan(fmt)
    payload = codec.encode(plan, chunk)
    assert payload is not None and len(payload) == plan.encoded_bytes
    out = torch.empty_like(chunk)
    codec.decode(plan, payload, out)
    return values(fmt, out)


def _runs(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` with its last axis split into rotation runs ``[..., n, b]``, and ``b``."""
    b = hadamard_width(x.shape[-1])
    return x.reshape(*x.shape[:-1], -1, b), b


def _sylvester(b: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@settings(max_examples=60, deadline=None)
@given(
    formats(FLOATS), st.integers(0, 2**31), MAGNITUDES, st.sampled_from(["chunk", "channel"]),
    st.booleans(),
)  # fmt: skip
def test_fp8_is_within_its_bound(
    fmt: ChunkFormat, seed: int, mag: float, gran: str, rotate: bool
) -> None:
    chunk = chunk_of(fmt, seed, mag)
    x = values(fmt, chunk)
    runs, b = _runs(x)
    y = (runs @ _sylvester(b)).reshape(x.shape) if rotate else x
    dims = (0, 3) if gran == "channel" else (0, 1, 2, 3, 4, 5)
    s = (y.abs().amax(dim=dims, keepdim=True).float() / 448).double()
    s = torch.where(s > 0, s, torch.ones_like(s))
    e = s * torch.maximum((y / s).abs() * 2.0**-4, torch.full_like(y, 2.0**-10))
    e = e * (1 + EPS) + y.abs() * EPS
    if rotate:  # sum(e) / b over each run, and the float32 sums of both rotations
        slack = _runs(x.abs())[0].sum(-1) + _runs(y.abs())[0].sum(-1) / b
        e = (_runs(e)[0].sum(-1) / b + slack * ROT_EPS).repeat_interleave(b, -1).view(x.shape)
    got = _decode(FP8Codec(gran, rotate), fmt, chunk)
    assert bool(((got - x).abs() <= e + cast_slack(fmt, got)).all())


@settings(max_examples=40, deadline=None)
@given(formats(FLOATS, comps=(2,)), st.integers(0, 2**31), MAGNITUDES)
def test_int8_is_within_half_a_step(fmt: ChunkFormat, seed: int, mag: float) -> None:
    chunk = chunk_of(fmt, seed, mag)
    x = values(fmt, chunk)
    k, v = x[:, :, 0:1], x[:, :, 1:2]
    ks = (k.abs().amax(dim=(0, 3), keepdim=True).float() / 127).double()
    vs = (v.abs().amax(dim=-1, keepdim=True).float() / 127).double()
    step = torch.cat([ks.expand_as(k), vs.expand_as(v)], dim=2)
    step = torch.where(step > 0, step, torch.ones_like(step))
    got = _decode(Int8Codec(), fmt, chunk)
    bound = step * (0.5 + EPS) + x.abs() * EPS + cast_slack(fmt, got)
    assert bool(((got - x).abs() <= bound).all())


def test_frames_hold_exact_scales_then_the_body() -> None:
    fmt = ChunkFormat(torch.float32, 1, 1, 2, 2, 1, 2)
    x = torch.tensor([1.0, -2.0, 4.0, 0.5, 0.0, 0.0, 0.0, 0.0]).view(fmt.shape)
    chunk = x.contiguous().view(-1).view(torch.uint8)
    codec = FP8Codec("chunk", rotate=False)
    payload = codec.encode(codec.plan(fmt), chunk)
    assert payload is not None and len(payload) == 4 + 8
    scale = torch.tensor(4.0) / 448  # float32, as the codec computes it
    assert torch.frombuffer(bytearray(payload[:4]), dtype=torch.float32).item() == scale.item()
    int8 = Int8Codec()
    frame = int8.encode(int8.plan(fmt), chunk)
    assert frame is not None and len(frame) == 4 * 2 + 4 * 2 + 8  # K: 2 channels, V: 2 tokens
    scales = torch.frombuffer(bytearray(frame[:16]), dtype=torch.float32).tolist()
    k_scales = (torch.tensor([4.0, 2.0]) / 127).tolist()  # K channels: max |x| over tokens
    assert scales == [*k_scales, 1.0, 1.0]  # V tokens all zero: scale 1
    q = torch.frombuffer(bytearray(frame[16:]), dtype=torch.int8).tolist()
    assert q == [32, -127, 127, 32, 0, 0, 0, 0]  # 1 / (4/127) = 31.75 -> 32
    out = torch.empty_like(chunk)
    int8.decode(int8.plan(fmt), frame, out)
    assert fmt.view(out)[:, :, 1].abs().sum().item() == 0.0  # zeros decode exactly


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_inf_or_nan_cannot_be_quantised(bad: float) -> None:
    fmt = ChunkFormat(torch.bfloat16, 1, 1, 2, 2, 1, 2)
    x = torch.ones(fmt.shape, dtype=torch.bfloat16)
    x[0, 0, 1, 1, 0, 1] = bad
    chunk = x.view(-1).view(torch.uint8)
    for codec in (FP8Codec(), FP8Codec("chunk", rotate=False), Int8Codec()):
        assert codec.encode(codec.plan(fmt), chunk) is None


def test_a_damaged_frame_is_corrupt() -> None:
    fmt = ChunkFormat(torch.float16, 1, 1, 2, 4, 1, 4)
    codec = FP8Codec()
    plan = codec.plan(fmt)
    payload = codec.encode(plan, chunk_of(fmt, 3))
    assert payload is not None
    out = torch.empty(fmt.nbytes, dtype=torch.uint8)
    with pytest.raises(CorruptChunkError, match="lossy payload of 10 bytes"):
        codec.decode(plan, memoryview(bytes(payload)[:10]), out)
    nan_scale = bytearray(payload)
    nan_scale[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(CorruptChunkError, match="scale"):
        codec.decode(plan, memoryview(bytes(nan_scale)), out)
