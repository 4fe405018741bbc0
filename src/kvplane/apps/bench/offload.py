"""``kvplane bench offload``: store/load throughput per tier against its limit, and the
``blocks_per_chunk`` sweep.

Host against memcpy (and a streaming memcpy), disk against raw ``pwrite``/``preadv``, remote
against raw pipelined ``SET``/``GET``; each repeat times both back to back. Starts its own
``redis-server`` when none is given. Limits, estimator and targets: docs/benches.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from kvplane.apps.bench.common import SETTLE_S, paired_ratio, stream_fields, stream_memcpy
from kvplane.ids import BlockId, ChunkKey, SlotId
from kvplane.layout import KVLayout
from kvplane.offload import (
    AdmissionFilter,
    OffloadConfig,
    OffloadManager,
    TierCascade,
    build_cascade,
)
from kvplane.offload.tiers import ALIGN, DiskTier, HostTier, ReadOutcome, RemoteTier, SyncPolicy
from kvplane.offload.tiers.base import as_buffer
from kvplane.offload.tiers.remote import PIPELINE_BYTES, redis_support
from kvplane.testing.redis_server import LocalRedisServer, redis_server_support

NAME = "offload"
HELP = "Offload tiers: store/load GB/s per tier vs memcpy, raw file I/O and raw Redis."

BLOCK_BYTES = 16 << 10
CHUNK_SIZES = (256 << 10, 4 << 20)
CHUNKS_PER_REPEAT = {True: (64, 16), False: (128, 32)}
"""Chunks moved per timed repeat, per entry of ``CHUNK_SIZES``, for ``--quick`` and full runs."""
REPEATS = {True: 15, False: 25}
WARMUP = 2
"""Leading repeats dropped (page faults, worker threads, allocator and socket warm-up)."""
SWEEP = (1, 4, 16, 64)
SWEEP_BLOCKS = {True: 256, False: 1024}
TARGETS = {"host": 0.8, "disk": 0.7, "remote": 0.8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None, help="use this Redis server (redis://...)")
    parser.add_argument("--disk-dir", default=None, help="directory for the disk tier's file")
    parser.add_argument("--sync", choices=[p.value for p in SyncPolicy], default="none")
    parser.add_argument("--no-direct-io", action="store_true", help="buffered disk I/O")


def _layout(num_blocks: int) -> KVLayout:
    """16 KiB blocks: 4 layers x K/V x 16 tokens x 2 heads x 32 dims x bf16."""
    return KVLayout.gqa(num_blocks=num_blocks, block_size=16, num_layers=4, kv_heads=2, head_dim=32)


def _fresh_keys(n: int) -> list[ChunkKey]:
    """Keys no tier holds yet (random, like block hashes of new content)."""
    return [ChunkKey(os.urandom(32)) for _ in range(n)]


KeyedOp = Callable[[list[ChunkKey]], None]
"""kvplane's side of a measurement: store (or load) these chunk keys."""


def _each(n: int, op: Callable[[int], object]) -> None:
    for i in range(n):
        op(i)


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(
    tier: str,
    chunk: int,
    n: int,
    reps: int,
    *,
    ours: tuple[KeyedOp, KeyedOp],
    limit: tuple[Callable[[], object], Callable[[], object]],
    stream: tuple[Callable[[], None], Callable[[], None]] | None = None,
) -> list[dict[str, Any]]:
    """Rows for store and load: each repeat times kvplane then its limit (moving the same
    ``n`` chunks) in each direction -- then, when given, the streaming memcpy of the same
    bytes -- every run after a settle pause (:data:`SETTLE_S`); the first :data:`WARMUP`
    repeats are dropped. ``gbps`` and ``limit_gbps`` are medians; ``ratio`` is the median of
    the per-repeat ratios (each pair ran under the same machine load, which on a shared host
    drifts between repeats)."""
    times: list[list[float]] = [[], [], [], [], [], []]
    for _ in range(WARMUP + reps):
        keys = _fresh_keys(n)
        runs = [lambda: ours[0](keys), limit[0], lambda: ours[1](keys), limit[1]]  # noqa: B023
        if stream is not None:
            runs += stream
        for i, run in enumerate(runs):
            time.sleep(SETTLE_S)  # neither side inherits the other's spinning OpenMP threads
            times[i].append(_seconds(run))
    nbytes = n * chunk
    kept = [t[WARMUP:] for t in times]
    return [
        _row(tier, "store", chunk, nbytes, ours=kept[0], limit=kept[1], stream=kept[4]),
        _row(tier, "load", chunk, nbytes, ours=kept[2], limit=kept[3], stream=kept[5]),
    ]


def _row(
    tier: str, op: str, chunk: int, nbytes: int, *, ours: list[float], limit: list[float],
    stream: list[float],
) -> dict[str, Any]:  # fmt: skip
    return {
        "tier": tier,
        "op": op,
        "chunk_bytes": chunk,
        "gbps": round(nbytes / statistics.median(ours) / 1e9, 3),
        "limit_gbps": round(nbytes / statistics.median(limit) / 1e9, 3),
        "ratio": round(paired_ratio(ours, limit), 3),
        **stream_fields(nbytes, ours, stream),
    }


