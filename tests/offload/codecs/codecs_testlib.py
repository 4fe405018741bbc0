"""Helpers of the codec tests: chunk formats and chunks drawn by hypothesis, and the error
bounds of the lossy formats as docs/offload.md states them."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from kvplane.offload.codecs import ChunkFormat

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
ALL_DTYPES = (*FLOATS, torch.uint8, torch.int8, torch.float8_e4m3fn)
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""Half an ulp, relative: the error of the final cast of a decoded value to the KV dtype."""
TINY = {torch.float32: 2.0**-149, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-25}
"""Half the smallest subnormal: the absolute error of that cast near zero."""


@st.composite
def formats(
    draw: st.DrawFn, dtypes: tuple[torch.dtype, ...], comps: tuple[int, ...] = (1, 2)
) -> ChunkFormat:
    """A chunk format of one of ``dtypes`` and ``comps`` with small random axes."""
    return ChunkFormat(
        draw(st.sampled_from(dtypes)), draw(st.integers(1, 3)), draw(st.integers(1, 2)),
        draw(st.sampled_from(comps)), draw(st.integers(1, 5)), draw(st.integers(1, 3)),
        draw(st.integers(1, 9)),
    )  # fmt: skip


def chunk_of(fmt: ChunkFormat, seed: int, magnitude: float = 1.0) -> torch.Tensor:
    """A deterministic chunk of ``fmt`` (1-D uint8): normal values times ``magnitude`` for float
    dtypes, uniform bytes for the others."""
    g = torch.Generator().manual_seed(seed)
    if fmt.dtype in FLOATS:
        x = (torch.randn(fmt.shape, generator=g) * magnitude).to(fmt.dtype)
        return x.contiguous().view(-1).view(torch.uint8)
    return torch.randint(0, 256, (fmt.nbytes,), generator=g, dtype=torch.uint8)


def values(fmt: ChunkFormat, chunk: torch.Tensor) -> torch.Tensor:
    """``chunk``'s values as float64 of ``fmt.shape``."""
    return fmt.view(chunk).double()


def cast_slack(fmt: ChunkFormat, decoded: torch.Tensor) -> torch.Tensor:
    """What the cast of a float32 result back to ``fmt.dtype`` may add, per value."""
    return decoded.abs() * UNIT_ROUNDOFF[fmt.dtype] + TINY[fmt.dtype]
