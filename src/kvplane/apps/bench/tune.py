"""``kvplane tune chunks``: each tier's ``blocks_per_chunk`` from measurements on this machine.

Times store and load ops of the host, disk and remote tiers at several chunk sizes (the
offload bench's repeat loop and tier ops, :mod:`.offload_rows`; Redis is a private
``redis-server`` unless ``--redis-url``), fits and chooses with
:mod:`kvplane.offload.chunk_cost`, prints the fits and choices and with ``--write`` puts them
into a config file's ``[tune.chunks]`` section. Wiring only: the model and rule live in
``chunk_cost``. Docs: docs/offload.md, "Choosing chunk sizes".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvplane.apps.bench.offload_rows import KeyedOp, cascade_ops, repeat, seconds, tier_ops
from kvplane.apps.bench.offload_sweep import fresh_keys, layout
from kvplane.config import load_toml
from kvplane.errors import ConfigError
from kvplane.ids import BlockId, SlotId
from kvplane.offload import AdmissionFilter, OffloadConfig, OffloadManager, build_cascade
from kvplane.offload.chunk_cost import MAX_OVERHEAD, MIN_CHUNKS, Sample, choose, fit
from kvplane.offload.tiers import DiskTier, HostTier, RemoteTier, Tier
from kvplane.testing.redis_server import LocalRedisServer, redis_server_support
from kvplane.validators import require_int

NAME = "tune"
HELP = "Tune to this machine: `tune chunks` picks each tier's blocks_per_chunk from measurements."

TIERS = ("host", "disk", "remote")
BLOCK_BYTES = 16 << 10
"""Bytes of one block of the measured layout (:func:`.offload_sweep.layout`)."""
SIZES = {True: (1, 8, 64), False: (1, 4, 16, 64, 256)}
"""Blocks per chunk measured, per ``--quick``."""
RUN_BYTES = {True: 4 << 20, False: 16 << 20}
"""Bytes moved per timed run (at least 4 chunks), per ``--quick``."""
CAPACITY_MIB = {"host": 4096, "disk": 65536, "remote": 8192}
SECTION = "tune.chunks"

Measure = Callable[[str, int, bool], tuple[float, float]]
"""``(tier, blocks_per_chunk, quick) -> (store_s, load_s)``, seconds per op (one chunk)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["chunks"], help="what to tune")
    parser.add_argument("--tiers", default=",".join(TIERS), help="comma list of host,disk,remote")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--write", metavar="CONFIG.toml", help="write [tune.chunks] into this file")
    parser.add_argument(
        "--max-overhead",
        type=float,
        default=MAX_OVERHEAD,
        help="largest share of an op's transfer time its overhead may take",
    )
    parser.add_argument(
        "--min-chunks", type=int, default=MIN_CHUNKS, help="least chunks a tier holds"
    )
    parser.add_argument(
        "--capacity-mib",
        action="append",
        default=[],
        metavar="TIER=MIB",
        help=f"a tier's capacity (defaults {CAPACITY_MIB})",
    )
    parser.add_argument("--disk-dir", default=None, help="directory for the disk tier's file")
    parser.add_argument("--redis-url", default=None, help="use this Redis server (redis://...)")


def run(args: argparse.Namespace) -> int:
    return tune(args, None)


def tune(args: argparse.Namespace, measure: Measure | None) -> int:
    """The command with ``measure`` (the real one, :class:`Measurer`, when None). Prints the
    result; ``--write`` updates the file. ``ConfigError`` for a bad flag or file."""
    tiers = [t for t in args.tiers.split(",") if t]
    bad = sorted(set(tiers) - set(TIERS)) or ([] if tiers else ["(none)"])
    if bad:
        raise ConfigError(f"--tiers: unknown tier(s) {bad}; known: {list(TIERS)}")
    capacity = _capacities(args.capacity_mib)
    if not 0 < args.max_overhead <= 1:
        raise ConfigError(f"--max-overhead must be in (0, 1], got {args.max_overhead}")
    require_int("--min-chunks", args.min_chunks, min=1, error=ConfigError)
    with contextlib.ExitStack() as stack:
        if measure is None:
            measure = stack.enter_context(Measurer(args.disk_dir, args.redis_url)).measure
            skipped = {} if "remote" not in tiers else _remote_skip(args.redis_url)
        else:
            skipped = {}
        result: dict[str, Any] = {
            "block_bytes": BLOCK_BYTES,
            "max_overhead": args.max_overhead,
            "min_chunks": args.min_chunks,
            "tiers": {},
            "skipped": skipped,
        }
        for tier in tiers:
            if tier not in skipped:
                result["tiers"][tier] = _tier(tier, measure, args, capacity[tier])
    if args.write:
        write_section(Path(args.write), result)
    print(json.dumps(result, indent=2) if args.json else _text(result))
    return 0


