"""The codec rows of ``kvplane bench offload``: per codec and cold tier, store and load GB/s
through the coded tier against the same tier raw, and the stored bytes ratio.

Every repeat times the coded tier and a raw twin (same kind, size and data) back to back, so
the ratio is effective GB/s (raw bytes per second) against raw. The chunks are bf16 KV-like
values (normal, like activations). The codec's own speed and :func:`~kvplane.offload.codecs.
codec_fit` against the raw tier's measured GB/s go in the result, and per tier what ``codec =
"auto"`` would choose from those fits (:func:`~kvplane.offload.codecs.auto.choose`). See
docs/offload.md ("Codecs").
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvplane.apps.bench.offload_rows import (
    BENCH,
    KeyedOp,
    Limit,
    Timed,
    measure,
    rows,
    seconds,
    tier_ops,
)
from kvplane.apps.bench.offload_sweep import fresh_keys, layout
from kvplane.ids import ChunkKey, SlotId
from kvplane.offload import AdmissionFilter, OffloadManager
from kvplane.offload.codecs import (
    CODECS,
    ChunkCoder,
    ChunkFormat,
    CodecFit,
    codec_fit,
    make_codec,
    measure_codec,
)
from kvplane.offload.codecs.auto import choose, codec_name
from kvplane.offload.tiers import DiskTier, HostTier, RemoteTier, Tier
from kvplane.verdicts import Supported

CODEC_CHUNK = 1 << 20
"""Chunk size of the codec rows (64 blocks of 16 KiB)."""
CODEC_CHUNKS = {True: 8, False: 32}
"""Chunks per timed run, per ``--quick``."""
STORED_TARGETS = {"fp8": 0.55, "fp8-chunk": 0.55}
"""Issue 32: FP8 stores at most 0.55x the raw bytes."""

Opener = Callable[[str, ChunkCoder | None], Tier]
"""Opens a fresh tier of one kind: ``(name suffix, coder)``."""


def _kv_buffers(n: int, chunk: int) -> list[torch.Tensor]:
    host = HostTier(n, chunk)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(host.buffer.numel() // 2, generator=g).to(torch.bfloat16)
    host.buffer.copy_(values.view(torch.uint8))
    return [host.slot(SlotId(i)) for i in range(n)]


def _fresh(store: KeyedOp, n: int) -> Timed:
    """Seconds of a store of ``n`` keys no tier holds yet."""

    def run() -> float:
        keys = fresh_keys(n)
        return seconds(lambda: store(keys))

    return run


def _same(load: KeyedOp, keys: list[ChunkKey]) -> Timed:
    """Seconds of a load of ``keys``."""
    return lambda: seconds(lambda: load(keys))


@contextmanager
def _opened(open_tier: Opener, suffix: str, coder: ChunkCoder | None) -> Iterator[Tier]:
    tier = open_tier(suffix, coder)
    try:
        yield tier
    finally:
        if isinstance(tier, RemoteTier):
            tier.clear()
        tier.close()


def _codec_vs_raw(
    kind: str, open_tier: Opener, codec: str, bufs: list[torch.Tensor], quick: bool
) -> tuple[list[dict[str, object]], dict[str, Any], CodecFit | None]:
    """Rows of one codec on one tier kind, its summary entry, and its fit when lossless."""
    n, chunk = len(bufs), bufs[0].numel()
    coder = ChunkCoder(make_codec(codec), ChunkFormat.of(layout(1), chunk))
    with _opened(open_tier, f"c-{codec}", coder) as ours, _opened(open_tier, "c-raw", None) as raw:
        (store, load), (raw_store, raw_load) = (
            tier_ops(t, OffloadManager(t.name, n, "lru", AdmissionFilter(0)), bufs)
            for t in (ours, raw)
        )
        name, nbytes = f"{kind} tier, raw", n * chunk
        got = [
            measure((kind, f"store_{codec}", chunk, nbytes), _fresh(store, n),
                    [Limit(name, "", _fresh(raw_store, n))], quick)
        ]  # fmt: skip
        keys, raw_keys = fresh_keys(n), fresh_keys(n)
        store(keys)
        raw_store(raw_keys)
        got.append(
            measure((kind, f"load_{codec}", chunk, nbytes), _same(load, keys),
                    [Limit(name, "", _same(raw_load, raw_keys))], quick)
        )  # fmt: skip
    raw_gbps = n * chunk / statistics.median(got[0].limits[""]) / 1e9
    speed = measure_codec(coder, bufs[: min(4, n)], repeats=1 if quick else 3)
    fit = codec_fit(speed, raw_gbps)
    summary = {
        "tier": kind, "codec": speed.codec, "stored_ratio": round(speed.stored_ratio, 4),
        "encode_gbps": round(speed.encode_gbps, 3), "decode_gbps": round(speed.decode_gbps, 3),
        "raw_tier_store_gbps": round(raw_gbps, 3),
        "keeps_up": isinstance(fit.verdict, Supported),
        "fit_reasons": [] if isinstance(fit.verdict, Supported) else list(fit.verdict.reasons),
    }  # fmt: skip
    lossless = fit if coder.plan.lossless else None
    return [row for m in got for row in rows(m, None)], summary, lossless


def stored_row(codec: str, ratio: float) -> dict[str, object]:
    """The stored bytes row of ``codec``: stored / raw bytes, lower is better, exact (one
    deterministic figure, no spread)."""
    target = STORED_TARGETS.get(codec)
    return {
        "bench": BENCH, "row": f"stored_ratio_{codec}", "figure": round(ratio, 4),
        "unit": "x raw bytes", "limit": 1.0, "limit_name": "raw bytes", "repeats": 1,
        "ratio_min": round(ratio, 4), "ratio_median": round(ratio, 4), "ratio_max": round(ratio, 4),
        "stable": True, "target": target, "met": None if target is None else ratio <= target,
    }  # fmt: skip


def codec_rows(
    quick: bool, disk_dir: Path, redis_url: str | None
) -> tuple[list[dict[str, object]], list[dict[str, Any]], dict[str, str]]:
    """Every codec but raw on the disk tier (in ``disk_dir``) and, given ``redis_url``, the
    Redis tier: its ``bench all`` rows, summaries, and per tier the codec ``auto`` chooses
    from the lossless codecs' fits there."""
    n = CODEC_CHUNKS[quick]
    bufs = _kv_buffers(n, CODEC_CHUNK)
    fp = layout(1).fingerprint()
    kinds: dict[str, Opener] = {
        "disk": lambda suffix, coder: DiskTier(disk_dir / f"bench-{suffix}.kvc", n, CODEC_CHUNK,
                                               fp, coder=coder),
    }  # fmt: skip
    if redis_url is not None:
        ns = f"kvbench{os.getpid()}"
        kinds["remote"] = lambda suffix, coder: RemoteTier(
            redis_url, n, CODEC_CHUNK, fp, namespace=f"{ns}{suffix}", timeout_s=30.0, coder=coder
        )
    out: list[dict[str, object]] = []
    summaries: list[dict[str, Any]] = []
    fits: dict[str, list[CodecFit]] = {kind: [] for kind in kinds}
    for codec in (c for c in CODECS if c != "raw"):
        for kind, opener in kinds.items():
            got, summary, fit = _codec_vs_raw(kind, opener, codec, bufs, quick)
            out += got
            summaries.append(summary)
            fits[kind] += [] if fit is None else [fit]
        out.append(stored_row(codec, summaries[-1]["stored_ratio"]))
    return out, summaries, {kind: codec_name(choose(f)) for kind, f in fits.items()}
