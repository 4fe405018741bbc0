"""How ``kvplane bench offload`` times one (tier, op, chunk size) against its limits and turns
the seconds into rows: the legacy ``throughput`` row and one :class:`~.spread.Row` per limit.

Owns the repeat loop of the offload bench (warm-up, then :func:`~.spread.repeat_until_stable`
with every limit timed in the same repeat, back to back) and the rows' names and fields. It
builds no tier and starts no server: :mod:`.offload` hands it thunks (:func:`tier_ops` makes a
lower tier's).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvplane.apps.bench.common import limit_fields
from kvplane.apps.bench.spread import SETTLE_S, Row, paired_ratio, repeat_until_stable, spread
from kvplane.ids import BlockId, ChunkKey
from kvplane.offload import OffloadManager, TierCascade
from kvplane.offload.tiers import ReadOutcome, Tier

BENCH = "offload"
WARMUP = 2
"""Leading repeats dropped (page faults, worker threads, allocator and socket warm-up)."""
REPEATS = {True: (5, 10), False: (7, 40)}
"""``(min, max)`` repeats of one (tier, op, chunk size), per ``--quick``."""
CAP_S = {True: 1.2, False: 10.0}
"""Seconds one (tier, op, chunk size) may keep repeating for a stable ratio, per ``--quick``."""

KeyedOp = Callable[[list[ChunkKey]], None]
"""kvplane's side of a measurement: store (or load) these chunk keys."""
Timed = Callable[[], float]
"""One run of a side of a measurement, returning its seconds (its own clock or the wall's)."""


