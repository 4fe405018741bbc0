"""The tuned-vs-global rows of ``kvplane bench offload``: per cold tier, store and load GB/s
through a cascade whose tier moves its tuned chunk size against one whose tier moves the single
global (host) size.

Both cascades have the same host chunks (the global size) and pool, so the difference is the
tier's chunk size and the re-chunking that buys it (:mod:`kvplane.offload.rechunk`). A store
is device -> host -> tier (drained); a load evicts the host copies first (untimed), then
promotes tier -> host -> device. Each repeat times both back to back. Sizes come from a
``[tune.chunks]`` table (``--tuned FILE``) or :data:`DEFAULT_TUNED`. See docs/offload.md.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from kvplane.apps.bench.offload_rows import Limit, Measured, Timed, measure, rows, seconds
from kvplane.apps.bench.offload_sweep import fresh_keys, layout
from kvplane.config import load_toml
from kvplane.errors import ConfigError
from kvplane.ids import BlockId, ChunkKey
from kvplane.offload import OffloadConfig, TierCascade, build_cascade
from kvplane.offload.chunk_cost import TunedChunks

BLOCK_BYTES = 16 << 10
DEFAULT_TUNED = TunedChunks(host_blocks_per_chunk=16, disk_blocks_per_chunk=64,
                            remote_blocks_per_chunk=128)  # fmt: skip
"""The sizes of the documented ``kvplane tune chunks --quick`` run (docs/offload.md)."""
RUN_BYTES = {True: 16 << 20, False: 64 << 20}
"""Bytes stored (and loaded) per timed run, per ``--quick``."""
TARGET = 1.3
"""Issue 32: the tuned size moves at least 1.3x the global size's GB/s on disk and Redis."""


def tuned_sizes(path: str | None) -> TunedChunks:
    """The ``[tune.chunks]`` table of the TOML file ``path``, or :data:`DEFAULT_TUNED`."""
    if path is None:
        return DEFAULT_TUNED
    table = load_toml(path).get("tune", {}).get("chunks")
    if not isinstance(table, dict):
        raise ConfigError(f"{path} has no [tune.chunks] table (run `kvplane tune chunks --write`)")
    return TunedChunks(**table)


@contextmanager
def _cascade(
    tier: str, host_bpc: int, tier_bpc: int, n_blocks: int, where: tuple[Path, str | None]
) -> Iterator[tuple[TierCascade, list[BlockId], list[BlockId]]]:
    """A cascade over a pool of ``2 * n_blocks`` 16 KiB blocks: host chunks of ``host_bpc``
    blocks (room for two runs), and ``tier`` alone below it with chunks of ``tier_bpc``."""
    kv = layout(2 * n_blocks)
    pool = torch.randn(kv.shape).to(kv.dtype)
    host_chunks = n_blocks // host_bpc
    tier_chunks = 2 * max(1, n_blocks // tier_bpc)
    folder, url = where
    tag = f"{tier}{tier_bpc}"
    common: dict[str, Any] = {"host_slots": 2 * host_chunks, "admission_min_lookups": 0}
    if tier == "disk":
        cfg = OffloadConfig(**common, disk_path=folder / f"tuned-{tag}.kvc",
                            disk_slots=tier_chunks, disk_blocks_per_chunk=tier_bpc)  # fmt: skip
    else:
        cfg = OffloadConfig(**common, remote_url=url or "", remote_slots=tier_chunks,
                            remote_namespace=f"kvbench{os.getpid()}{tag}", remote_timeout_s=30.0,
                            remote_lease_s=60.0, remote_blocks_per_chunk=tier_bpc)  # fmt: skip
    c = build_cascade(cfg, kv, host_bpc, pool)
    try:
        src = [BlockId(b) for b in range(n_blocks)]
        yield c, src, [BlockId(b) for b in range(n_blocks, 2 * n_blocks)]
        c.check_integrity()
    finally:
        for t, _m in c.lower:
            clear = getattr(t, "clear", None)
            if clear is not None:
                clear()
        c.close()


def _ops(c: TierCascade, src: list[BlockId], dst: list[BlockId], n: int) -> tuple[Timed, Timed]:
    """Timed store of ``n`` fresh host chunks (down to the tier) and timed load of the last
    stored ones from the tier (their host copies evicted first, untimed)."""
    last: list[list[ChunkKey]] = [[]]

    def store() -> float:
        keys = fresh_keys(n)
        last[0] = keys

        def run() -> None:
            if c.store(keys, src) is None:
                raise RuntimeError("bench cascade stored nothing")
            c.drain()

        return seconds(run)

    def load() -> float:
        keys = last[0]
        c.book.host.evict([k for k in keys if c.book.host.is_hit(k)])

        def run() -> None:
            ticket = c.load(keys, dst)
            if ticket is None or ticket.sources != (c.lower[0][0].name,) * n:
                raise RuntimeError("bench cascade did not load every chunk from its tier")
            c.drain()

        return seconds(run)

    return store, load


def tuned_rows(
    quick: bool, disk_dir: Path, redis_url: str | None, tuned: TunedChunks
) -> tuple[list[dict[str, object]], list[dict[str, Any]]]:
    """Per cold tier (Redis given ``redis_url``): store and load rows, tuned against global
    (target :data:`TARGET`), and their summaries."""
    host = tuned.sizes(BLOCK_BYTES, 16)[0]
    sizes = dict(zip(("disk", "remote"), tuned.sizes(BLOCK_BYTES, host)[1:], strict=True))
    n_blocks = RUN_BYTES[quick] // BLOCK_BYTES
    n = n_blocks // host
    out: list[dict[str, object]] = []
    summaries: list[dict[str, Any]] = []
    for tier in ("disk", "remote") if redis_url else ("disk",):
        where = (disk_dir, redis_url)
        with ExitStack() as stack:
            ours = _ops(*stack.enter_context(_cascade(tier, host, sizes[tier], n_blocks, where)), n)
            base = _ops(*stack.enter_context(_cascade(tier, host, host, n_blocks, where)), n)
            name = f"global {host} blocks"
            got = [
                measure((tier, f"{op}_tuned_vs_global", sizes[tier] * BLOCK_BYTES,
                         n_blocks * BLOCK_BYTES), mine, [Limit(name, "", theirs)], quick)
                for op, mine, theirs in (("store", ours[0], base[0]), ("load", ours[1], base[1]))
            ]  # fmt: skip
        out += [row for m in got for row in rows(m, TARGET)]
        summaries += [_summary(m, sizes[tier], host) for m in got]
    return out, summaries


def _summary(m: Measured, tuned: int, host: int) -> dict[str, Any]:
    gb = m.nbytes / 1e9
    ratios = sorted(g / o for o, g in zip(m.ours, m.limits[""], strict=True))
    return {
        "tier": m.tier, "op": m.op.split("_")[0], "tuned_blocks": tuned, "global_blocks": host,
        "tuned_gbps": round(gb / statistics.median(m.ours), 3),
        "global_gbps": round(gb / statistics.median(m.limits[""]), 3),
        "ratio_min": round(ratios[0], 3), "ratio_median": round(statistics.median(ratios), 3),
        "ratio_max": round(ratios[-1], 3), "target": TARGET,
    }  # fmt: skip
