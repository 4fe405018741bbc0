"""The chunk codec contract: a chunk's format as data, ``check``/``plan``, ``encode``/``decode``.

A codec turns the bytes of one stored chunk (block-major, ``[blocks, layers, comps, tokens,
heads, dim]``: docs/offload.md, "Device and host copies") into a payload for a cold tier and
back. ``check`` never raises for an unsupported format, ``plan`` validates once, ``encode`` and
``decode`` trust their plan. Codecs hold no tier, file or socket: tiers call them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvplane.errors import InvalidArgumentError, UnsupportedError
from kvplane.layout import KVLayout, dtype_name
from kvplane.validators import require_int
from kvplane.verdicts import Unsupported, Verdict

TAG_BYTES = 8
"""Length of a codec tag: the chunk header's name for the codec and parameters of a payload."""
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
"""The KV dtypes the lossy codecs quantise."""


def codec_tag(ident: str) -> bytes:
    """The :data:`TAG_BYTES`-byte header tag of a codec ``ident`` (name and parameters)."""
    return hashlib.blake2b(b"kvplane-codec\0" + ident.encode(), digest_size=TAG_BYTES).digest()


RAW_TAG = codec_tag("raw")
"""The tag of a payload stored as the chunk's own bytes (the raw codec, or a fallback)."""


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    """The facts of a chunk a codec reads: its KV ``dtype`` and the sizes of the axes of its
    block-major bytes. ``comps`` is 2 for K then V (MHA/GQA), 1 for an MLA latent."""

    dtype: torch.dtype
    blocks: int
    layers: int
    comps: int
    tokens: int
    heads: int
    head_dim: int

    def __post_init__(self) -> None:
        dtype_name(self.dtype)  # a KV dtype (LayoutError otherwise)
        for name in ("blocks", "layers", "tokens", "heads", "head_dim"):
            require_int(f"ChunkFormat.{name}", getattr(self, name), min=1)
        require_int("ChunkFormat.comps", self.comps, min=1, max=2)

    @classmethod
    def of(cls, layout: KVLayout, chunk_bytes: int) -> ChunkFormat:
        """The format of a chunk of ``chunk_bytes`` bytes of a pool laid out as ``layout``
        (``InvalidArgumentError`` unless that is a whole number of blocks)."""
        blocks, rest = divmod(chunk_bytes, layout.bytes_per_block)
        if rest or blocks < 1:
            raise InvalidArgumentError(
                f"a chunk of {chunk_bytes} bytes is not a whole number of "
                f"{layout.bytes_per_block}-byte blocks"
            )
        return cls(
            layout.dtype, blocks, layout.num_layers, layout.num_components,
            layout.block_size, layout.local_heads, layout.head_dim,
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.blocks, self.layers, self.comps, self.tokens, self.heads, self.head_dim)

    @property
    def numel(self) -> int:
        return self.blocks * self.layers * self.comps * self.tokens * self.heads * self.head_dim

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def view(self, chunk: torch.Tensor) -> torch.Tensor:
        """``chunk`` (1-D uint8, :attr:`nbytes`) as a ``dtype`` tensor of :attr:`shape`."""
        return chunk.view(self.dtype).view(self.shape)


@dataclass(frozen=True, slots=True)
class CodecPlan:
    """A codec's plan for one chunk format, made by its ``plan`` after ``check`` said
    Supported: what ``encode`` and ``decode`` trust. ``tag`` names ``ident`` in chunk headers;
    ``encoded_bytes`` is the payload size of a fixed-size (lossy) codec, else ``None``."""

    ident: str
    fmt: ChunkFormat
    lossless: bool
    encoded_bytes: int | None = None

    @property
    def tag(self) -> bytes:
        return codec_tag(self.ident)


@runtime_checkable
class ChunkCodec(Protocol):
    """See the module docstring for the contract of each member."""

    @property
    def name(self) -> str:
        """The registry name (``raw``, ``zstd``, ``fp8``...)."""
        ...

    @property
    def ident(self) -> str:
        """Name and parameters, e.g. ``fp8:scale=channel``: what chunk headers and the tier
        fingerprint commit to."""
        ...

    def check(self, fmt: ChunkFormat) -> Verdict:
        """Whether chunks of ``fmt`` can be coded here (never raises for an unsupported one)."""
        ...

    def plan(self, fmt: ChunkFormat) -> CodecPlan:
        """The plan for ``fmt``; ``UnsupportedError`` with the reasons of :meth:`check`."""
        ...

    def encode(self, plan: CodecPlan, chunk: torch.Tensor) -> memoryview | None:
        """The payload of ``chunk`` (1-D contiguous uint8, ``plan.fmt.nbytes``), or ``None``
        when this chunk cannot be coded (a lossy codec meeting inf or NaN): store it raw."""
        ...

    def decode(self, plan: CodecPlan, payload: memoryview, out: torch.Tensor) -> None:
        """Write the chunk coded in ``payload`` into ``out`` (1-D contiguous uint8,
        ``plan.fmt.nbytes``); ``CorruptChunkError`` for a payload it cannot decode."""
        ...


def make_plan(
    codec: ChunkCodec, fmt: ChunkFormat, lossless: bool, encoded_bytes: int | None = None
) -> CodecPlan:
    """``codec``'s plan for ``fmt`` once its ``check`` says Supported; else
    ``UnsupportedError`` naming the codec and its reasons."""
    got = codec.check(fmt)
    if isinstance(got, Unsupported):
        raise UnsupportedError(f"codec {codec.ident!r}: {'; '.join(got.reasons)}")
    return CodecPlan(codec.ident, fmt, lossless, encoded_bytes)


def float_reasons(name: str, fmt: ChunkFormat) -> list[str]:
    """Why a lossy codec ``name`` cannot quantise ``fmt``'s dtype (empty when it can)."""
    if fmt.dtype in FLOAT_DTYPES:
        return []
    return [f"{name} quantises float16, bfloat16 or float32 KV, not {dtype_name(fmt.dtype)}"]


def byte_view(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU uint8 tensor (shares its memory)."""
    return t.numpy().data
