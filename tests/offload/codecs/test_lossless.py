"""Lossless codecs: byte-exact round trips for random shapes and dtypes, byte planes, damaged
payloads refused, and a missing engine is a typed Unsupported."""

from __future__ import annotations

import pytest
import torch
from codecs_testlib import ALL_DTYPES, chunk_of, formats
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import CorruptChunkError
from kvplane.offload.codecs import ChunkFormat, LZ4Codec, RawCodec, ZstdCodec
from kvplane.offload.codecs import lossless as lossless_module
from kvplane.offload.codecs.base import ChunkCodec
from kvplane.offload.codecs.lossless import shuffle, unshuffle
from kvplane.verdicts import Unsupported

LOSSLESS: list[ChunkCodec] = [
    RawCodec(), ZstdCodec(), ZstdCodec(level=3, shuffle=False), LZ4Codec(), LZ4Codec(False),
]  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(formats(ALL_DTYPES), st.integers(0, 2**31), st.sampled_from(range(len(LOSSLESS))))
def test_round_trips_are_byte_exact(fmt: ChunkFormat, seed: int, which: int) -> None:
    codec = LOSSLESS[which]
    plan = codec.plan(fmt)
    chunk = chunk_of(fmt, seed)
    payload = codec.encode(plan, chunk)
    assert payload is not None
    out = torch.full_like(chunk, 0xA5)
    codec.decode(plan, payload, out)
    assert torch.equal(out, chunk)


def test_byte_planes() -> None:
    chunk = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.uint8)
    planes = shuffle(chunk, 2)
    assert planes.tolist() == [[1, 3, 5], [2, 4, 6]]
    out = torch.zeros(6, dtype=torch.uint8)
    unshuffle(planes.tobytes(), 2, out)
    assert torch.equal(out, chunk)


def test_planes_make_floats_smaller() -> None:
    """A float's byte planes compress better once each plane spans zstd blocks of its own
    (128 KiB: smaller chunks only reorder the literals of one Huffman table)."""
    fmt = ChunkFormat(torch.bfloat16, 4, 2, 2, 16, 4, 64)  # 512 KiB
    chunk = chunk_of(fmt, 0)
    for with_planes, without in ((ZstdCodec(), ZstdCodec(shuffle=False)),
                                 (LZ4Codec(), LZ4Codec(shuffle=False))):  # fmt: skip
        a = with_planes.encode(with_planes.plan(fmt), chunk)
        b = without.encode(without.plan(fmt), chunk)
        assert a is not None and b is not None and len(a) < len(b)


@pytest.mark.parametrize("codec", [ZstdCodec(), LZ4Codec()], ids=["zstd", "lz4"])
def test_a_damaged_payload_is_corrupt_never_wrong_bytes(codec: ChunkCodec) -> None:
    fmt = ChunkFormat(torch.float16, 2, 1, 2, 8, 2, 8)
    plan = codec.plan(fmt)
    payload = codec.encode(plan, chunk_of(fmt, 1))
    assert payload is not None
    out = torch.empty(fmt.nbytes, dtype=torch.uint8)
    for bad in (bytes(payload)[: len(payload) // 2], b"\x00" * 7):
        with pytest.raises(CorruptChunkError):
            codec.decode(plan, memoryview(bad), out)
    with pytest.raises(CorruptChunkError, match="raw payload of 3 bytes"):
        RawCodec().decode(RawCodec().plan(fmt), memoryview(b"abc"), out)


def test_a_missing_engine_is_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    real = lossless_module.importlib.util.find_spec
    monkeypatch.setattr(
        lossless_module.importlib.util, "find_spec",
        lambda name, *a: None if name == "zstandard" else real(name, *a),
    )  # fmt: skip
    got = ZstdCodec().check(ChunkFormat(torch.float32, 1, 1, 1, 1, 1, 1))
    assert got == Unsupported(
        ("the zstandard package is not installed: pip install 'kvplane[codecs]'",)
    )
