"""``kvplane bench offload``: store/load throughput per tier against its limit, the
``blocks_per_chunk`` sweep, per cold tier its tuned chunk size against the global one
(:mod:`.offload_tuned`), per codec its GB/s against the raw tier and stored bytes
(:mod:`.offload_codecs`), and the shared store against the private remote tier
(:mod:`.offload_shared`).

Host against memcpy (and a streaming memcpy), disk against raw ``pwrite``/``preadv``, remote
against ``redis-benchmark`` on the same server (and redis-py's own pipeline as a second row);
each repeat times every side back to back (:mod:`.offload_rows`). Starts its own
``redis-server`` when none is given. Limits, estimator and targets: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from kvplane.apps.bench.common import stream_memcpy
from kvplane.apps.bench.offload_codecs import codec_rows
from kvplane.apps.bench.offload_rows import (
    BENCH,
    KeyedOp,
    Limit,
    Measured,
    Timed,
    cascade_ops,
    measure,
    rows,
    seconds,
    throughput_row,
    tier_ops,
)
from kvplane.apps.bench.offload_shared import SHARED_CHUNK, shared_rows
from kvplane.apps.bench.offload_sweep import SWEEP_BLOCKS, SWEEP_TARGET, fresh_keys, layout, sweep
from kvplane.apps.bench.offload_tuned import tuned_rows, tuned_sizes
from kvplane.apps.bench.redis_limit import BENCH_KEY, fastest, redis_benchmark_support
from kvplane.ids import BlockId, SlotId
from kvplane.offload import (
    AdmissionFilter,
    OffloadConfig,
    OffloadManager,
    build_cascade,
)
from kvplane.offload.tiers import ALIGN, DiskTier, HostTier, RemoteTier, SyncPolicy
from kvplane.offload.tiers.base import as_buffer
from kvplane.offload.tiers.remote import pipeline_groups, redis_support
from kvplane.testing.redis_server import LocalRedisServer, redis_server_support

NAME = BENCH
HELP = (
    "Offload tiers: store/load GB/s per tier vs memcpy, raw file I/O and redis-benchmark; "
    "codecs vs raw."
)

BLOCK_BYTES = 16 << 10
CHUNK_SIZES = (256 << 10, 4 << 20)
CHUNKS_PER_REPEAT = {True: (64, 16), False: (128, 32)}
"""Chunks moved per timed run, per entry of ``CHUNK_SIZES``, for ``--quick`` and full runs."""
TARGETS = {"host": 0.8, "disk": 0.7, "remote": 0.8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None, help="use this Redis server (redis://...)")
    parser.add_argument("--disk-dir", default=None, help="directory for the disk tier's file")
    parser.add_argument("--sync", choices=[p.value for p in SyncPolicy], default="none")
    parser.add_argument("--no-direct-io", action="store_true", help="buffered disk I/O")
    parser.add_argument(
        "--tuned", default=None, metavar="CONFIG.toml",
        help="chunk sizes of the tuned-vs-global rows from its [tune.chunks] (default: documented)",
    )  # fmt: skip


def _each(n: int, op: Callable[[int], object]) -> None:
    for i in range(n):
        op(i)


def _wall(fn: Callable[[], object]) -> Timed:
    return lambda: seconds(fn)


def _store_load(
    where: tuple[str, int, int],
    quick: bool,
    ours: tuple[KeyedOp, KeyedOp],
    limits: tuple[list[Limit], list[Limit]],
    *,
    unavailable: str | None = None,
) -> list[Measured]:
    """Store (fresh keys every repeat) then load (``n`` chunks stored once, loaded every
    repeat) of ``where = (tier, chunk_bytes, n)``, each against its limits, ``n * chunk``
    bytes per run (:func:`.offload_rows.measure`)."""
    tier, chunk, n = where
    store, load = ours

    def fresh_store() -> float:
        keys = fresh_keys(n)
        return seconds(lambda: store(keys))

    got = [measure((tier, "store", chunk, n * chunk), fresh_store, limits[0], quick,
                   unavailable=unavailable)]  # fmt: skip
    keys = fresh_keys(n)
    store(keys)
    got.append(measure((tier, "load", chunk, n * chunk), _wall(lambda: load(keys)), limits[1],
                       quick, unavailable=unavailable))  # fmt: skip
    return got


# -- host: the cascade path between a (CPU) device pool and host slots ----------------------------
def _host(chunk: int, n: int, quick: bool) -> list[Measured]:
    bpc = chunk // BLOCK_BYTES
    kv = layout(2 * n * bpc)
    pool = torch.randn(kv.shape).to(kv.dtype)
    c = build_cascade(OffloadConfig(host_slots=n, admission_min_lookups=0), kv, bpc, pool)
    src = [BlockId(b) for b in range(n * bpc)]
    dst = [BlockId(b) for b in range(n * bpc, 2 * n * bpc)]
    pool_chunks = pool.view(2 * n, chunk // pool.element_size())
    host_chunks = c.host.buffer.view(n, chunk).view(pool.dtype)
    limits: tuple[list[Limit], list[Limit]] = (
        [Limit("memcpy (torch copy_)", "", _wall(lambda: host_chunks.copy_(pool_chunks[:n])))],
        [Limit("memcpy (torch copy_)", "", _wall(lambda: pool_chunks[n:].copy_(host_chunks)))],
    )
    streams = (
        stream_memcpy(pool_chunks[:n], host_chunks),
        stream_memcpy(host_chunks, pool_chunks[n:]),
    )
    for side, fn in zip(limits, streams, strict=True):
        if fn is not None:
            side.append(Limit("streaming memcpy", "stream", _wall(fn)))
    got = _store_load(("host", chunk, n), quick, cascade_ops(c, src, dst), limits)
    c.check_integrity()
    c.close()
    return got


# -- disk and remote: one manager + tier, between host slots and the tier ---------------------
def _host_buffers(n: int, chunk: int) -> tuple[list[torch.Tensor], list[memoryview]]:
    host = HostTier(n, chunk)
    host.buffer.copy_(torch.randint(0, 256, (host.buffer.numel(),), dtype=torch.uint8))
    bufs = [host.slot(SlotId(i)) for i in range(n)]
    return bufs, [as_buffer(b) for b in bufs]


def _disk(
    chunk: int, n: int, quick: bool, where: Path, *, sync: SyncPolicy, direct: bool
) -> tuple[list[Measured], bool]:
    slots_path, raw_path = where / "bench-slots.kvc", where / "bench-raw.bin"
    tier = DiskTier(slots_path, n, chunk, layout(1).fingerprint(), sync=sync, direct_io=direct)
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if tier.direct else 0), 0o600)
    os.ftruncate(fd, n * chunk)
    bufs, views = _host_buffers(n, chunk)

    def raw_write(i: int) -> None:
        os.pwrite(fd, views[i], i * chunk)
        if sync is SyncPolicy.DATA:
            os.fdatasync(fd)

    mgr = OffloadManager("disk", n, "lru", AdmissionFilter(0))
    try:
        ops = tier_ops(tier, mgr, bufs)
        raw = (
            [Limit("raw pwrite", "", _wall(lambda: _each(n, raw_write)))],
            [Limit("raw preadv", "", _wall(
                lambda: _each(n, lambda i: os.preadv(fd, [views[i]], i * chunk))))],
        )  # fmt: skip
        got = _store_load(("disk", chunk, n), quick, ops, raw)
        mgr.check_integrity()
        return got, tier.direct
    finally:
        tier.close()
        os.close(fd)
        slots_path.unlink(missing_ok=True)
        raw_path.unlink(missing_ok=True)


def _remote(chunk: int, n: int, quick: bool, url: str) -> list[Measured]:
    """The remote tier against ``redis-benchmark`` (same server and value size, one
    connection, its fastest pipeline depth: :func:`.redis_limit.fastest`; the main limit,
    unavailable without the binary) and redis-py's own pipeline in the tier's groups."""
    import redis

    ns = f"kvbench{os.getpid()}"
    tier = RemoteTier(url, n, chunk, layout(1).fingerprint(), namespace=ns, timeout_s=30.0)
    client = redis.Redis.from_url(url, socket_timeout=30.0)
    bufs, views = _host_buffers(n, chunk)
    names = [f"{ns}:raw:{i}" for i in range(n)]
    groups = pipeline_groups(n, chunk)  # the tier's own groups: one round trip each

    def raw_store() -> None:
        for group in groups:
            pipe = client.pipeline(transaction=False)
            for i in group:
                pipe.set(names[i], views[i])
            pipe.execute()

    def raw_load() -> None:
        for group in groups:
            pipe = client.pipeline(transaction=False)
            for i in group:
                pipe.get(names[i])
            for i, got in zip(group, pipe.execute(), strict=True):
                views[i][:] = cast(bytes, got)

    limits: tuple[list[Limit], list[Limit]] = (
        [Limit("redis-py pipeline", "redis_py", _wall(raw_store))],
        [Limit("redis-py pipeline", "redis_py", _wall(raw_load))],
    )
    why = redis_benchmark_support()
    if why is None:
        rb = fastest(url, chunk, n, len(groups[0]))
        limits[0].insert(0, Limit(rb["SET"].name, "", lambda: rb["SET"].seconds("SET")))
        limits[1].insert(0, Limit(rb["GET"].name, "", lambda: rb["GET"].seconds("GET")))
    mgr = OffloadManager("remote", n, "lru", AdmissionFilter(0))
    try:
        ops = tier_ops(tier, mgr, bufs)
        got = _store_load(("remote", chunk, n), quick, ops, limits, unavailable=why)
        mgr.check_integrity()
        return got
    finally:
        tier.clear()
        client.delete(*names, BENCH_KEY)
        client.close()
        tier.close()


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    sync = SyncPolicy(getattr(args, "sync", "none"))
    direct = not getattr(args, "no_direct_io", False)
    got: list[Measured] = []
    skipped: list[str] = []
    counts = dict(zip(CHUNK_SIZES, CHUNKS_PER_REPEAT[quick], strict=True))
    for chunk in CHUNK_SIZES:
        got += _host(chunk, counts[chunk], quick)
    disk_dir = getattr(args, "disk_dir", None)
    codec_lines: list[dict[str, object]] = []
    shared_lines: list[dict[str, object]] = []
    shared_sum: list[dict[str, Any]] = []
    codecs: list[dict[str, Any]] = []
    auto: dict[str, str] = {}
    tuned = tuned_sizes(getattr(args, "tuned", None))
    with tempfile.TemporaryDirectory(dir=disk_dir, prefix="kvplane-bench-") as tmp:
        direct_used = False
        for chunk in CHUNK_SIZES:
            disk, direct_used = _disk(
                chunk, counts[chunk], quick, Path(tmp), sync=sync, direct=direct
            )
            got += disk
        url = getattr(args, "redis_url", None) or os.environ.get("KVPLANE_OFFLOAD_REMOTE_URL")
        reason = redis_support() if url else redis_server_support()
        if reason is not None:
            skipped.append(f"remote: {reason}")
            tuned_lines, tuned_sum = tuned_rows(quick, Path(tmp), None, tuned)
            codec_lines, codecs, auto = codec_rows(quick, Path(tmp), None)
        elif url:
            for chunk in CHUNK_SIZES:
                got += _remote(chunk, counts[chunk], quick, url)
            tuned_lines, tuned_sum = tuned_rows(quick, Path(tmp), url, tuned)
            codec_lines, codecs, auto = codec_rows(quick, Path(tmp), url)
            shared_lines, shared_sum = shared_rows(quick, url)
        else:
            with LocalRedisServer() as server:  # our own server on 127.0.0.1, stopped at the end
                for chunk in CHUNK_SIZES:
                    got += _remote(chunk, counts[chunk], quick, server.url)
                tuned_lines, tuned_sum = tuned_rows(quick, Path(tmp), server.url, tuned)
                codec_lines, codecs, auto = codec_rows(quick, Path(tmp), server.url)
                shared_lines, shared_sum = shared_rows(quick, server.url)
    swept, sweep_row = sweep(SWEEP_BLOCKS[quick], quick)
    throughput = [throughput_row(m) for m in got]
    per_block = {s["blocks_per_chunk"]: s["us_per_block"] for s in swept}
    sweep_ratio = per_block[16] / per_block[1] if per_block[1] else 0.0
    met = {
        f"{r['tier']}_{r['op']}_{r['chunk_bytes']}": r["ratio"] is not None
        and r["ratio"] >= TARGETS[r["tier"]]
        for r in throughput
    }
    met["sweep_16_vs_1"] = sweep_ratio <= SWEEP_TARGET
    summary = {
        f"{r['tier']} {r['op']} {r['chunk_bytes'] >> 10} KiB": _summary(r) for r in throughput
    }
    summary |= {
        f"{s['blocks_per_chunk']} blocks/chunk": (
            f"{s['us_per_block']:.2f} us/block per op, {s['us_per_block_one_call']:.2f} in one call"
        )
        for s in swept
    }
    summary |= {
        f"shared {s['op']} {SHARED_CHUNK >> 10} KiB": (
            f"{s['gbps']:.2f} GB/s, {s['ratio_median']:.2f} of the private tier"
        )
        for s in shared_sum
    }
    return {
        "rows": [row for m in got for row in rows(m, TARGETS[m.tier])]
        + [sweep_row]
        + tuned_lines
        + codec_lines
        + shared_lines,
        "tuned_vs_global": tuned_sum,
        "shared_store": shared_sum,
        "codecs": codecs,
        "codec_auto": auto,
        "throughput": throughput,
        "blocks_per_chunk_sweep": swept,
        "sweep_ratio_16_vs_1": round(sweep_ratio, 3),
        "targets": TARGETS,
        "targets_met": met,
        "disk": {"sync": sync.value, "direct_io": direct_used, "align": ALIGN},
        "remote_server": "configured" if url else "private redis-server",
        "remote_limit": "redis-benchmark (-c 1, the tier's value size, its fastest -P)"
        if redis_benchmark_support() is None
        else f"unavailable: {redis_benchmark_support()}",
        "skipped": skipped,
        **summary,
    }


def _summary(r: dict[str, Any]) -> str:
    """One throughput row in words: ours / limit = ratio, and the second limits' ratios."""
    main = (
        f"{r['gbps']:.2f} / {r['limit_gbps']:.2f} GB/s = {r['ratio']:.2f}"
        if r["ratio"] is not None
        else f"{r['gbps']:.2f} GB/s; limit {r['limit_unavailable']}"
    )
    second = [
        f"{r[k]:.2f} of {label}"
        for k, label in (("stream_ratio", "a streaming memcpy"), ("redis_py_ratio", "redis-py"))
        if k in r
    ]
    return "; ".join([f"{main} (target {TARGETS[r['tier']]})", *second])