# -- host: the cascade path between a (CPU) device pool and host slots ----------------------------
def _host_rows(chunk: int, n: int, reps: int) -> list[dict[str, Any]]:
    bpc = chunk // BLOCK_BYTES
    layout = _layout(2 * n * bpc)
    pool = torch.randn(layout.shape).to(layout.dtype)
    c = build_cascade(OffloadConfig(host_slots=n, admission_min_lookups=0), layout, bpc, pool)
    src = [BlockId(b) for b in range(n * bpc)]
    dst = [BlockId(b) for b in range(n * bpc, 2 * n * bpc)]
    pool_chunks = pool.view(2 * n, chunk // pool.element_size())
    host_chunks = c.host.buffer.view(n, chunk).view(pool.dtype)

    def store(keys: list[ChunkKey]) -> None:
        c.store(keys, src)
        c.drain()

    def load(keys: list[ChunkKey]) -> None:
        c.load(keys, dst)
        c.drain()

    to_host = stream_memcpy(pool_chunks[:n], host_chunks)
    to_pool = stream_memcpy(host_chunks, pool_chunks[n:])
    rows = _measure(
        "host", chunk, n, reps, ours=(store, load),
        limit=(lambda: host_chunks.copy_(pool_chunks[:n]),
               lambda: pool_chunks[n:].copy_(host_chunks)),
        stream=None if to_host is None or to_pool is None else (to_host, to_pool),
    )  # fmt: skip
    c.check_integrity()
    c.close()
    return rows


# -- disk and remote: one manager + tier, between host slots and the tier ---------------------
def _tier_ops(
    tier: DiskTier | RemoteTier, mgr: OffloadManager, bufs: Sequence[torch.Tensor]
) -> tuple[KeyedOp, KeyedOp]:
    def store(keys: list[ChunkKey]) -> None:
        plan = mgr.prepare_store(keys)
        if plan is None:
            raise RuntimeError(f"bench tier {tier.name} has no room")
        tier.write(plan.slots, plan.keys, bufs)
        mgr.complete_store(plan.keys, True)

    def load(keys: list[ChunkKey]) -> None:
        plan = mgr.prepare_load(keys)
        got = tier.read(plan.slots, plan.keys, bufs)
        mgr.complete_load(plan.keys, [o is ReadOutcome.OK for o in got])
        if got.count(ReadOutcome.OK) != len(keys):
            raise RuntimeError(f"bench tier {tier.name} read back {got}")

    return store, load


def _host_buffers(n: int, chunk: int) -> tuple[list[torch.Tensor], list[memoryview]]:
    host = HostTier(n, chunk)
    host.buffer.copy_(torch.randint(0, 256, (host.buffer.numel(),), dtype=torch.uint8))
    bufs = [host.slot(SlotId(i)) for i in range(n)]
    return bufs, [as_buffer(b) for b in bufs]


def _disk_rows(
    chunk: int, n: int, reps: int, where: Path, *, sync: SyncPolicy, direct: bool
) -> tuple[list[dict[str, Any]], bool]:
    slots_path, raw_path = where / "bench-slots.kvc", where / "bench-raw.bin"
    tier = DiskTier(slots_path, n, chunk, _layout(1).fingerprint(), sync=sync, direct_io=direct)
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if tier.direct else 0), 0o600)
    os.ftruncate(fd, n * chunk)
    bufs, views = _host_buffers(n, chunk)

    def raw_write(i: int) -> None:
        os.pwrite(fd, views[i], i * chunk)
        if sync is SyncPolicy.DATA:
            os.fdatasync(fd)

    mgr = OffloadManager("disk", n, "lru", AdmissionFilter(0))
    try:
        ops = _tier_ops(tier, mgr, bufs)
        raw = (lambda: _each(n, raw_write),
               lambda: _each(n, lambda i: os.preadv(fd, [views[i]], i * chunk)))  # fmt: skip
        rows = _measure("disk", chunk, n, reps, ours=ops, limit=raw)
        mgr.check_integrity()
        return rows, tier.direct
    finally:
        tier.close()
        os.close(fd)
        slots_path.unlink(missing_ok=True)
        raw_path.unlink(missing_ok=True)


