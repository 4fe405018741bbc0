"""The codec registry: the names a tier's ``codec`` setting may take, and building codecs.

Order is the order of ``kvplane bench offload``'s codec rows. Building never imports an
optional engine: a codec whose engine is missing says so in its ``check``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvplane.errors import ConfigError
from kvplane.offload.codecs.base import ChunkCodec
from kvplane.offload.codecs.fp8 import FP8Codec
from kvplane.offload.codecs.int8 import Int8Codec
from kvplane.offload.codecs.lossless import LZ4Codec, ZstdCodec
from kvplane.offload.codecs.raw import RawCodec

CODECS: dict[str, Callable[[], ChunkCodec]] = {
    "raw": RawCodec,
    "lz4": LZ4Codec,
    "zstd": ZstdCodec,
    "fp8": FP8Codec,
    "fp8-chunk": lambda: FP8Codec("chunk", rotate=False),
    "int8": Int8Codec,
}
"""Every codec name: ``raw`` (the default), lossless ``lz4`` and ``zstd`` (level 1, byte
planes), lossy ``fp8`` (Hadamard-rotated head vectors, per-channel scales), ``fp8-chunk`` (one
scale, no rotation) and ``int8``."""


AUTO = "auto"
"""The tier setting that chooses a lossless codec by measurement (:mod:`.auto`)."""


def check_codec_setting(what: str, name: object) -> str:
    """``name`` when it names a codec or is :data:`AUTO`, else ``ConfigError``."""
    if name == AUTO:
        return AUTO
    if not isinstance(name, str) or name not in CODECS:
        raise ConfigError(f"{what} {name!r} is not one of {[*CODECS, AUTO]}")
    return name


def check_codec_name(what: str, name: object) -> str:
    """``name`` when it names a codec, else ``ConfigError`` naming ``what`` and the choices."""
    if not isinstance(name, str) or name not in CODECS:
        raise ConfigError(f"{what} {name!r} is not one of {list(CODECS)}")
    return name


def make_codec(name: str) -> ChunkCodec:
    """The codec called ``name`` with its default parameters (``ConfigError`` if unknown)."""
    return CODECS[check_codec_name("codec", name)]()
