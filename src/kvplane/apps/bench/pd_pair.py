"""The worker processes ``kvplane bench pd`` times: a prefill and a decode ``kvplane serve``
process and a router (:class:`Pair`), the bench's prompts, and the loop that serves the same
requests through a pipelined and a non-pipelined pair alternately until their TTFT ratio is
stable (:func:`interleaved`, :func:`compare_modes`).

Owns the processes it starts (stopped on :meth:`Pair.close`); derives nothing from timelines
beyond collecting them (:mod:`.pd_metrics` does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvplane.apps.bench.pd_metrics import TIME_FIELDS, median_or_none, request_fields
from kvplane.apps.bench.spread import repeat_until_stable
from kvplane.apps.demo_procs import Child, ProcessGroup, new_secret
from kvplane.errors import KVPlaneError
from kvplane.pipeline.timeline import request_times
from kvplane.pipeline.trace import events_from_dicts
from kvplane.serving.router.router import Router
from kvplane.serving.worker_config import SECRET_TRANSPORTS

VOCAB = 30_000
"""Token ids of the synthetic workload's prompts lie in ``[0, VOCAB)``."""
MODES = ("pipelined", "non_pipelined", "auto")
"""The pairs' modes: ``auto`` is ``--pipelining auto`` (the cost model's choice per request)."""
FIXED_MODES = MODES[:2]
MODE_FLAGS = {"pipelined": ("--pipelining", "on"), "non_pipelined": ("--pipelining", "off"),
              "auto": ("--pipelining", "auto")}  # fmt: skip
"""Each mode named explicitly: ``kvplane serve``'s default is ``auto``."""
START_TIMEOUT_S = 90.0
"""Seconds a pair's processes may take to announce themselves (starting together on a loaded
2-core host, each imports torch)."""


class Group(Protocol):
    """Worker processes of one mode that serve the bench's requests: a :class:`Pair`, or a
    layout's ranks (:class:`~kvplane.apps.bench.pd_ranks.Ranks`)."""

    tokens: dict[str, tuple[int, ...]]

    def connect(self) -> None: ...

    def run(self, rid: str, tokens: list[int], step: int) -> float: ...

    def times(self, rids: Sequence[str]) -> tuple[list[dict[str, float | None]], int]: ...

    def close(self) -> None: ...


Start = Callable[[Path, str], Group]
"""Starts a :class:`Group` of one mode in a work directory, without waiting for it."""


def connect_router(group: ProcessGroup, timeout_s: float = START_TIMEOUT_S) -> Router:
    """A router over ``group``'s ``prefill`` and ``decode`` workers, once both announced (at
    most ``timeout_s``) and connected; ``group`` is stopped when that fails."""
    deadline = time.monotonic() + timeout_s
    try:
        pre, dec = (group.children[r].announce(deadline) for r in ("prefill", "decode"))
        router = Router(
            [str(pre["control"])], [str(dec["control"])], timeout_s=120.0, secret=group.secret
        )
        router.connect()
    except BaseException:
        group.stop()
        raise
    return router


@dataclass(frozen=True, slots=True)
class PairSpec:
    """One pair's workload: transport, tokens per prompt, prefill step, and the producer's
    ``kvplane serve`` flags (the synthetic layout and compute, or ``--model``)."""

    transport: str
    tokens: int
    step: int
    num_blocks: int
    producer: tuple[str, ...] = field(default=())


