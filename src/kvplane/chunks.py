"""Chunks: the transfer and storage unit, several consecutive full blocks of one sequence.

:class:`ChunkSpec` maps between token ranges, blocks and chunks (full chunks, and a tail of
leftover full blocks and the partial block that is never stored or keyed). A chunk's key is
the hash of its last block, which commits to the whole prefix; keys are read from a
sequence's block hashes, never computed from tokens here. Integer range arithmetic, vectorised
where it is per token. See docs/offload.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from kvplane.blocks.hashing import DIGEST_SIZE
from kvplane.errors import ChunkError
from kvplane.ids import BlockHash, ChunkKey, TokenRange
from kvplane.validators import require_int


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One full chunk of a sequence: its index, key and the tokens and blocks it covers."""

    index: int
    key: ChunkKey
    token_range: TokenRange
    block_range: range


@dataclass(frozen=True, slots=True)
class ChunkSplit:
    """How ``num_tokens`` tokens divide into full chunks and a tail.

    ``chunked`` = tokens covered by full chunks; ``tail_full_blocks`` = full blocks after the last
    full chunk; ``tail_tokens`` = tokens of the partial block (``< block_size``).
    """

    num_tokens: int
    num_full_chunks: int
    chunked: TokenRange
    tail: TokenRange
    tail_full_blocks: int
    tail_tokens: int


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """``blocks_per_chunk`` blocks of ``block_size`` tokens make one chunk (both >= 1)."""

    block_size: int
    blocks_per_chunk: int = 1

    def __post_init__(self) -> None:
        require_int("ChunkSpec.block_size", self.block_size, min=1, error=ChunkError)
        require_int("ChunkSpec.blocks_per_chunk", self.blocks_per_chunk, min=1, error=ChunkError)

    @classmethod
    def from_chunk_tokens(cls, chunk_tokens: int, block_size: int) -> ChunkSpec:
        """Spec from a chunk size in tokens, which must be a positive multiple of ``block_size``."""
        require_int("block_size", block_size, min=1, error=ChunkError)
        require_int("chunk_tokens", chunk_tokens, min=1, error=ChunkError)
        if chunk_tokens % block_size:
            raise ChunkError(
                f"chunk_tokens must be a multiple of block_size={block_size}, got {chunk_tokens}"
            )
        return cls(block_size=block_size, blocks_per_chunk=chunk_tokens // block_size)

    @property
    def tokens_per_chunk(self) -> int:
        return self.block_size * self.blocks_per_chunk

    # -- counting ------------------------------------------------------------------------------
    def split(self, num_tokens: int) -> ChunkSplit:
        """Divide a sequence of ``num_tokens`` tokens into full chunks and a tail."""
        require_int("num_tokens", num_tokens, min=0, error=ChunkError)
        chunks = num_tokens // self.tokens_per_chunk
        chunked_end = chunks * self.tokens_per_chunk
        full_blocks = num_tokens // self.block_size
        return ChunkSplit(
            num_tokens=num_tokens,
            num_full_chunks=chunks,
            chunked=TokenRange(0, chunked_end),
            tail=TokenRange(chunked_end, num_tokens),
            tail_full_blocks=full_blocks - chunks * self.blocks_per_chunk,
            tail_tokens=num_tokens - full_blocks * self.block_size,
        )

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (the partial tail block included)."""
        require_int("num_tokens", num_tokens, min=0, error=ChunkError)
        return -(-num_tokens // self.block_size)

    # -- mapping between units --------------------------------------------------------------------
    def blocks_of(self, tokens: TokenRange) -> range:
        """Block indices (within the sequence) touched by ``tokens``; empty for an empty range."""
        if tokens.empty:
            return range(tokens.start // self.block_size, tokens.start // self.block_size)
        return range(tokens.start // self.block_size, -(-tokens.end // self.block_size))

    def full_blocks_of(self, tokens: TokenRange) -> range:
        """Blocks lying entirely inside ``tokens``."""
        first = -(-tokens.start // self.block_size)
        last = tokens.end // self.block_size
        return range(first, max(first, last))

    def chunks_of(self, tokens: TokenRange) -> range:
        """Full-chunk indices lying entirely inside ``tokens`` (partial chunks are not units)."""
        first = -(-tokens.start // self.tokens_per_chunk)
        last = tokens.end // self.tokens_per_chunk
        return range(first, max(first, last))

    def token_range_of_block(self, block_index: int) -> TokenRange:
        require_int("block_index", block_index, min=0, error=ChunkError)
        return TokenRange(block_index * self.block_size, (block_index + 1) * self.block_size)

    def token_range_of_chunk(self, chunk_index: int) -> TokenRange:
        require_int("chunk_index", chunk_index, min=0, error=ChunkError)
        return TokenRange(
            chunk_index * self.tokens_per_chunk, (chunk_index + 1) * self.tokens_per_chunk
        )

    def block_range_of_chunk(self, chunk_index: int) -> range:
        require_int("chunk_index", chunk_index, min=0, error=ChunkError)
        first = chunk_index * self.blocks_per_chunk
        return range(first, first + self.blocks_per_chunk)

    def block_of_positions(self, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Vectorised: sequence block index of each token position (``int64``, same shape)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and int(pos.min()) < 0:
            raise ChunkError(f"token positions must be >= 0, got min {int(pos.min())}")
        return pos // self.block_size

    # -- keys -----------------------------------------------------------------------------------
    def chunk_keys(self, block_hashes: Sequence[BlockHash]) -> list[ChunkKey]:
        """Keys of the full chunks formed by a sequence's chained full-block hashes.

        ``block_hashes`` are the hashes of the sequence's first full blocks, in order (as
        ``BlockHasher.hash_blocks`` returns them). Blocks after the last full chunk are the tail
        and get no key. Raises :class:`ChunkError` unless ``block_hashes`` is a sequence of
        32-byte ``bytes`` hashes (every one is checked, the tail's too).
        """
        hashes = _block_hashes(block_hashes)
        step = self.blocks_per_chunk
        usable = len(hashes) - len(hashes) % step
        return [ChunkKey(bytes(hashes[i - 1])) for i in range(step, usable + 1, step)]

    def chunks(self, block_hashes: Sequence[BlockHash]) -> list[ChunkRef]:
        """The full chunks of a sequence with their keys, token ranges and block ranges."""
        return [
            ChunkRef(
                index=i,
                key=key,
                token_range=self.token_range_of_chunk(i),
                block_range=self.block_range_of_chunk(i),
            )
            for i, key in enumerate(self.chunk_keys(block_hashes))
        ]

    def chunk_block_ids(self, block_ids: Sequence[int], chunk_index: int) -> list[int]:
        """The pool block ids of one full chunk, given the sequence's block table."""
        blocks = self.block_range_of_chunk(chunk_index)
        if blocks.stop > len(block_ids):
            raise ChunkError(
                f"chunk {chunk_index} needs blocks {blocks.start}..{blocks.stop - 1} but the "
                f"block table holds {len(block_ids)}"
            )
        return list(block_ids[blocks.start : blocks.stop])


def _block_hashes(block_hashes: object) -> list[BlockHash]:
    """``block_hashes`` as a list after checking each is a :data:`BlockHash` (32 bytes).

    The common case (plain ``bytes`` of one length) is checked with two C-level maps; only a
    bad batch walks the items, to name the first bad one.
    """
    if isinstance(block_hashes, (str, bytes, bytearray)) or block_hashes is None:
        raise ChunkError(f"block_hashes must be a sequence of block hashes, got {block_hashes!r}")
    try:
        hashes = list(block_hashes)  # type: ignore[call-overload]
    except TypeError:
        raise ChunkError(
            f"block_hashes must be a sequence of block hashes, got {block_hashes!r:.80}"
        ) from None
    if hashes and (set(map(type, hashes)) != {bytes} or set(map(len, hashes)) != {DIGEST_SIZE}):
        for i, h in enumerate(hashes):
            if not isinstance(h, bytes) or len(h) != DIGEST_SIZE:
                raise ChunkError(
                    f"block_hashes[{i}] must be a {DIGEST_SIZE}-byte BlockHash, got {h!r:.80}"
                )
    return cast(list[BlockHash], hashes)
