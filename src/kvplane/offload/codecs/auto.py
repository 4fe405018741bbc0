"""``codec = "auto"``: a tier's lossless codec chosen by whether it keeps the tier's GB/s up.

Every lossless codec this environment supports for the tier's chunk format is measured
(:func:`~kvplane.offload.codecs.fit.measure_codec`) on sample chunks and judged by
:func:`~kvplane.offload.codecs.fit.codec_fit` against the tier's measured bandwidth; the one
that keeps both store and load at the tier's GB/s with the most to spare is chosen, else
``raw``. Lossy codecs are never chosen automatically: they change tokens, so they are asked
for by name. Samples default to normal values in the pool's dtype (real KV may compress
differently: pass chunks of it where they exist). Measures at call time; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvplane.errors import ConfigError
from kvplane.offload.codecs.base import ChunkFormat
from kvplane.offload.codecs.coder import ChunkCoder
from kvplane.offload.codecs.fit import CodecFit, codec_fit, measure_codec
from kvplane.offload.codecs.registry import CODECS, make_codec
from kvplane.verdicts import Supported

SAMPLES = 4
"""Sample chunks measured per candidate when none are given."""


@dataclass(frozen=True, slots=True)
class AutoChoice:
    """What ``auto`` chose (``codec``: a name of :data:`CODECS`) and the evidence: one fit per
    lossless candidate measured (empty when none is supported here)."""

    codec: str
    fits: tuple[CodecFit, ...]


def sample_chunks(fmt: ChunkFormat, n: int = SAMPLES, seed: int = 0) -> list[torch.Tensor]:
    """``n`` chunks of ``fmt`` as uint8 bytes holding standard normal values of its dtype."""
    g = torch.Generator().manual_seed(seed)
    count = fmt.nbytes // torch.empty(0, dtype=fmt.dtype).element_size()
    return [torch.randn(count, generator=g).to(fmt.dtype).view(torch.uint8) for _ in range(n)]


def choose(fits: Sequence[CodecFit]) -> str:
    """The codec (``speed.codec``, an ident) of the Supported fit with the highest ``min(store,
    load)`` GB/s, else ``raw`` (pure: the rule :func:`auto_codec` applies to its measurements;
    :func:`codec_name` names an ident)."""
    good = [f for f in fits if isinstance(f.verdict, Supported)]
    if not good:
        return "raw"
    return max(good, key=lambda f: min(f.store_gbps, f.load_gbps)).speed.codec


def auto_codec(
    fmt: ChunkFormat,
    tier_gbps: float,
    samples: Sequence[torch.Tensor] | None = None,
    repeats: int = 1,
) -> AutoChoice:
    """Measure every lossless codec supported for ``fmt`` and choose (:func:`choose`) against
    ``tier_gbps``, the tier's measured raw GB/s (``ConfigError`` unless > 0: without it
    nothing says what keeping up means)."""
    if not tier_gbps > 0:
        raise ConfigError(
            f"codec 'auto' needs the tier's measured GB/s (> 0), got {tier_gbps!r}: run "
            "`kvplane tune chunks --write` or set <tier>_gbps"
        )
    chunks = list(samples) if samples is not None else sample_chunks(fmt)
    fits: list[CodecFit] = []
    for name in CODECS:
        codec = make_codec(name)
        if name == "raw" or not isinstance(codec.check(fmt), Supported):
            continue
        coder = ChunkCoder(codec, fmt)
        if not coder.plan.lossless:
            continue
        fits.append(codec_fit(measure_codec(coder, chunks, repeats), tier_gbps))
    return AutoChoice(codec_name(choose(fits)), tuple(fits))


def codec_name(ident: str) -> str:
    """The registry name of the codec whose ident is ``ident`` (``raw`` for raw)."""
    for name in CODECS:
        if make_codec(name).ident == ident:
            return name
    raise ConfigError(f"no codec has the ident {ident!r}")  # pragma: no cover - idents come from it
