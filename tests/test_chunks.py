"""ChunkSpec: token/block/chunk mapping, partial tails, chunk keys, bad input (with hypothesis)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplane.chunks import ChunkSpec
from kvplane.errors import ChunkError
from kvplane.ids import BlockHash, TokenRange


def fake_hashes(n: int) -> list[BlockHash]:
    return [BlockHash(hashlib.sha256(i.to_bytes(4, "little")).digest()) for i in range(n)]


def test_split_with_partial_tail() -> None:
    spec = ChunkSpec(block_size=4, blocks_per_chunk=3)
    s = spec.split(30)  # 7 full blocks + 2 tokens; 2 full chunks (24 tokens)
    assert s.num_full_chunks == 2
    assert s.chunked == TokenRange(0, 24)
    assert s.tail == TokenRange(24, 30)
    assert s.tail_full_blocks == 1 and s.tail_tokens == 2
    assert spec.num_blocks_for(30) == 8
    assert spec.split(0).num_full_chunks == 0 and spec.split(0).tail == TokenRange(0, 0)


def test_chunk_keys_are_last_block_hashes() -> None:
    spec = ChunkSpec(block_size=4, blocks_per_chunk=3)
    hashes = fake_hashes(7)
    keys = spec.chunk_keys(hashes)
    assert keys == [hashes[2], hashes[5]]
    refs = spec.chunks(hashes)
    assert [r.index for r in refs] == [0, 1]
    assert refs[1].token_range == TokenRange(12, 24)
    assert refs[1].block_range == range(3, 6)
    assert spec.chunk_keys(hashes[:2]) == []
    one = ChunkSpec(block_size=4)
    assert one.chunk_keys(hashes[:3]) == hashes[:3]


def test_mapping_between_units() -> None:
    spec = ChunkSpec(block_size=4, blocks_per_chunk=2)
    assert spec.blocks_of(TokenRange(3, 9)) == range(0, 3)
    assert spec.blocks_of(TokenRange(8, 8)) == range(2, 2)
    assert spec.full_blocks_of(TokenRange(3, 9)) == range(1, 2)
    assert spec.full_blocks_of(TokenRange(5, 7)) == range(2, 2)
    assert spec.chunks_of(TokenRange(0, 15)) == range(0, 1)
    assert spec.chunks_of(TokenRange(1, 24)) == range(1, 3)
    assert spec.token_range_of_block(2) == TokenRange(8, 12)
    assert spec.token_range_of_chunk(1) == TokenRange(8, 16)
    assert spec.block_range_of_chunk(2) == range(4, 6)
    assert spec.chunk_block_ids([7, 3, 9, 1, 5], 1) == [9, 1]
    np.testing.assert_array_equal(spec.block_of_positions([0, 3, 4, 17]), [0, 0, 1, 4])


@given(
    block_size=st.integers(1, 16),
    blocks_per_chunk=st.integers(1, 8),
    num_tokens=st.integers(0, 600),
)
def test_split_partitions_every_token(
    block_size: int, blocks_per_chunk: int, num_tokens: int
) -> None:
    spec = ChunkSpec(block_size, blocks_per_chunk)
    s = spec.split(num_tokens)
    assert s.chunked.end == s.tail.start and s.tail.end == num_tokens
    assert len(s.chunked) == s.num_full_chunks * spec.tokens_per_chunk
    assert len(s.tail) == s.tail_full_blocks * block_size + s.tail_tokens
    assert 0 <= s.tail_full_blocks < blocks_per_chunk and 0 <= s.tail_tokens < block_size
    hashes = fake_hashes(num_tokens // block_size)
    assert len(spec.chunk_keys(hashes)) == s.num_full_chunks
    # every full chunk's blocks are inside the chunked range, covered exactly once
    covered = [b for c in range(s.num_full_chunks) for b in spec.block_range_of_chunk(c)]
    assert covered == list(range(s.num_full_chunks * blocks_per_chunk))
    assert spec.chunks_of(TokenRange(0, num_tokens)) == range(s.num_full_chunks)


@given(start=st.integers(0, 200), length=st.integers(0, 200), block_size=st.integers(1, 9))
def test_blocks_of_covers_exactly_the_range(start: int, length: int, block_size: int) -> None:
    spec = ChunkSpec(block_size)
    tokens = TokenRange(start, start + length)
    blocks = spec.blocks_of(tokens)
    positions = np.arange(tokens.start, tokens.end)
    assert set(spec.block_of_positions(positions).tolist()) == set(blocks)
    for b in spec.full_blocks_of(tokens):
        assert tokens.contains(spec.token_range_of_block(b))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ChunkSpec(0, 1), r"^ChunkSpec\.block_size must be a positive int, got 0$"),
        (lambda: ChunkSpec(4, 0), r"^ChunkSpec\.blocks_per_chunk must be a positive int, got 0$"),
        (lambda: ChunkSpec(4, True), r"^ChunkSpec\.blocks_per_chunk must be a positive int"),
        (
            lambda: ChunkSpec.from_chunk_tokens(10, 4),
            r"^chunk_tokens must be a multiple of block_size=4, got 10$",
        ),
        (
            lambda: ChunkSpec.from_chunk_tokens(0, 4),
            r"^chunk_tokens must be a positive int, got 0$",
        ),
        (lambda: ChunkSpec.from_chunk_tokens(8, 0), r"^block_size must be a positive int, got 0$"),
        (lambda: ChunkSpec(4, 2).split(-1), r"^num_tokens must be an int >= 0, got -1$"),
        (
            lambda: ChunkSpec(4, 2).num_blocks_for(1.0),
            r"^num_tokens must be an int >= 0, got 1\.0$",
        ),
        (
            lambda: ChunkSpec(4, 2).token_range_of_chunk(-1),
            r"^chunk_index must be an int >= 0, got -1$",
        ),
        (
            lambda: ChunkSpec(4, 2).token_range_of_block(False),
            r"^block_index must be an int >= 0, got False$",
        ),
        (lambda: ChunkSpec(4, 2).chunk_block_ids([1, 2, 3], 1), "holds 3"),
        (lambda: ChunkSpec(4, 2).block_of_positions([3, -1]), ">= 0"),
    ],
)
def test_bad_input_is_a_chunk_error(call: object, match: str) -> None:
    with pytest.raises(ChunkError, match=match):
        call()  # type: ignore[operator]
    assert ChunkSpec.from_chunk_tokens(12, 4) == ChunkSpec(4, 3)


@pytest.mark.parametrize(
    ("hashes", "match"),
    [
        ([3, 5], r"block_hashes\[0\] must be a 32-byte BlockHash, got 3"),
        (["ab"], r"block_hashes\[0\].*'ab'"),
        ([b"x" * 31], r"block_hashes\[0\]"),
        ([b"x" * 32, b"y" * 33], r"block_hashes\[1\]"),
        ([b"x" * 32, b"y" * 32, None], r"block_hashes\[2\].*None"),  # the tail is checked too
        (b"x" * 32, "sequence of block hashes"),  # one hash, not a list of them
        (None, "sequence of block hashes"),
        (5, "sequence of block hashes"),
    ],
)
def test_chunk_keys_validates_every_block_hash(hashes: object, match: str) -> None:
    with pytest.raises(ChunkError, match=match):
        ChunkSpec(4, 2).chunk_keys(hashes)  # type: ignore[arg-type]


def test_chunk_keys_accepts_hash_sequences_of_any_kind() -> None:
    hs = fake_hashes(4)

    class Digest(bytes):
        pass

    assert ChunkSpec(4, 2).chunk_keys(tuple(hs)) == [hs[1], hs[3]]
    got = ChunkSpec(4, 2).chunk_keys([Digest(h) for h in hs])
    assert got == [hs[1], hs[3]] and {type(k) for k in got} == {bytes}
    assert ChunkSpec(4, 2).chunk_keys([]) == []
