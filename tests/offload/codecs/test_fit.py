"""codec_fit: whether a codec keeps a tier's GB/s up, as data; measure_codec's shape of result."""

from __future__ import annotations

import math

import pytest
import torch
from codecs_testlib import chunk_of

from kvplane.errors import InvalidArgumentError
from kvplane.offload.codecs import (
    ChunkCoder,
    ChunkFormat,
    CodecSpeed,
    codec_fit,
    make_codec,
    measure_codec,
)
from kvplane.verdicts import Supported, Unsupported


def test_a_fast_codec_that_halves_the_bytes_keeps_a_slow_tier_up() -> None:
    # tier 1 GB/s; encode 4 GB/s, ratio 0.5: 1 / (1/4 + 0.5/1) = 1.333 GB/s
    fit = codec_fit(CodecSpeed("fp8", 4.0, 8.0, 0.5), 1.0)
    assert fit.store_gbps == pytest.approx(4 / 3) and fit.load_gbps == pytest.approx(1.6)
    assert fit.verdict == Supported()


def test_a_slow_codec_on_a_fast_tier_is_unsupported_with_reasons() -> None:
    fit = codec_fit(CodecSpeed("zstd", 0.5, 2.0, 0.75), 10.0)
    assert fit.store_gbps == pytest.approx(1 / (2 + 0.075))
    assert isinstance(fit.verdict, Unsupported)
    assert fit.verdict.reasons == (
        "store 0.482 GB/s through zstd < 1 x the tier's 10 GB/s",
        "load 1.74 GB/s through zstd < 1 x the tier's 10 GB/s",
    )
    assert codec_fit(CodecSpeed("zstd", 0.5, 2.0, 0.75), 10.0, min_ratio=0.04).verdict == (
        Supported()
    )


def test_raw_always_keeps_up_and_bad_inputs_are_refused() -> None:
    fit = codec_fit(CodecSpeed("raw", math.inf, math.inf, 1.0), 3.0)
    assert (fit.store_gbps, fit.load_gbps, fit.verdict) == (3.0, 3.0, Supported())
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(InvalidArgumentError):
            codec_fit(CodecSpeed("raw", 1.0, 1.0, 1.0), bad)
    with pytest.raises(InvalidArgumentError):
        CodecSpeed("x", math.nan, 1.0, 0.5)
    with pytest.raises(InvalidArgumentError):
        CodecSpeed("x", 1.0, 1.0, 1.5)


def test_measure_codec_reports_the_stored_ratio_exactly() -> None:
    fmt = ChunkFormat(torch.bfloat16, 2, 2, 2, 8, 2, 16)
    samples = [chunk_of(fmt, i) for i in range(3)]
    fp8 = measure_codec(ChunkCoder(make_codec("fp8-chunk"), fmt), samples, repeats=1)
    assert fp8.codec == "fp8:e4m3fn:scale=chunk"
    assert fp8.stored_ratio == (4 + fmt.numel) / fmt.nbytes
    assert fp8.encode_gbps > 0 and fp8.decode_gbps > 0
    raw = measure_codec(ChunkCoder(make_codec("raw"), fmt), samples)
    assert (raw.encode_gbps, raw.stored_ratio) == (math.inf, 1.0)
    with pytest.raises(InvalidArgumentError):
        measure_codec(ChunkCoder(make_codec("raw"), fmt), [])