def _remote_rows(chunk: int, n: int, reps: int, url: str) -> list[dict[str, Any]]:
    import redis

    ns = f"kvbench{os.getpid()}"
    tier = RemoteTier(url, n, chunk, _layout(1).fingerprint(), namespace=ns, timeout_s=30.0)
    client = redis.Redis.from_url(url, socket_timeout=30.0)
    bufs, views = _host_buffers(n, chunk)
    names = [f"{ns}:raw:{i}" for i in range(n)]

    per = max(1, PIPELINE_BYTES // chunk)
    groups = [range(a, min(a + per, n)) for a in range(0, n, per)]

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

    mgr = OffloadManager("remote", n, "lru", AdmissionFilter(0))
    try:
        ops = _tier_ops(tier, mgr, bufs)
        raw = (raw_store, raw_load)
        rows = _measure("remote", chunk, n, reps, ours=ops, limit=raw)
        mgr.check_integrity()
        return rows
    finally:
        tier.clear()
        client.delete(*names)
        client.close()
        tier.close()


# -- sweep ---------------------------------------------------------------------------------------
def _sweep(total_blocks: int, reps: int) -> list[dict[str, Any]]:
    """Store ``total_blocks`` 16 KiB blocks as chunks of ``bpc`` blocks, one store op per chunk
    (``us_per_block``) and all chunks in one call (``us_per_block_one_call``)."""
    out = []
    layout = _layout(total_blocks)
    pool = torch.randn(layout.shape).to(layout.dtype)
    blocks = [BlockId(b) for b in range(total_blocks)]
    for bpc in SWEEP:
        n = total_blocks // bpc
        cfg = OffloadConfig(host_slots=n, admission_min_lookups=0)
        c = build_cascade(cfg, layout, bpc, pool)

        def per_op(keys: list[ChunkKey], c: TierCascade = c, bpc: int = bpc) -> None:
            for i, k in enumerate(keys):
                c.store([k], blocks[i * bpc : (i + 1) * bpc])
            c.drain()

        def one_call(keys: list[ChunkKey], c: TierCascade = c) -> None:
            c.store(keys, blocks)
            c.drain()

        ops, calls = [], []
        for _ in range(WARMUP + reps):
            ops.append(_seconds(lambda f=per_op, n=n: f(_fresh_keys(n))))  # type: ignore[misc]
            calls.append(_seconds(lambda f=one_call, n=n: f(_fresh_keys(n))))  # type: ignore[misc]
        c.check_integrity()
        c.close()
        out.append(
            {
                "blocks_per_chunk": bpc,
                "us_per_block": round(statistics.median(ops[WARMUP:]) / total_blocks * 1e6, 3),
                "us_per_block_one_call": round(
                    statistics.median(calls[WARMUP:]) / total_blocks * 1e6, 3
                ),
            }
        )
    return out


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    reps = REPEATS[quick]
    sync = SyncPolicy(getattr(args, "sync", "none"))
    direct = not getattr(args, "no_direct_io", False)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    counts = dict(zip(CHUNK_SIZES, CHUNKS_PER_REPEAT[quick], strict=True))
    for chunk in CHUNK_SIZES:
        rows += _host_rows(chunk, counts[chunk], reps)
    disk_dir = getattr(args, "disk_dir", None)
    with tempfile.TemporaryDirectory(dir=disk_dir, prefix="kvplane-bench-") as tmp:
        direct_used = False
        for chunk in CHUNK_SIZES:
            disk_rows, direct_used = _disk_rows(
                chunk, counts[chunk], reps, Path(tmp), sync=sync, direct=direct
            )
            rows += disk_rows
    url = getattr(args, "redis_url", None) or os.environ.get("KVPLANE_OFFLOAD_REMOTE_URL")
    reason = redis_support() if url else redis_server_support()
    if reason is not None:
        skipped.append(f"remote: {reason}")
    elif url:
        for chunk in CHUNK_SIZES:
            rows += _remote_rows(chunk, counts[chunk], reps, url)
    else:
        with LocalRedisServer() as server:  # our own server on 127.0.0.1, stopped at the end
            for chunk in CHUNK_SIZES:
                rows += _remote_rows(chunk, counts[chunk], reps, server.url)
    sweep = _sweep(SWEEP_BLOCKS[quick], reps)
    per_block = {s["blocks_per_chunk"]: s["us_per_block"] for s in sweep}
    sweep_ratio = per_block[16] / per_block[1] if per_block[1] else 0.0
    met = {
        f"{r['tier']}_{r['op']}_{r['chunk_bytes']}": r["ratio"] >= TARGETS[r["tier"]] for r in rows
    }
    met["sweep_16_vs_1"] = sweep_ratio <= 0.2
    summary = {
        f"{r['tier']} {r['op']} {r['chunk_bytes'] >> 10} KiB": (
            f"{r['gbps']:.2f} / {r['limit_gbps']:.2f} GB/s = {r['ratio']:.2f}"
            f" (target {TARGETS[r['tier']]})"
            + (f"; {r['stream_ratio']:.2f} of a streaming memcpy" if "stream_ratio" in r else "")
        )
        for r in rows
    }
    summary |= {
        f"{s['blocks_per_chunk']} blocks/chunk": (
            f"{s['us_per_block']:.2f} us/block per op, {s['us_per_block_one_call']:.2f} in one call"
        )
        for s in sweep
    }
    return {
        "throughput": rows,
        "blocks_per_chunk_sweep": sweep,
        "sweep_ratio_16_vs_1": round(sweep_ratio, 3),
        "targets": TARGETS,
        "targets_met": met,
        "disk": {"sync": sync.value, "direct_io": direct_used, "align": ALIGN},
        "remote_server": "configured" if url else "private redis-server",
        "skipped": skipped,
        **summary,
    }
