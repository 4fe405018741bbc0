"""Whether a codec keeps a tier's effective GB/s up: measured codec speed against tier bandwidth.

A store of ``B`` raw bytes through a codec costs ``B / encode + ratio * B / tier`` seconds
(encode, then move the stored bytes), a load ``ratio * B / tier + B / decode``; the raw tier
costs ``B / tier``. :func:`codec_fit` answers, as data, whether both coded rates reach
``min_ratio`` of the raw one; :func:`measure_codec` measures a codec on sample chunks.
Serial costs: a tier that overlaps coding with I/O does at least this well.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvplane.errors import InvalidArgumentError
from kvplane.offload.codecs.coder import ChunkCoder
from kvplane.validators import is_number, require_int, require_number, require_probability
from kvplane.verdicts import Verdict, verdict


@dataclass(frozen=True, slots=True)
class CodecSpeed:
    """One codec measured on sample chunks: raw-byte GB/s of ``encode`` and ``decode`` (``inf``
    for raw) and ``stored_ratio``, stored bytes over raw bytes (at most 1: raw fallback)."""

    codec: str
    encode_gbps: float
    decode_gbps: float
    stored_ratio: float

    def __post_init__(self) -> None:
        for name in ("encode_gbps", "decode_gbps"):
            value = getattr(self, name)
            if not (is_number(value) and value > 0):  # inf allowed (raw), NaN refused
                raise InvalidArgumentError(f"CodecSpeed.{name} must be > 0, got {value!r}")
        require_probability("CodecSpeed.stored_ratio", self.stored_ratio)


@dataclass(frozen=True, slots=True)
class CodecFit:
    """The effective store and load GB/s of a tier of ``tier_gbps`` through a codec, and the
    verdict: Supported when both reach ``min_ratio * tier_gbps``."""

    speed: CodecSpeed
    tier_gbps: float
    store_gbps: float
    load_gbps: float
    verdict: Verdict


def _through(codec_gbps: float, ratio: float, tier_gbps: float) -> float:
    """Raw-byte GB/s of coding at ``codec_gbps`` then moving ``ratio`` of the bytes."""
    return 1.0 / (1.0 / codec_gbps + ratio / tier_gbps)


def codec_fit(speed: CodecSpeed, tier_gbps: float, *, min_ratio: float = 1.0) -> CodecFit:
    """See the module docstring. ``tier_gbps`` is the tier's configured or measured raw
    bandwidth (finite, > 0); ``min_ratio`` in [0, 1] relaxes "keeps up" to "keeps that much"."""
    tier = require_number("tier_gbps", tier_gbps, above=0.0)
    floor = require_probability("min_ratio", min_ratio)
    store = _through(speed.encode_gbps, speed.stored_ratio, tier)
    load = _through(speed.decode_gbps, speed.stored_ratio, tier)
    reasons = [
        f"{op} {got:.3g} GB/s through {speed.codec} < {floor:g} x the tier's {tier:.3g} GB/s"
        for op, got in (("store", store), ("load", load))
        if got < floor * tier * (1 - 1e-12)
    ]
    return CodecFit(speed, tier, store, load, verdict(reasons))


def measure_codec(
    coder: ChunkCoder, samples: Sequence[torch.Tensor], repeats: int = 3
) -> CodecSpeed:
    """Median encode and decode GB/s of ``coder`` over ``repeats`` passes of ``samples``
    (chunks of its format) and their stored ratio; raw's rates are ``inf``."""
    require_int("repeats", repeats, min=1)
    if not samples:
        raise InvalidArgumentError("measure_codec needs at least one sample chunk")
    nbytes = coder.chunk_bytes * len(samples)
    out = torch.empty(coder.chunk_bytes, dtype=torch.uint8)
    enc_s: list[float] = []
    dec_s: list[float] = []
    stored = 0
    for _ in range(repeats):
        start = time.perf_counter()
        encoded = [coder.encode(s) for s in samples]
        mid = time.perf_counter()
        for e in encoded:
            if not coder.decode(e.tag, e.data, out):
                raise InvalidArgumentError(f"codec {coder.plan.ident} failed its own round trip")
        enc_s.append(mid - start)
        dec_s.append(time.perf_counter() - mid)
        stored = sum(len(e.data) for e in encoded)
    if coder.is_raw:
        return CodecSpeed(coder.plan.ident, math.inf, math.inf, 1.0)
    return CodecSpeed(
        coder.plan.ident,
        nbytes / max(statistics.median(enc_s), 1e-9) / 1e9,
        nbytes / max(statistics.median(dec_s), 1e-9) / 1e9,
        stored / nbytes,
    )