def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit of a measurement: its ``name`` in rows, the ``key`` prefixing its fields in a
    throughput row (``""`` for the main limit) and the thunk timing one run of it."""

    name: str
    key: str
    run: Timed


@dataclass(frozen=True, slots=True)
class Measured:
    """Paired seconds of one (tier, op, chunk size): ``ours[i]`` and every ``limits[k][i]``
    were timed in repeat ``i``, back to back. ``unavailable`` says why the main limit could not
    be timed (then ``limits`` holds only the second ones)."""

    tier: str
    op: str
    chunk: int
    nbytes: int
    ours: list[float]
    limits: dict[str, list[float]]
    names: dict[str, str]
    unavailable: str | None = None


def measure(
    where: tuple[str, str, int, int],
    ours: Timed,
    limits: Sequence[Limit],
    quick: bool,
    *,
    unavailable: str | None = None,
) -> Measured:
    """Time ``ours`` and then each of ``limits`` (the first is the main one unless
    ``unavailable``), a :data:`SETTLE_S` pause before every run, :data:`WARMUP` repeats dropped,
    then repeated until the paired ratio against the first limit is stable (:data:`REPEATS`,
    :data:`CAP_S`). ``where`` is ``(tier, op, chunk_bytes, bytes moved per run)``."""
    extra: list[list[float]] = [[] for _ in limits[1:]]

    def pair() -> tuple[float, float]:
        us = ours()
        time.sleep(SETTLE_S)  # neither side inherits the other's spinning OpenMP threads
        first = limits[0].run()
        for sink, limit in zip(extra, limits[1:], strict=True):
            time.sleep(SETTLE_S)
            sink.append(limit.run())
        return us, first

    def drop_warmup() -> None:
        for sink in extra:
            sink.clear()

    ours_s, first_s = repeat(pair, quick, after_warmup=drop_warmup)
    tier, op, chunk, nbytes = where
    return Measured(
        tier, op, chunk, nbytes, ours_s,
        {lim.key: s for lim, s in zip(limits, [first_s, *extra], strict=True)},
        {lim.key: lim.name for lim in limits}, unavailable,
    )  # fmt: skip


def repeat(
    pair: Callable[[], tuple[float, float]],
    quick: bool,
    *,
    after_warmup: Callable[[], object] | None = None,
) -> tuple[list[float], list[float]]:
    """:data:`WARMUP` calls of ``pair`` dropped (then ``after_warmup``, which drops what the
    pair recorded on the side), then :func:`~.spread.repeat_until_stable` within
    :data:`REPEATS` and :data:`CAP_S` of ``quick``."""
    for _ in range(WARMUP):
        pair()
    if after_warmup is not None:
        after_warmup()
    low, high = REPEATS[quick]
    return repeat_until_stable(pair, min_repeats=low, max_repeats=high, cap_s=CAP_S[quick])


def _gbps(nbytes: int, s: Sequence[float]) -> float:
    return round(nbytes / statistics.median(s) / 1e9, 3)


def throughput_row(m: Measured) -> dict[str, Any]:
    """The legacy row: ``gbps``, ``limit_gbps`` and ``ratio`` (paired median) against the main
    limit -- both None, with ``limit_unavailable``, when it could not be timed -- plus
    ``{key}_limit_gbps`` and ``{key}_ratio`` per second limit."""
    out: dict[str, Any] = {"tier": m.tier, "op": m.op, "chunk_bytes": m.chunk}
    out["gbps"] = _gbps(m.nbytes, m.ours)
    main = m.limits.get("")
    if main is None:
        out |= {"limit_gbps": None, "ratio": None, "limit_unavailable": m.unavailable}
    else:
        out |= {"limit_gbps": _gbps(m.nbytes, main), "ratio": round(paired_ratio(m.ours, main), 3)}
    for key, s in m.limits.items():
        if key:
            out |= limit_fields(key, m.nbytes, m.ours, s)
    return out


def rows(m: Measured, target: float | None) -> list[dict[str, object]]:
    """One ``bench all`` row per limit of ``m``, GB/s, higher is better: the main limit's
    named ``{tier}_{op}_{KiB}k`` with ``target``, a second one's ``..._vs_{key}`` without.
    An unavailable main limit is a row with no limit figure and no ratio, saying why."""
    name = f"{m.tier}_{m.op}_{m.chunk >> 10}k"
    figure = m.nbytes / statistics.median(m.ours) / 1e9
    out: list[dict[str, object]] = []
    if m.unavailable is not None:
        out.append(unavailable_row(name, figure, "GB/s", m.unavailable, target))
    for key, s in m.limits.items():
        row = Row(
            BENCH, f"{name}_vs_{key}" if key else name, figure, "GB/s",
            m.nbytes / statistics.median(s) / 1e9, m.names[key], spread(m.ours, s),
            None if key else target, True,
        )  # fmt: skip
        out.append(row.as_dict())
    return out


def tier_ops(
    tier: Tier, mgr: OffloadManager, bufs: Sequence[torch.Tensor]
) -> tuple[KeyedOp, KeyedOp]:
    """kvplane's side of a lower tier's measurement: store (then load) chunk keys from (into)
    ``bufs`` through ``mgr``'s slots of ``tier``; a full tier or a chunk not read back OK
    raises ``RuntimeError`` (a bench bug, never a figure)."""

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


def cascade_ops(
    c: TierCascade, src: Sequence[BlockId], dst: Sequence[BlockId]
) -> tuple[KeyedOp, KeyedOp]:
    """kvplane's side of the host tier's measurement: store chunk keys from the device blocks
    ``src`` into ``c``'s host slots (then load them into ``dst``), drained before returning; a
    chunk not loaded raises ``RuntimeError`` (a bench bug, never a figure)."""

    def store(keys: list[ChunkKey]) -> None:
        c.store(keys, list(src))
        c.drain()

    def load(keys: list[ChunkKey]) -> None:
        ticket = c.load(keys, list(dst))
        if ticket is None or len(ticket.keys) != len(keys):
            raise RuntimeError("bench host tier lost chunks it was loading")
        c.drain()

    return store, load


def unavailable_row(
    name: str, figure: float, unit: str, why: str, target: float | None
) -> dict[str, object]:
    """A row whose limit could not be measured here: the keys of :meth:`Row.as_dict`, no limit
    figure, no ratio, ``met`` None, and ``limit_name`` saying why."""
    return {
        "bench": BENCH, "row": name, "figure": float(f"{figure:.4g}"), "unit": unit,
        "limit": None, "limit_name": f"unavailable: {why}", "repeats": 0, "ratio_min": None,
        "ratio_median": None, "ratio_max": None, "stable": False, "target": target, "met": None,
    }  # fmt: skip
