"""A tier's codec bound to its chunk format: per-chunk raw fallback, tags and fingerprint.

:class:`ChunkCoder` is what the disk and Redis tiers hold. It encodes a chunk, or keeps it raw
when the codec cannot shrink it (the header's codec tag says which), decodes by that tag, and
mixes the codec into the tier's fingerprint, so chunks of one codec are a miss, never
garbage, for a tier configured with another.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvplane.errors import CorruptChunkError
from kvplane.offload.codecs.base import RAW_TAG, ChunkCodec, ChunkFormat, byte_view
from kvplane.offload.codecs.raw import RawCodec


@dataclass(frozen=True, slots=True)
class Encoded:
    """One chunk as a tier stores it: the codec ``tag`` for its header and the ``data``."""

    tag: bytes
    data: memoryview

    @property
    def raw(self) -> bool:
        return self.tag == RAW_TAG


class ChunkCoder:
    """``codec`` planned for chunks of ``fmt`` (``UnsupportedError`` from its plan)."""

    def __init__(self, codec: ChunkCodec, fmt: ChunkFormat) -> None:
        self.codec = codec
        self.plan = codec.plan(fmt)
        self.tag = self.plan.tag
        self.is_raw = self.tag == RAW_TAG

    @property
    def chunk_bytes(self) -> int:
        return self.plan.fmt.nbytes

    def fingerprint(self, layout_fingerprint: bytes) -> bytes:
        """The fingerprint of a tier coding with this codec: ``layout_fingerprint`` itself for
        ``raw``, else a digest of it and the codec's ident (same length)."""
        if self.is_raw:
            return layout_fingerprint
        return hashlib.blake2b(
            b"kvplane-tier-codec\0" + layout_fingerprint + self.plan.ident.encode(),
            digest_size=len(layout_fingerprint),
        ).digest()

    def encode(self, chunk: torch.Tensor) -> Encoded:
        """``chunk`` coded, or itself (tag :data:`RAW_TAG`, no copy) when the codec cannot code
        it or its payload would not be smaller than the chunk."""
        if not self.is_raw:
            data = self.codec.encode(self.plan, chunk)
            if data is not None and len(data) < self.chunk_bytes:
                return Encoded(self.tag, data)
        return Encoded(RAW_TAG, byte_view(chunk))

    def decode(self, tag: bytes, data: memoryview, out: torch.Tensor) -> bool:
        """Decode ``data`` stored under ``tag`` into ``out``; False when ``tag`` is not this
        codec's (nor raw) or the payload does not decode (``out`` then holds garbage)."""
        try:
            if tag == RAW_TAG:
                RawCodec().decode(self.plan, data, out)
            elif tag == self.tag:
                self.codec.decode(self.plan, data, out)
            else:
                return False
        except CorruptChunkError:
            return False
        return True
