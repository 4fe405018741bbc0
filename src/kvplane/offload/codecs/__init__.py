"""Chunk codecs for the cold tiers: raw, lossless zstd/lz4, lossy fp8/int8, behind one
contract (``check``/``plan``/``encode``/``decode``), the tier-bound coder and the keep-up check.
See docs/offload.md ("Codecs")."""

from kvplane.offload.codecs.base import RAW_TAG, ChunkCodec, ChunkFormat, CodecPlan
from kvplane.offload.codecs.coder import ChunkCoder, Encoded
from kvplane.offload.codecs.fit import CodecFit, CodecSpeed, codec_fit, measure_codec
from kvplane.offload.codecs.fp8 import FP8Codec
from kvplane.offload.codecs.int8 import Int8Codec
from kvplane.offload.codecs.lossless import LZ4Codec, ZstdCodec
from kvplane.offload.codecs.raw import RawCodec
from kvplane.offload.codecs.registry import CODECS, check_codec_name, make_codec
from kvplane.verdicts import Supported, Unsupported, Verdict

__all__ = [
    "CODECS",
    "RAW_TAG",
    "ChunkCodec",
    "ChunkCoder",
    "ChunkFormat",
    "CodecFit",
    "CodecPlan",
    "CodecSpeed",
    "Encoded",
    "FP8Codec",
    "Int8Codec",
    "LZ4Codec",
    "RawCodec",
    "Supported",
    "Unsupported",
    "Verdict",
    "ZstdCodec",
    "check_codec_name",
    "codec_fit",
    "make_codec",
    "measure_codec",
]
