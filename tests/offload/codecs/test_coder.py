"""ChunkCoder: coded or raw per chunk (the tag says which), decode by tag, the fingerprint."""

from __future__ import annotations

import pytest
import torch
from codecs_testlib import chunk_of

from kvplane.errors import UnsupportedError
from kvplane.offload.codecs import RAW_TAG, ChunkCoder, ChunkFormat, make_codec

FMT = ChunkFormat(torch.bfloat16, 2, 2, 2, 8, 2, 16)
FP = bytes(range(16))


def test_a_chunk_the_codec_cannot_shrink_is_stored_raw() -> None:
    coder = ChunkCoder(make_codec("lz4"), FMT)
    noise = torch.randint(0, 256, (FMT.nbytes,), dtype=torch.uint8, generator=torch.Generator())
    enc = coder.encode(noise)
    assert enc.raw and enc.tag == RAW_TAG and len(enc.data) == FMT.nbytes
    out = torch.empty_like(noise)
    assert coder.decode(enc.tag, enc.data, out) and torch.equal(out, noise)
    zeros = torch.zeros(FMT.nbytes, dtype=torch.uint8)
    small = coder.encode(zeros)
    assert small.tag == coder.tag and len(small.data) < 100
    assert coder.decode(small.tag, small.data, out) and torch.equal(out, zeros)


def test_inf_is_stored_raw_by_a_lossy_codec() -> None:
    coder = ChunkCoder(make_codec("fp8"), FMT)
    x = torch.ones(FMT.shape, dtype=torch.bfloat16)
    x[1, 1, 1, 7, 1, 15] = float("inf")
    chunk = x.view(-1).view(torch.uint8)
    enc = coder.encode(chunk)
    assert enc.raw
    out = torch.empty_like(chunk)
    assert coder.decode(enc.tag, enc.data, out) and torch.equal(out, chunk)


def test_decode_refuses_a_foreign_tag_or_a_bad_payload() -> None:
    coder = ChunkCoder(make_codec("zstd"), FMT)
    chunk = chunk_of(FMT, 0)
    enc = coder.encode(chunk)
    out = torch.empty_like(chunk)
    other = ChunkCoder(make_codec("lz4"), FMT)
    assert not other.decode(enc.tag, enc.data, out)
    assert not coder.decode(enc.tag, memoryview(b"junk"), out)
    assert not coder.decode(RAW_TAG, memoryview(b"junk"), out)


def test_the_fingerprint_commits_to_the_codec() -> None:
    fps = [ChunkCoder(make_codec(n), FMT).fingerprint(FP) for n in ("raw", "zstd", "fp8", "int8")]
    assert fps[0] == FP  # raw tiers keep the layout's own fingerprint
    assert len(set(fps)) == 4 and all(len(f) == 16 for f in fps)
    assert ChunkCoder(make_codec("fp8-chunk"), FMT).fingerprint(FP) != fps[2]


def test_a_codec_that_cannot_code_the_format_is_refused() -> None:
    with pytest.raises(UnsupportedError, match="int8"):
        ChunkCoder(make_codec("int8"), ChunkFormat(torch.bfloat16, 1, 1, 1, 4, 1, 8))
