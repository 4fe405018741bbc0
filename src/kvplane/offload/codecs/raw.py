"""The raw codec: a chunk's payload is its own bytes (the default of every tier).

Also what a coded tier stores for a chunk that its codec cannot shrink (see
:mod:`~kvplane.offload.codecs.coder`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.errors import CorruptChunkError
from kvplane.offload.codecs.base import ChunkFormat, CodecPlan, byte_view, make_plan
from kvplane.verdicts import Supported, Verdict


@dataclass(frozen=True, slots=True)
class RawCodec:
    """Identity: every format is supported, the payload is the chunk."""

    name: str = "raw"

    @property
    def ident(self) -> str:
        return "raw"

    def check(self, fmt: ChunkFormat) -> Verdict:
        return Supported()

    def plan(self, fmt: ChunkFormat) -> CodecPlan:
        return make_plan(self, fmt, lossless=True, encoded_bytes=fmt.nbytes)

    def encode(self, plan: CodecPlan, chunk: torch.Tensor) -> memoryview:
        """A view of ``chunk`` itself (no copy)."""
        return byte_view(chunk)

    def decode(self, plan: CodecPlan, payload: memoryview, out: torch.Tensor) -> None:
        """Copy ``payload`` into ``out``; ``CorruptChunkError`` unless it is one chunk long."""
        if len(payload) != plan.fmt.nbytes:
            raise CorruptChunkError(f"a raw payload of {len(payload)} bytes, not {plan.fmt.nbytes}")
        byte_view(out)[:] = payload