def _capacities(given: list[str]) -> dict[str, int]:
    out = {t: mib << 20 for t, mib in CAPACITY_MIB.items()}
    for item in given:
        tier, _, mib = item.partition("=")
        if tier not in TIERS or not mib.isdigit() or int(mib) < 1:
            raise ConfigError(f"--capacity-mib wants TIER=MIB with TIER in {TIERS}, got {item!r}")
        out[tier] = int(mib) << 20
    return out


def _remote_skip(url: str | None) -> dict[str, str]:
    reason = None if url else redis_server_support()
    return {} if reason is None else {"remote": reason}


def _tier(tier: str, measure: Measure, args: argparse.Namespace, cap: int) -> dict[str, Any]:
    samples: dict[str, list[Sample]] = {"store": [], "load": []}
    for bpc in SIZES[args.quick]:
        store_s, load_s = measure(tier, bpc, args.quick)
        samples["store"].append(Sample(bpc * BLOCK_BYTES, store_s))
        samples["load"].append(Sample(bpc * BLOCK_BYTES, load_s))
    out: dict[str, Any] = {"capacity_bytes": cap}
    chosen = []
    for op, got in samples.items():
        f = fit(got)
        c = choose(f, block_bytes=BLOCK_BYTES, capacity_bytes=cap,
                   max_overhead=args.max_overhead, min_chunks=args.min_chunks)  # fmt: skip
        chosen.append(c.blocks_per_chunk)
        out[op] = {
            "op_us": round(f.op_s * 1e6, 3), "gbps": round(f.bytes_per_s / 1e9, 3),
            "residual_us": round(f.residual_s * 1e6, 3),
            "samples": [{"chunk_bytes": s.chunk_bytes, "us": round(s.seconds * 1e6, 3)}
                        for s in got],
            "wanted_blocks": c.wanted_blocks, "cap_blocks": c.cap_blocks,
            "blocks_per_chunk": c.blocks_per_chunk,
            "overhead_share": round(c.overhead_share, 4),
        }  # fmt: skip
    out["blocks_per_chunk"] = max(chosen)  # both directions within the overhead share
    return out


def _text(result: dict[str, Any]) -> str:
    lines = [f"block {result['block_bytes']} B, overhead <= {result['max_overhead']:.0%}, "
             f">= {result['min_chunks']} chunks per tier"]  # fmt: skip
    for tier, r in result["tiers"].items():
        for op in ("store", "load"):
            d = r[op]
            lines.append(f"{tier:6} {op:5} op {d['op_us']:9.1f} us  {d['gbps']:8.2f} GB/s  "
                         f"residual {d['residual_us']:7.1f} us  wants {d['wanted_blocks']:5}  "
                         f"cap {d['cap_blocks']:5}")  # fmt: skip
        lines.append(f"{tier:6} blocks_per_chunk = {r['blocks_per_chunk']}")
    lines += [f"{tier:6} skipped: {why}" for tier, why in result["skipped"].items()]
    return "\n".join(lines)


_HEADER = re.compile(r"^\s*\[")


