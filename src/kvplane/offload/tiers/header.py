"""The stored-chunk header: key, layout fingerprint, length, codec, stored length and CRC-32 of
a chunk kept outside the process.

:data:`HEADER_BYTES` = 128, written after its payload. Byte layout: docs/offload.md.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.offload.codecs.base import RAW_TAG, TAG_BYTES
from kvplane.offload.slots import MAX_KEY_BYTES, check_chunk_key
from kvplane.validators import require_int, require_size

MAGIC = b"KVPCHUNK"
VERSION = 2
"""2 added the codec tag and stored length; a header of version 1 decodes to None (a miss)."""
FINGERPRINT_BYTES = 16
HEADER_BYTES = 128
_BODY = struct.Struct(f"<8sHHIQI{FINGERPRINT_BYTES}s{MAX_KEY_BYTES}sQ{TAG_BYTES}s")
_CRC = struct.Struct("<I")


def _crc32_engine() -> tuple[str, Callable[[memoryview | bytes], int]]:
    """ISA-L's CRC-32 (PCLMUL, ~10x zlib's speed, identical results) when ``isal`` is
    installed, else zlib's; chunks written with either verify with either."""
    try:
        from isal import isal_zlib
    except ImportError:
        return "zlib", zlib.crc32
    return "isal", isal_zlib.crc32


CHECKSUM_ENGINE, _CRC32 = _crc32_engine()
"""Which CRC-32 implementation this process uses (``"isal"`` or ``"zlib"``)."""


def payload_checksum(payload: memoryview | bytes) -> int:
    """The checksum stored in a header: CRC-32 (zlib polynomial) of the payload bytes."""
    return int(_CRC32(payload))


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """Identity and integrity of one stored chunk: ``length`` bytes of chunk, stored as
    ``stored`` bytes coded by the codec ``codec`` names (:data:`RAW_TAG`: the chunk's own
    bytes, then ``stored == length``); ``checksum`` is the CRC-32 of the stored bytes."""

    key: ChunkKey
    fingerprint: bytes
    length: int
    checksum: int
    codec: bytes
    stored: int

    def __post_init__(self) -> None:
        check_chunk_key(self.key)
        check_fingerprint("ChunkHeader.fingerprint", self.fingerprint)
        require_size("chunk length", self.length)
        require_int("checksum", self.checksum, min=0, max=(1 << 32) - 1)
        if not isinstance(self.codec, bytes) or len(self.codec) != TAG_BYTES:
            raise InvalidArgumentError(f"a codec tag is {TAG_BYTES} bytes, got {self.codec!r}")
        require_size("stored length", self.stored, max=self.length)
        if self.codec == RAW_TAG and self.stored != self.length:
            raise InvalidArgumentError(
                f"a raw chunk stores its {self.length} bytes, not {self.stored}"
            )

    @classmethod
    def raw(cls, key: ChunkKey, fingerprint: bytes, length: int, checksum: int) -> ChunkHeader:
        """The header of a chunk stored as its own ``length`` bytes."""
        return cls(key, fingerprint, length, checksum, RAW_TAG, length)

    @property
    def coded(self) -> bool:
        """True when the stored bytes are a codec's payload, not the chunk itself."""
        return self.codec != RAW_TAG

    def fault(self, key: ChunkKey | None, fingerprint: bytes, length: int) -> str | None:
        """Why this header read back is not that of chunk ``key`` (``None``: any key) of
        ``length`` bytes under layout ``fingerprint``: the corrupt-chunk reason ``"key"``,
        ``"layout"`` or ``"length"``; ``None`` when it is."""
        if key is not None and self.key != key:
            return "key"
        if self.fingerprint != fingerprint:
            return "layout"
        return "length" if self.length != length else None

    def encode(self) -> bytes:
        """The :data:`HEADER_BYTES` bytes that go after (or beside) the payload."""
        body = _BODY.pack(
            MAGIC, VERSION, len(self.key), 0, self.length, self.checksum,
            self.fingerprint, self.key, self.stored, self.codec,
        )  # fmt: skip
        raw = body + _CRC.pack(zlib.crc32(body))
        return raw + bytes(HEADER_BYTES - len(raw))

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> ChunkHeader | None:
        """The header in ``raw`` (at least :data:`HEADER_BYTES` bytes), or ``None`` if ``raw``
        is blank, truncated, of another version, fails its own CRC or is inconsistent."""
        raw = bytes(raw[:HEADER_BYTES])
        if len(raw) < _BODY.size + _CRC.size:
            return None
        body = raw[: _BODY.size]
        (hcrc,) = _CRC.unpack_from(raw, _BODY.size)
        if zlib.crc32(body) != hcrc:
            return None
        magic, version, key_len, _flags, length, checksum, fp, key, stored, codec = _BODY.unpack(
            body
        )
        if magic != MAGIC or version != VERSION or not 0 < key_len <= MAX_KEY_BYTES:
            return None
        if stored > length or (codec == RAW_TAG and stored != length):
            return None
        return cls(ChunkKey(key[:key_len]), fp, length, checksum, codec, stored)


def verify_header(
    raw: bytes | memoryview, key: ChunkKey | None, fingerprint: bytes, length: int
) -> ChunkHeader | str:
    """The header read back in ``raw`` if it is chunk ``key``'s (``None``: any key) under
    ``fingerprint`` and ``length``; else the corrupt-chunk reason (``"header"`` or a fault's)."""
    header = ChunkHeader.decode(raw) if len(raw) == HEADER_BYTES else None
    if header is None:
        return "header"
    return header.fault(key, fingerprint, length) or header


def check_fingerprint(what: str, value: object) -> bytes:
    """``value`` when it is a layout fingerprint (:data:`FINGERPRINT_BYTES` bytes), else
    ``InvalidArgumentError`` naming ``what``."""
    if not isinstance(value, bytes) or len(value) != FINGERPRINT_BYTES:
        raise InvalidArgumentError(
            f"{what} must be a layout fingerprint of {FINGERPRINT_BYTES} bytes, got {value!r}"
        )
    return value


def is_blank(raw: bytes | memoryview) -> bool:
    """True when a header area was never written (all zero): an empty slot, not corruption."""
    return not any(bytes(raw[:HEADER_BYTES]))