class Pair:
    """A prefill and a decode worker process (one mode, one producer) and a router.

    Both processes start at once (their imports overlap); with ``wait=False`` the pair is
    usable only after :meth:`connect`, so that several pairs can start together."""

    def __init__(self, work: Path, spec: PairSpec, *, mode: str, wait: bool = True) -> None:
        work.mkdir(parents=True, exist_ok=True)
        # nixl and mooncake cannot authenticate their data plane: run them --insecure, saying so
        secure = spec.transport in SECRET_TRANSPORTS
        self.group = ProcessGroup(work, new_secret() if secure else None)
        self.tokens: dict[str, tuple[int, ...]] = {}
        common = [
            "--transport", spec.transport, "--block-size", "16",
            "--num-blocks", str(spec.num_blocks), "--num-slots", "4",
            "--step-size", str(spec.step), *spec.producer,
            "--slice-timeout", "60", "--deadline", "120", "--heartbeat", "1", "--lease", "10",
            *([] if secure else ["--insecure"]),
        ]  # fmt: skip
        common.extend(MODE_FLAGS[mode])
        self.router: Router | None = None
        try:
            for role in ("prefill", "decode"):
                child = Child(role, ["--name", role, *common], work, self.group.secret)
                self.group.children[role] = child
            if wait:
                self.connect()
        except BaseException:
            self.group.stop()
            raise

    def connect(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait for both processes' announce lines (at most ``timeout_s``), then connect the
        router; the group is stopped when that fails."""
        self.router = connect_router(self.group, timeout_s)

    def _routed(self) -> Router:
        if self.router is None:
            raise KVPlaneError("bench pair used before connect()")
        return self.router

    def run(self, rid: str, tokens: list[int], step: int) -> float:
        """Serve one request; its TTFT (submit → first token ready on the decode side), ms.
        Its tokens are kept in :attr:`tokens`. :class:`KVPlaneError` when it did not succeed
        or a verifying decoder counted mismatches."""
        self.group.check(f"serving {rid}")
        t0 = time.monotonic()
        res = self._routed().generate(rid, tokens, step_size=step)
        if res.state != "success" or res.mismatches not in (None, 0):
            raise KVPlaneError(f"bench request {rid} ended {res.state} ({res.reason})")
        self.tokens[rid] = res.tokens
        return (res.ready_at - t0) * 1e3

    def times(self, rids: Sequence[str]) -> tuple[list[dict[str, float | None]], int]:
        """Per request, :data:`~.pd_metrics.TIME_FIELDS` from both workers' timelines (one
        monotonic clock on this host), and the events the workers left out (when not 0, every
        field is None: a request's events may be incomplete)."""
        stats = self._routed().stats(timeline=True)
        truncated = sum(w.timeline_truncated for w in stats.values())
        events = events_from_dicts(e for w in stats.values() for e in w.timeline)
        out = [
            request_fields(
                request_times(e for e in events if e.request_id == rid), truncated=truncated > 0
            )
            for rid in rids
        ]
        return out, truncated

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        self.group.stop()


def prompt(i: int, num_tokens: int, vocab: int = VOCAB) -> list[int]:
    """The tokens of bench request ``i`` (``i < 0``: a warm-up request), ids in ``[0,
    vocab)``. Prompts of different ``i`` differ from their first token on, so no request finds
    another's KV in the decode side's prefix cache (a hit moves only the rest: a calibration
    request that repeated the warm-up's tokens once timed a near-empty slice)."""
    start = (i + 1) * 7919 % vocab if i >= 0 else vocab + i
    return [(start + t) % vocab for t in range(num_tokens)]


@dataclass(frozen=True, slots=True)
class Interleaved:
    """What :func:`interleaved` served: the request ids and each mode's TTFTs (ms), paired."""

    rids: list[str]
    ttft_ms: dict[str, list[float]]


def interleaved(
    pairs: dict[str, Group],
    spec: PairSpec,
    repeats: tuple[int, int],
    cap_s: float,
    vocab: int = VOCAB,
) -> Interleaved:
    """One warm-up request per pair, then request ``i`` through the pipelined pair and at once
    through the non-pipelined one (so load changes hit both modes alike), and the ``auto``
    pair if there is one, until the paired pipelined / non-pipelined TTFT ratio is stable
    after ``repeats[0]`` requests, or ``repeats[1]`` ran, or ``cap_s`` passed
    (:func:`~.spread.repeat_until_stable`)."""
    for pair in pairs.values():
        pair.run("warm", prompt(-1, spec.step, vocab), spec.step)
    rids: list[str] = []
    ttft: dict[str, list[float]] = {mode: [] for mode in pairs}

    def both() -> tuple[float, float]:
        rid = f"r{len(rids)}"
        tokens = prompt(len(rids), spec.tokens, vocab)
        rids.append(rid)
        for mode, pair in pairs.items():
            ttft[mode].append(pair.run(rid, tokens, spec.step))
        return ttft["pipelined"][-1] / 1e3, ttft["non_pipelined"][-1] / 1e3

    low, high = repeats
    repeat_until_stable(both, min_repeats=low, max_repeats=high, cap_s=cap_s)
    return Interleaved(rids, ttft)


def compare_modes(
    work: Path,
    spec: PairSpec,
    repeats: tuple[int, int],
    cap_s: float,
    vocab: int = VOCAB,
    *,
    modes: Sequence[str] = MODES,
    start: Start | None = None,
) -> tuple[Interleaved, dict[str, tuple[list[dict[str, float | None]], int]], bool]:
    """Serve the same requests through a group per mode of ``modes`` (the two fixed ones
    first; :func:`~.pd_pair.interleaved`), a :class:`Pair` of ``spec`` unless ``start`` makes
    another; the TTFTs, each mode's per-request timeline fields with its truncated-event
    count, and whether every mode decoded the same tokens."""
    pairs: dict[str, Group] = {}
    make = start or (lambda at, mode: Pair(at, spec, mode=mode, wait=False))
    try:
        for mode in modes:  # all the processes start at once
            pairs[mode] = make(work / mode, mode)
        for pair in pairs.values():
            pair.connect()
        served = interleaved(pairs, spec, repeats, cap_s, vocab)
        times = {mode: pair.times(served.rids) for mode, pair in pairs.items()}
        first = pairs[MODES[0]].tokens
        same = all(p.tokens[r] == first[r] for p in pairs.values() for r in served.rids)
    finally:
        for pair in pairs.values():
            pair.close()
    return served, times, same


def mode_rows(
    transport: str,
    served: Interleaved,
    times: dict[str, tuple[list[dict[str, float | None]], int]],
    *,
    layout: str = "1->1",
) -> list[dict[str, Any]]:
    """One row per mode of ``layout`` (:data:`~.pd_ranks.LAYOUTS`' names): the median TTFT and
    timeline fields, and the events left out."""
    rows = []
    for mode, (got, truncated) in times.items():
        row: dict[str, Any] = {"transport": transport, "layout": layout, "mode": mode}
        row["ttft_ms"] = median_or_none(served.ttft_ms[mode])
        for key in TIME_FIELDS:
            row[key] = median_or_none([r[key] for r in got])
        row["timeline_truncated"] = truncated
        rows.append(row)
    return rows