def write_section(path: Path, result: dict[str, Any]) -> None:
    """Replace (or append) the ``[tune.chunks]`` table of the TOML file ``path`` (created when
    missing) with ``<tier>_blocks_per_chunk`` per tuned tier and the rule's parameters; the
    rest of the file is kept as it was. The new text must parse (``ConfigError`` if not) and
    replaces the file atomically."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    kept: list[str] = []
    inside = False
    for line in old.splitlines():
        if _HEADER.match(line):
            inside = line.strip().replace(" ", "") == f"[{SECTION}]"
        if not inside:
            kept.append(line)
    body = [f"[{SECTION}]", "# chosen by `kvplane tune chunks`; `kvplane serve --config` uses it",
            f"block_bytes = {result['block_bytes']}", f"max_overhead = {result['max_overhead']}",
            f"min_chunks = {result['min_chunks']}"]  # fmt: skip
    body += [f"{t}_blocks_per_chunk = {r['blocks_per_chunk']}" for t, r in result["tiers"].items()]
    gbps = {t: min(r["store"]["gbps"], r["load"]["gbps"]) for t, r in result["tiers"].items()}
    body += [f"{t}_gbps = {g if math.isfinite(g) else 0.0}"  # inf: the fit saw no bandwidth
             for t, g in gbps.items() if t != "host"]  # fmt: skip
    text = "\n".join([*kept, *([""] if kept and kept[-1].strip() else []), *body]) + "\n"
    tmp = path.with_name(path.name + ".tune-tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        load_toml(tmp)
    except ConfigError:
        tmp.unlink()
        raise
    os.replace(tmp, path)


class Measurer:
    """The real measurement: per (tier, size), a fresh tier of ``n`` chunk slots (``n`` chunks
    moved per run), timed by the offload bench's :func:`~.offload_rows.repeat` -- each
    repeat stores ``n`` fresh chunks then loads them back -- the medians divided by ``n``."""

    def __init__(self, disk_dir: str | None, redis_url: str | None) -> None:
        self._stack = contextlib.ExitStack()
        self._disk_dir = disk_dir
        self._url = redis_url

    def __enter__(self) -> Measurer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def measure(self, tier: str, bpc: int, quick: bool) -> tuple[float, float]:
        chunk = bpc * BLOCK_BYTES
        n = max(4, RUN_BYTES[quick] // chunk)
        with contextlib.ExitStack() as stack:
            store, load = stack.enter_context(self._ops(tier, bpc, n))

            def pair() -> tuple[float, float]:
                keys = fresh_keys(n)
                return seconds(lambda: store(keys)), seconds(lambda: load(keys))

            store_s, load_s = repeat(pair, quick)
        return statistics.median(store_s) / n, statistics.median(load_s) / n

    @contextlib.contextmanager
    def _ops(self, tier: str, bpc: int, n: int) -> Iterator[tuple[KeyedOp, KeyedOp]]:
        chunk = bpc * BLOCK_BYTES
        if tier == "host":
            yield from _host_ops(bpc, n)
            return
        host = HostTier(n, chunk)
        bufs = [host.slot(SlotId(i)) for i in range(n)]
        fp = layout(1).fingerprint()
        low: Tier
        if tier == "disk":
            tmp = self._stack.enter_context(tempfile.TemporaryDirectory(dir=self._disk_dir))
            low = DiskTier(Path(tmp) / f"tune-{bpc}.kvc", n, chunk, fp)
        else:
            if self._url is None:
                self._url = self._stack.enter_context(LocalRedisServer()).url
            low = RemoteTier(self._url, n, chunk, fp, namespace=f"kvtune{os.getpid()}",
                             timeout_s=30.0)  # fmt: skip
        try:
            yield tier_ops(low, OffloadManager(tier, n, "lru", AdmissionFilter(0)), bufs)
        finally:
            if isinstance(low, RemoteTier):
                low.clear()
            low.close()


def _host_ops(bpc: int, n: int) -> Iterator[tuple[KeyedOp, KeyedOp]]:
    """Store and load through a cascade between a CPU pool and ``n`` host slots."""
    kv = layout(2 * n * bpc)
    pool = torch.randn(kv.shape).to(kv.dtype)
    c = build_cascade(OffloadConfig(host_slots=n, admission_min_lookups=0), kv, bpc, pool)
    src = [BlockId(b) for b in range(n * bpc)]
    dst = [BlockId(b) for b in range(n * bpc, 2 * n * bpc)]
    try:
        yield cascade_ops(c, src, dst)
    finally:
        c.close()
