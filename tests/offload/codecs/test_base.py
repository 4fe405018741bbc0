"""The codec contract: chunk formats from layouts, verdicts as data, plans, tags, the registry."""

from __future__ import annotations

import pytest
import torch
from offload_testlib import tiny_layout

from kvplane.errors import ConfigError, InvalidArgumentError, UnsupportedError
from kvplane.layout import KVLayout
from kvplane.offload.codecs import CODECS, RAW_TAG, ChunkCodec, ChunkFormat, Int8Codec, make_codec
from kvplane.offload.codecs.base import codec_tag
from kvplane.verdicts import Supported, Unsupported, verdict


def test_a_chunk_format_reads_its_layout() -> None:
    fmt = ChunkFormat.of(tiny_layout(), 3 * 2048)
    assert fmt == ChunkFormat(torch.float32, 3, 2, 2, 4, 2, 16)
    assert (fmt.shape, fmt.numel, fmt.nbytes) == ((3, 2, 2, 4, 2, 16), 1536, 6144)
    mla = KVLayout.mla(num_blocks=4, block_size=8, num_layers=3, latent_dim=16, rope_dim=8)
    assert ChunkFormat.of(mla, mla.bytes_per_block) == ChunkFormat(
        torch.bfloat16, 1, 3, 1, 8, 1, 24
    )
    with pytest.raises(InvalidArgumentError, match="not a whole number of 2048-byte blocks"):
        ChunkFormat.of(tiny_layout(), 3000)
    with pytest.raises(InvalidArgumentError, match="comps"):
        ChunkFormat(torch.float32, 1, 1, 3, 1, 1, 1)


def test_view_is_the_block_major_chunk() -> None:
    fmt = ChunkFormat(torch.float32, 2, 1, 2, 3, 1, 4)
    x = torch.arange(fmt.numel, dtype=torch.float32)
    assert torch.equal(fmt.view(x.view(torch.uint8)), x.view(fmt.shape))


def test_verdicts_are_data() -> None:
    assert verdict([]) == Supported()
    assert verdict(["a", "b"]) == Unsupported(("a", "b"))
    with pytest.raises(InvalidArgumentError):
        Unsupported(())
    mla = ChunkFormat(torch.bfloat16, 1, 1, 1, 4, 1, 8)
    got = Int8Codec().check(mla)
    assert isinstance(got, Unsupported) and "MHA/GQA" in got.reasons[0]
    with pytest.raises(UnsupportedError, match="codec 'int8:k=channel:v=token': int8 scales"):
        Int8Codec().plan(mla)
    fp8_of_ints = make_codec("fp8").check(ChunkFormat(torch.int8, 1, 1, 2, 1, 1, 1))
    assert fp8_of_ints == Unsupported(("fp8 quantises float16, bfloat16 or float32 KV, not int8",))


def test_tags_are_stable_digests_of_the_ident() -> None:
    assert RAW_TAG == codec_tag("raw") == bytes.fromhex("bc0ee643bd916c95")
    idents = [make_codec(n).ident for n in CODECS]
    assert idents == [
        "raw", "lz4:block:shuffle=1", "zstd:level=1:shuffle=1",
        "fp8:e4m3fn:scale=channel:rotate=hadamard",
        "fp8:e4m3fn:scale=chunk", "int8:k=channel:v=token",
    ]  # fmt: skip
    assert len({codec_tag(i) for i in idents}) == len(idents)


def test_the_registry_builds_every_codec_and_refuses_unknown_names() -> None:
    fmt = ChunkFormat(torch.bfloat16, 1, 1, 2, 2, 1, 4)
    for name in CODECS:
        codec = make_codec(name)
        assert isinstance(codec, ChunkCodec) and codec.name == name.split("-")[0]
        plan = codec.plan(fmt)
        assert plan.fmt == fmt and plan.tag == codec_tag(codec.ident)
    with pytest.raises(ConfigError, match="codec 'gzip' is not one of"):
        make_codec("gzip")
