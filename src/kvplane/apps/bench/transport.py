"""``kvplane bench transport``: each transport against the physical limit of its path.

64 MiB as scattered 256 KiB and 4 KiB blocks per transport, against memcpy, a raw socket or the
raw engine, interleaved repeat by repeat until the paired ratios are stable; kvplane builds its
descriptor lists inside every timed repeat (and is also timed with them built once), as the raw
engines build theirs; plus the planner entries of :mod:`~kvplane.apps.bench.transport_planner`.
Limits, tcp against NIXL, and why tcp runs alone first: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvplane.apps.bench.common import (
    SETTLE_S,
    limit_fields,
    paired_ratio,
    stream_fields,
    stream_memcpy,
)
from kvplane.apps.bench.spread import Row, repeat_rows_until_stable, spread
from kvplane.errors import KVPlaneError
from kvplane.testing.peer_process import PeerProcess, pattern
from kvplane.transports.base import DescriptorList, XferKind
from kvplane.transports.core import TransportCore
from kvplane.transports.local import LocalTransport
from kvplane.transports.registry import available, create_transport

NAME = "transport"
HELP = "Transport throughput (64 MiB as 256 KiB and 4 KiB blocks) against each path's limit."

TOTAL = 64 << 20
BLOCKS = (256 << 10, 4 << 10)
REPEATS = {True: (5, 10, 2.0), False: (5, 40, 30.0)}
"""By ``quick``: (min_repeats, max_repeats, cap_s) of each block size's interleaved repeats."""
QUICK_DROPPED = "full run only: for information (UCX's cma path), not a target"
"""Why ``--quick`` leaves out NIXL over UCX's default transports when NIXL over TCP runs. tcp's
own rows come from a run with no NIXL agent alive even in ``--quick``: beside UCX's progress
threads its raw-socket limit ran at half speed (tcp 256 KiB read 1.80 of it)."""
TARGETS = {"local": 0.8, "shm": 0.8, "tcp": 0.85, "nixl": 0.9, "mooncake": 0.9}
LIMITS = {
    "local": "torch copy_ of 64 MiB",
    "shm": "torch copy_ of 64 MiB",
    "tcp": "raw sendall/recv_into loop (1 MiB pieces) to the child",
    "nixl": "raw NIXL WRITE of the same blocks to the child",
    "mooncake": "raw Mooncake batch_transfer_sync_write of the same blocks to the child",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", nargs="*", default=None, help="transports to run (default all)")


def _blocks(block: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    n = TOTAL // block
    perm = np.random.default_rng(block).permutation(n)
    return np.arange(n, dtype=np.int64) * block, perm.astype(np.int64) * block, np.full(n, block)


def _lists(
    src_region: int, dst_region: int, so: np.ndarray[Any, Any], do: np.ndarray[Any, Any],
    ln: np.ndarray[Any, Any],
) -> tuple[DescriptorList, DescriptorList]:  # fmt: skip
    """The (source, destination) descriptor lists of one bench write from its offset arrays:
    new lists, so every fact a transport caches on them is computed again."""
    return (DescriptorList(np.full(len(so), src_region), so, ln),
            DescriptorList(np.full(len(so), dst_region), do, ln))  # fmt: skip


def _writes(
    t: TransportCore, peer: Any, src_region: int, dst_region: int
) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """kvplane's two timed writes per block size: ``fresh`` builds its descriptor lists from
    the offset arrays inside the timed span, as the raw engines build their own block lists
    inside theirs; ``cached`` reuses lists built once before timing (their cached facts then
    paid once, outside the clock)."""
    layout = {block: _blocks(block) for block in BLOCKS}
    built = {block: _lists(src_region, dst_region, *layout[block]) for block in BLOCKS}

    def fresh(block: int) -> None:
        _kv_write(t, peer, *_lists(src_region, dst_region, *layout[block]))

    def cached(block: int) -> None:
        _kv_write(t, peer, *built[block])

    return fresh, cached


UCX_TCP = {"UCX_TLS": "tcp"}
"""UCX restricted to its TCP transport (and nothing shared-memory) -- the same path as ``tcp``."""


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` set in this process's environment (inherited by children started meanwhile;
    UCX reads it when an agent creates its context), the previous values restored after."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _kv_write(t: TransportCore, peer: Any, src: DescriptorList, dst: DescriptorList) -> None:
    got = t.wait(t.submit(XferKind.WRITE, src, dst, peer, deadline_s=300.0))
    if got.bytes_done != TOTAL:
        raise KVPlaneError(f"bench write on {t.name} ended {got}")


Times = tuple[list[float], list[float], list[float], list[float], list[float]]
"""Seconds per repeat of one case at one block size: kvplane fresh, kvplane cached, the limit,
the streaming memcpy and the scattered raw limit (the last two empty when not timed)."""


def _row(name: str, block: int, times: Times, label: str = "") -> tuple[dict[str, Any], list[Row]]:
    """One result row (kvplane with fresh descriptor lists against the limit; ``cached_*``
    with lists built once; the second limits' fields; the main ratio's spread) and its
    :class:`Row` lines, named by ``label`` (default ``name``)."""
    kv, cached, limit, stream, scatter = times
    main = spread(kv, limit)
    target = TARGETS[name]
    gbps = TOTAL / statistics.median(kv) / 1e9
    limit_gbps = TOTAL / statistics.median(limit) / 1e9
    out = {"transport": name, "block_bytes": block, "total_bytes": TOTAL, "gbps": round(gbps, 3),
           "limit_gbps": round(limit_gbps, 3), "ratio": round(main.ratio_median, 3),
           "target": target, "target_met": main.ratio_median >= target,
           **{k: v for k, v in main.fields().items() if k != "ratio_median"},
           **stream_fields(TOTAL, kv, stream),
           **limit_fields("scatter", TOTAL, kv, scatter)}  # fmt: skip
    where = f"{label or name} {block >> 10} KiB"
    rows = [Row("transport", f"{where} fresh", gbps, "GB/s", limit_gbps, LIMITS[name], main,
                target, True)]  # fmt: skip
    if cached:
        fast = spread(cached, limit)
        cached_gbps = TOTAL / statistics.median(cached) / 1e9
        out |= {"cached_gbps": round(cached_gbps, 3), "cached_ratio": round(fast.ratio_median, 3)}
        rows.append(Row("transport", f"{where} cached", cached_gbps, "GB/s", limit_gbps,
                        LIMITS[name], fast, target, True))  # fmt: skip
    seconds = (("stream", stream, "streaming memcpy (C, one thread)"),
               ("scatter", scatter, "raw sendall into the same blocks"))  # fmt: skip
    for kind, second, what in seconds:
        if second:
            rows.append(Row("transport", f"{where} vs {kind}", gbps, "GB/s",
                            TOTAL / statistics.median(second) / 1e9, what, spread(kv, second),
                            None, True))  # fmt: skip
    return out, rows


@dataclass(frozen=True, slots=True)
class _Case:
    """What one transport's repeat times: kvplane's write with fresh and with cached
    descriptor lists and its limit per block size, and (when not None) the streaming memcpy
    and the scattered raw limit. ``label`` names its rows (default ``name``). ``buffers``
    keeps the memory they use alive for as long as the case is (a raw engine holds only an
    address of its registered buffer: freeing it mid-run once broke the raw NIXL write)."""

    name: str
    kv: Callable[[int], None]
    cached: Callable[[int], None]
    limit: Callable[[int], None]
    stream: Callable[[], None] | None = None
    scatter: Callable[[int], None] | None = None
    buffers: tuple[torch.Tensor, ...] = ()
    label: str = ""

    def timed(self, block: int) -> list[Callable[[], None] | None]:
        """This repeat's thunks in :data:`Times` order (None where not timed)."""
        scatter = self.scatter
        return [lambda: self.kv(block), lambda: self.cached(block), lambda: self.limit(block),
                self.stream, None if scatter is None else lambda: scatter(block)]  # fmt: skip


Measured = tuple[list[list[dict[str, Any]]], list[dict[int, list[float]]], list[Row]]
"""Result rows per case and block size, kvplane's fresh seconds per case by block size, and
every :class:`Row`."""


def _measure_cases(cases: Sequence[_Case], quick: bool) -> Measured:
    """The cases interleaved, per block size: each repeat times every case in turn -- its
    :meth:`_Case.timed` thunks, each after a settle pause -- so repeat ``i`` of two cases
    shared the machine's load of the moment; repeats go on until every case's fresh ratio is
    stable (:data:`REPEATS`)."""
    rows: list[list[dict[str, Any]]] = [[] for _ in cases]
    kv_s: list[dict[int, list[float]]] = [{} for _ in cases]
    lines: list[Row] = []
    low, high, cap = REPEATS[quick]
    for block in BLOCKS:
        for c in cases:  # warm-up: first touch, connection set-up
            for fn in c.timed(block):
                if fn is not None and fn is not c.stream:
                    fn()
        times: list[Times] = [([], [], [], [], []) for _ in cases]

        def step(block: int = block, times: list[Times] = times) -> list[tuple[float, float]]:
            for c, got in zip(cases, times, strict=True):
                for fn, into in zip(c.timed(block), got, strict=True):
                    if fn is not None:
                        time.sleep(SETTLE_S)
                        into.append(_timed(fn))
            return [(got[0][-1], got[2][-1]) for got in times]

        repeat_rows_until_stable(step, min_repeats=low, max_repeats=high, cap_s=cap, settle_s=0)
        for i, (c, got) in enumerate(zip(cases, times, strict=True)):
            row, more = _row(c.name, block, got, c.label)
            rows[i].append(row)
            lines += more
            kv_s[i][block] = got[0]
    return rows, kv_s, lines


def _measure(case: _Case, quick: bool) -> tuple[list[dict[str, Any]], list[Row]]:
    """Result rows per block size of one case, and its :class:`Row` lines."""
    rows, _, lines = _measure_cases([case], quick)
    return rows[0], lines


def _local(quick: bool) -> tuple[list[dict[str, Any]], list[Row]]:
    t = LocalTransport()
    src, dst = pattern(TOTAL, 1), torch.zeros(TOTAL, dtype=torch.uint8)
    rs, rd = t.register(src).region_id, t.register(dst).region_id
    peer = t.connect(t.metadata())
    fresh, cached = _writes(t, peer, int(rs), int(rd))

    def memcpy(block: int) -> None:
        dst.copy_(src)

    try:
        return _measure(_Case("local", fresh, cached, memcpy, stream_memcpy(src, dst)), quick)
    finally:
        t.close()


def _tcp_limits(far: PeerProcess, reps: int) -> tuple[Callable[[int], None], Callable[[int], None]]:
    # ``reps``: the most timed sends per block size (each sink takes one more, the warm-up).
    """The raw socket limits of ``tcp``: the same bytes sent by ``sendall`` in 1 MiB pieces to
    a ``recv_into`` loop into one contiguous buffer of the child (the issue's limit, one
    connection), and to ``recvmsg_into`` (``MSG_WAITALL``, 1,024 pieces a call) straight into
    the child's blocks at the bench's scattered destination offsets (one connection per block
    size), so that the kernel pays the scatter into a paged pool that the contiguous loop
    never pays."""
    ports = {0: far.raw_sink(TOTAL, len(BLOCKS) * (reps + 1))}
    for block in BLOCKS:
        ports[block] = far.raw_sink(TOTAL, reps + 1, block, _blocks(block)[1].tolist())
    socks = {key: socket.create_connection(("127.0.0.1", port)) for key, port in ports.items()}
    for sock in socks.values():
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = pattern(TOTAL, 2).numpy().data

    def send(sock: socket.socket) -> None:
        for i in range(0, TOTAL, 1 << 20):
            sock.sendall(data[i : i + (1 << 20)])
        sock.recv(1)

    return lambda block: send(socks[0]), lambda block: send(socks[block])


def _cross_case(name: str, quick: bool, stack: contextlib.ExitStack, label: str = "") -> _Case:
    """Set up ``name`` writing into a child process, and its limit; ``stack`` closes them
    (the raw engine, then the transport, then the child). ``label`` names its rows."""
    far = stack.enter_context(PeerProcess(name))
    region = far.alloc(TOTAL)
    t = create_transport(name)
    assert isinstance(t, TransportCore)
    stack.callback(t.close)
    allocate = getattr(t, "allocate", None)
    src = allocate(TOTAL) if allocate is not None else torch.empty(TOTAL, dtype=torch.uint8)
    src.copy_(pattern(TOTAL, 1))
    mine = t.register(src).region_id
    meta = far.metadata()
    peer = t.connect(meta)
    scratch = torch.zeros(TOTAL, dtype=torch.uint8)
    scatter = None
    if name == "tcp":
        limit, scatter = _tcp_limits(far, REPEATS[quick][1])
    elif name == "shm":

        def limit(block: int) -> None:
            scratch.copy_(src)

    else:
        from kvplane.transports.mooncake import RawMooncakeWriter
        from kvplane.transports.nixl import RawNixlWriter

        raw = (RawNixlWriter if name == "nixl" else RawMooncakeWriter)(meta, scratch)
        stack.callback(raw.close)
        layout = {block: _blocks(block) for block in BLOCKS}

        def limit(block: int) -> None:
            so, do, ln = layout[block]
            raw.write(so, int(region), do, ln)

    fresh, cached = _writes(t, peer, int(mine), int(region))
    stream = stream_memcpy(src, scratch) if name == "shm" else None
    return _Case(name, fresh, cached, limit, stream, scatter, (src, scratch), label)


def _cross(name: str, quick: bool, label: str = "") -> tuple[list[dict[str, Any]], list[Row]]:
    with contextlib.ExitStack() as stack:
        return _measure(_cross_case(name, quick, stack, label), quick)


def _tcp_with_nixl(
    quick: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[int, float], list[Row]]:
    """``tcp``'s rows and the NIXL-over-UCX-TCP rows, measured interleaved repeat by repeat
    (NIXL's child and agents created with :data:`UCX_TCP` set), and per block size the paired
    ratio tcp / NIXL throughput (the median of per-repeat ratios: >= 1 means tcp is faster),
    and their :class:`Row` lines (tcp's labelled ``tcp (beside NIXL)``)."""
    with contextlib.ExitStack() as stack:
        tcp = _cross_case("tcp", quick, stack, "tcp (beside NIXL)")
        with _environ(UCX_TCP):
            nixl = _cross_case("nixl", quick, stack, NIXL_TCP)
        (tcp_rows, nixl_rows), (tcp_s, nixl_s), lines = _measure_cases([tcp, nixl], quick)
    paired = {b: round(paired_ratio(tcp_s[b], nixl_s[b]), 3) for b in BLOCKS}
    return tcp_rows, [dict(r, ucx_tls="tcp") for r in nixl_rows], paired, lines


def _tls(row: dict[str, Any]) -> str:
    """`` (UCX_TLS=tcp)`` for NIXL rows restricted to TCP, else nothing."""
    return " (UCX_TLS=tcp)" if row.get("ucx_tls") == "tcp" else ""


def _said(row: dict[str, Any]) -> str:
    """A row in words: throughput against the limit and target, then the second limits."""
    out = (f"{row['gbps']:.2f} / {row['limit_gbps']:.2f} GB/s = {row['ratio']:.2f} "
           f"(target {TARGETS[row['transport']]})")  # fmt: skip
    if "stream_ratio" in row:
        out += f"; {row['stream_ratio']:.2f} of a streaming memcpy"
    if "scatter_ratio" in row:
        out += f"; {row['scatter_ratio']:.2f} of the raw socket into the same blocks"
    return out


def _planner(quick: bool) -> list[dict[str, Any]] | None:
    try:
        from kvplane.apps.bench.transport_planner import contiguous_4k_entry, planner_entry
    except ImportError:
        return None
    return [dict(planner_entry(quick)), dict(contiguous_4k_entry())]


NIXL_TCP = "nixl (UCX_TLS=tcp)"
TCP_VS_NIXL_NOTE = (
    "target: tcp's throughput >= the NIXL adapter's over UCX restricted to TCP (UCX_TLS=tcp in "
    "both processes), the same path; the 'nixl' labels compare with UCX's default cma "
    "(one host only), for information. When both ran, tcp and NIXL over TCP are timed "
    "interleaved repeat by repeat and the target is their paired throughput ratio "
    "(tcp_vs_nixl_paired_ratio, tcp / NIXL) >= 1; the cma comparison is of medians of "
    "separate runs"
)


def tcp_vs_nixl(
    results: list[dict[str, Any]], paired: dict[int, float] | None = None
) -> tuple[dict[str, bool], list[str]]:
    """tcp against the NIXL adapter, per block size where both ran: ``{label: tcp >= nixl}``,
    and the labels that are the issue's target (NIXL restricted to TCP, :data:`NIXL_TCP`).
    A target label uses ``paired[block]`` (tcp / NIXL throughput, paired repeat by repeat)
    where given, else the two medians; the others compare with NIXL's default cma path by
    medians."""
    by = {(r["transport"] + _tls(r), r["block_bytes"]): r for r in results if "transport" in r}
    out: dict[str, bool] = {}
    target: list[str] = []
    for b in BLOCKS:
        for key, what in ((NIXL_TCP, "same path"), ("nixl", "UCX cma, one host only")):
            if ("tcp", b) in by and (key, b) in by:
                label = f"tcp >= {key} at {b >> 10} KiB ({what})"
                if key == NIXL_TCP and paired is not None and b in paired:
                    out[label] = paired[b] >= 1.0
                else:
                    out[label] = by[("tcp", b)]["gbps"] >= by[(key, b)]["gbps"]
                if key == NIXL_TCP:
                    target.append(label)
    return out, target


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    only = getattr(args, "only", None)
    skipped: dict[str, str] = {}
    names = []
    for name, reason in available().items():
        if only and name not in only:
            continue
        if reason is not None:
            skipped[name] = reason
        else:
            names.append(name)
    interleave = "tcp" in names and "nixl" in names
    rows: dict[str, list[dict[str, Any]]] = {}
    lines: list[Row] = []
    paired: dict[int, float] | None = None
    for name in names:
        if name == "local":
            rows[name], more = _local(quick)
        elif name == "tcp" and interleave:  # quick too: beside UCX's threads its raw limit sags
            rows[name], more = _cross(name, quick)  # its ratio with no other engine's threads
            _, rows[NIXL_TCP], paired, beside = _tcp_with_nixl(quick)
            more = more + beside
        elif name == "nixl" and interleave and quick:
            skipped["nixl (UCX default)"] = QUICK_DROPPED
            continue
        elif name == "nixl":
            got, more = _cross(name, quick, "nixl (UCX default)")
            rows[name] = [dict(r, ucx_tls="default") for r in got]
            if not interleave:
                with _environ(UCX_TCP):
                    got, tcp_lines = _cross(name, quick, NIXL_TCP)
                rows[NIXL_TCP] = [dict(r, ucx_tls="tcp") for r in got]
                more = more + tcp_lines
        else:
            rows[name], more = _cross(name, quick)
        lines += more
    results = [r for name in names for key in (name, NIXL_TCP * (name == "nixl"))
               for r in rows.get(key, ())]  # fmt: skip
    summary = {f"{r['transport']}{_tls(r)} {r['block_bytes'] >> 10} KiB": _said(r) for r in results}
    versus, target = tcp_vs_nixl(results, paired)
    planner = _planner(quick)
    if planner is not None:
        results += planner
    else:
        skipped["planner"] = "kvplane.apps.bench.transport_planner is not available"
    repeats = REPEATS[quick]
    paired_by_label = {} if paired is None else {f"{b >> 10} KiB": r for b, r in paired.items()}
    return {"results": results, "summary": summary, "tcp_vs_nixl": versus,
            "tcp_vs_nixl_target": target, "tcp_vs_nixl_paired_ratio": paired_by_label,
            "tcp_vs_nixl_note": TCP_VS_NIXL_NOTE, "limits": LIMITS, "targets": TARGETS,
            "quick": quick, "repeats": dict(zip(("min", "max", "cap_s"), repeats, strict=True)),
            "skipped": skipped, "rows": [r.as_dict() for r in lines]}  # fmt: skip
