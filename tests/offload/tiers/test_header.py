"""ChunkHeader: round trip, and every kind of damage decodes to None (never a wrong header)."""

from __future__ import annotations

import zlib

import pytest
from offload_testlib import key

from kvplane.errors import InvalidArgumentError
from kvplane.offload.codecs.base import RAW_TAG, codec_tag
from kvplane.offload.tiers.header import (
    HEADER_BYTES,
    ChunkHeader,
    check_fingerprint,
    is_blank,
    payload_checksum,
)

FP = bytes(range(16))


ZSTD = codec_tag("zstd:level=1:shuffle=1")


def test_round_trip_and_fixed_size() -> None:
    h = ChunkHeader.raw(key(1), FP, 4096, payload_checksum(b"\x01" * 4096))
    assert (h.codec, h.stored, h.coded) == (RAW_TAG, 4096, False)
    raw = h.encode()
    assert len(raw) == HEADER_BYTES
    assert ChunkHeader.decode(raw) == h
    assert ChunkHeader.decode(raw + b"trailing") == h
    short = ChunkHeader.raw(b"k", FP, 0, 0)  # type: ignore[arg-type]
    assert ChunkHeader.decode(short.encode()) == short
    coded = ChunkHeader(key(1), FP, 4096, 7, ZSTD, 1000)
    assert coded.coded and ChunkHeader.decode(coded.encode()) == coded


def test_a_version_1_header_is_a_miss() -> None:
    raw = bytearray(ChunkHeader.raw(key(1), FP, 64, 0).encode())
    raw[8:10] = (1).to_bytes(2, "little")  # the old version number; its own CRC still checks
    raw[124:128] = zlib.crc32(bytes(raw[:124])).to_bytes(4, "little")
    assert ChunkHeader.decode(bytes(raw)) is None


def test_codec_and_stored_length_must_agree() -> None:
    with pytest.raises(InvalidArgumentError, match="stored length"):
        ChunkHeader(key(1), FP, 64, 0, ZSTD, 65)  # stored longer than the chunk
    with pytest.raises(InvalidArgumentError, match="raw chunk stores its 64 bytes"):
        ChunkHeader(key(1), FP, 64, 0, RAW_TAG, 63)
    with pytest.raises(InvalidArgumentError, match="codec tag is 8 bytes"):
        ChunkHeader(key(1), FP, 64, 0, b"zstd", 10)


def test_every_single_bit_flip_is_rejected() -> None:
    raw = bytearray(ChunkHeader(key(2), FP, 123, 0xDEADBEEF, ZSTD, 100).encode())
    covered = HEADER_BYTES  # magic .. codec tag, then the header crc: no padding left
    for byte in range(covered):
        for bit in range(8):
            bad = bytearray(raw)
            bad[byte] ^= 1 << bit
            assert ChunkHeader.decode(bytes(bad)) is None, (byte, bit)


def test_blank_truncated_and_invalid() -> None:
    assert is_blank(bytes(HEADER_BYTES)) and ChunkHeader.decode(bytes(HEADER_BYTES)) is None
    raw = ChunkHeader.raw(key(3), FP, 1, 1).encode()
    assert not is_blank(raw)
    assert ChunkHeader.decode(raw[:50]) is None
    with pytest.raises(InvalidArgumentError):
        ChunkHeader.raw(key(3), b"short", 1, 1)
    with pytest.raises(InvalidArgumentError):
        ChunkHeader.raw(key(3), FP, -1, 1)
    with pytest.raises(InvalidArgumentError):
        ChunkHeader.raw(key(3), FP, 1, 1 << 32)
    with pytest.raises(InvalidArgumentError):
        ChunkHeader.raw(b"", FP, 1, 1)  # type: ignore[arg-type]


def test_a_headers_fault_names_the_first_field_that_disagrees() -> None:
    h = ChunkHeader.raw(key(1), FP, 64, 0)
    other = bytes(16)
    assert [h.fault(key(1), FP, 64), h.fault(None, FP, 64)] == [None, None]
    assert h.fault(key(2), other, 65) == "key"  # key first, then layout, then length
    assert h.fault(None, other, 65) == "layout"
    assert h.fault(key(1), FP, 65) == "length"
    assert check_fingerprint("fp", FP) is FP
    for bad in (FP[:15], bytearray(FP), None):
        with pytest.raises(InvalidArgumentError, match="fp must be a layout fingerprint of 16"):
            check_fingerprint("fp", bad)


def test_payload_checksum_is_zlib_crc32_whatever_the_engine() -> None:
    import os

    from kvplane.offload.tiers.header import CHECKSUM_ENGINE

    assert CHECKSUM_ENGINE in ("isal", "zlib")
    data = os.urandom(100_003)
    assert payload_checksum(data) == zlib.crc32(data)
    assert payload_checksum(memoryview(data)[7:]) == zlib.crc32(data[7:])
