"""``--calibrate``: a cluster spec's costs replaced by what ``kvplane bench all --json`` measured.

Reads the document's plain data only (no bench module is imported): the PD transfer from
``bench pd`` (a pipelined slice and the non-pipelined bulk transfer: two sizes, so a per-op
cost and a bandwidth), else from ``bench transport`` (blocks of two sizes); the latency after
an op from ``bench pd``'s non-pipelined tail beyond its op, else ``bench protocol``'s round
trip; each host, disk or remote tier from ``bench offload`` (stores and loads of 256 KiB and
4 MiB chunks); the prefill cost per token from ``bench pd``'s non-pipelined step compute, its
``contention`` from how much slower the pipelined steps were, its ``setup_s`` from what the
non-pipelined TTFT spent outside steps and transfer. A figure the document lacks leaves the
spec's value and is listed in :attr:`Calibrated.missing`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.errors import ConfigError
from kvplane.simulate.spec import ClusterSpec, PrefillSpec, TierSpec, TransportSpec
from kvplane.simulate.timing import contention_of

MODES = ("pipelined", "non_pipelined")
"""``bench pd``'s two fixed modes: slices in flight beside the steps, and none."""
OFFLOAD_CHUNKS = (256, 4096)
"""The chunk sizes (KiB) of ``bench offload``'s rows, ``{tier}_{store|load}_{k}k``."""
OFFLOAD_TIERS = ("host", "disk", "remote")
"""The tiers ``bench offload`` measures (``remote`` is Redis); ``device`` it does not."""
PD_LINKS = {
    "tcp": TransportSpec(bandwidth_bytes_s=3.36e9, rtt_s=1.7e-4, op_overhead_s=5.1e-3),
    "shm": TransportSpec(bandwidth_bytes_s=16.7e9, rtt_s=1.7e-4, op_overhead_s=2.8e-3),
}
"""The PD transfer op cost of each data plane on the 2-core development host: the fit of
:func:`pd_transport_points` to ``kvplane bench pd --quick`` (61-layer MLA slices of 18 MB and
144 MB) and ``bench protocol``'s round trip. ``--pipelining auto``'s default link model."""


@dataclass(frozen=True, slots=True)
class Calibrated:
    """The calibrated spec, what was filled (``"[section] key = value (source)"``) and what
    kept the spec's value for want of a measurement (``"[section] key: why"``)."""

    spec: ClusterSpec
    filled: tuple[str, ...]
    missing: tuple[str, ...]


def fit_op_cost(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(op_overhead_s, bandwidth_bytes_s)`` of ``seconds = overhead + bytes / bandwidth``
    through the smallest and the largest of ``points`` ``(bytes, seconds)``. When the two
    give no positive slope (noise), the largest point alone: no overhead, its own bandwidth;
    a negative intercept is clamped to 0 with the larger point's bandwidth kept."""
    (b0, s0), (b1, s1) = min(points), max(points)
    if b1 > b0 and s1 > s0:
        bandwidth = (b1 - b0) / (s1 - s0)
        overhead = s0 - b0 / bandwidth
        if overhead >= 0:
            return overhead, bandwidth
    return 0.0, b1 / s1


def _benches(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    benches = doc.get("benches")
    if not isinstance(benches, dict):
        raise ConfigError(
            "--calibrate wants `kvplane bench all --json` output (no 'benches' in it)"
        )
    return benches


def _num(value: object) -> float | None:
    """``value`` as a positive finite float, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def pd_modes(benches: Mapping[str, Any], transport: str) -> dict[str, Mapping[str, Any]]:
    """``bench pd``'s synthetic rows of ``transport``, by mode (empty when it did not run)."""
    pd = benches.get("pd")
    modes = pd.get("modes", []) if isinstance(pd, dict) else []
    return {
        str(m.get("mode")): m
        for m in modes
        if isinstance(m, dict) and m.get("transport") == transport and "skipped" not in m
    }


def pd_transport_points(benches: Mapping[str, Any], transport: str) -> list[tuple[float, float]]:
    """``(bytes, seconds)`` of one PD transfer op from ``bench pd``: a pipelined slice (one
    step's KV) and the non-pipelined transfer (every step's, one op); empty if missing."""
    pd, modes = benches.get("pd"), pd_modes(benches, transport)
    work = pd.get("workload", {}) if isinstance(pd, dict) else {}
    slice_bytes, tokens, step = (_num(work.get(k)) for k in ("slice_bytes", "tokens", "step"))
    if slice_bytes is None or tokens is None or step is None:
        return []
    sizes = {"pipelined": slice_bytes, "non_pipelined": slice_bytes * math.ceil(tokens / step)}
    points = []
    for mode, nbytes in sizes.items():
        ms = _num(modes.get(mode, {}).get("slice_transfer_ms"))
        if ms is not None:
            points.append((nbytes, ms / 1e3))
    return points if len(points) == 2 else []


def pd_lag_s(benches: Mapping[str, Any], transport: str) -> float | None:
    """The PD transfer's latency beyond its op, seconds: ``bench pd``'s non-pipelined
    ``exposed_tail_ms`` (prefill end to decode ready) less its one op's ``slice_transfer_ms``
    -- the hand-off before the op is submitted and the landing after it is done (about 1.4 and
    1.6 ms here, together some 15-20x ``bench protocol``'s round trip); None without both or if
    not positive."""
    bulk = pd_modes(benches, transport).get("non_pipelined", {})
    tail, busy = _num(bulk.get("exposed_tail_ms")), _num(bulk.get("slice_transfer_ms"))
    if tail is None or busy is None or tail <= busy:
        return None
    return (tail - busy) / 1e3


def transport_bench_points(benches: Mapping[str, Any], transport: str) -> list[tuple[float, float]]:
    """``(bytes, seconds)`` of one block from ``bench transport``'s rows of ``transport``."""
    bench = benches.get("transport")
    rows = bench.get("results", []) if isinstance(bench, dict) else []
    points = []
    for r in rows:
        if isinstance(r, dict) and r.get("transport") == transport:
            block, gbps = _num(r.get("block_bytes")), _num(r.get("gbps"))
            if block is not None and gbps is not None:
                points.append((block, block / (gbps * 1e9)))
    return points


def offload_points(benches: Mapping[str, Any], tier: str) -> list[tuple[float, float]]:
    """``(bytes, seconds)`` of one chunk of ``tier`` per :data:`OFFLOAD_CHUNKS` size: the mean
    of its store and its load (the simulator has one lane per tier for both); a size lacking
    either is left out."""
    bench = benches.get("offload")
    rows = bench.get("rows", []) if isinstance(bench, dict) else []
    gbps = {r.get("row"): _num(r.get("figure")) for r in rows if isinstance(r, dict)}
    points: list[tuple[float, float]] = []
    for kib in OFFLOAD_CHUNKS:
        nbytes = float(kib * 1024)
        got = [gbps.get(f"{tier}_{op}_{kib}k") for op in ("store", "load")]
        if all(g is not None for g in got):
            points.append((nbytes, sum(nbytes / (g * 1e9) for g in got if g) / 2))
    return points


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """``[prefill]`` from ``bench pd``: seconds per token of a step with no transfer beside
    it, the ``contention`` of steps computed while slices are sent, the ``setup_s`` outside
    steps and transfer, and the rows' source."""

    token_s: float
    contention: float
    setup_s: float
    source: str


def _step_cost(rows: Mapping[str, Any], step: float, steps: int, source: str) -> PrefillCost | None:
    """The cost from one set of mode rows: the non-pipelined row's ``step_compute_ms`` is the
    quiet step, the pipelined row's the busy one (either alone: no contention); the setup is
    what the non-pipelined TTFT leaves after its steps and its exposed tail (0 if unknown)."""
    busy, quiet = (_num(rows.get(m, {}).get("step_compute_ms")) for m in MODES)
    if quiet is None:
        quiet = busy
    if quiet is None:
        return None
    contention = contention_of(busy, quiet, steps) if busy is not None else 0.0
    bulk = rows.get("non_pipelined", {})
    ttft, tail = _num(bulk.get("ttft_ms")), _num(bulk.get("exposed_tail_ms"))
    setup_ms = 0.0
    if ttft is not None and tail is not None and busy is not None:
        setup_ms = max(0.0, ttft - steps * quiet - tail)
    return PrefillCost(quiet / 1e3 / step, contention, setup_ms / 1e3, source)


def prefill_cost(benches: Mapping[str, Any], transport: str) -> PrefillCost | None:
    """``bench pd``'s real-model rows when they ran (full runs), else its synthetic workload's
    rows of ``transport``: each mode's measured ``step_compute_ms`` over the step's tokens
    (:func:`_step_cost`); None when ``bench pd`` did not run or measured no step."""
    pd = benches.get("pd")
    if not isinstance(pd, dict):
        return None
    model = pd.get("model")
    if isinstance(model, dict):
        real = {str(m.get("mode")): m for m in model.get("modes", []) if isinstance(m, dict)}
        step, tokens = _num(model.get("step")), _num(model.get("tokens"))
        if step is not None:
            steps = math.ceil((tokens or step) / step)
            got = _step_cost(real, step, steps, f"bench pd {model.get('model')} step")
            if got is not None:
                return got
    work = pd.get("workload", {})
    step = _num(work.get("step")) if isinstance(work, dict) else None
    tokens = _num(work.get("tokens")) if isinstance(work, dict) else None
    if step is None:
        return None
    steps = math.ceil((tokens or step) / step)
    modes = pd_modes(benches, transport)
    return _step_cost(modes, step, steps, f"bench pd {transport} synthetic step")


def default_transport(benches: Mapping[str, Any]) -> str:
    """The transport ``bench pd`` ran first, else ``tcp``."""
    pd = benches.get("pd")
    for m in pd.get("modes", []) if isinstance(pd, dict) else []:
        if isinstance(m, dict) and "skipped" not in m and isinstance(m.get("transport"), str):
            return str(m["transport"])
    return "tcp"


class _Log:
    def __init__(self) -> None:
        self.filled: list[str] = []
        self.missing: list[str] = []

    def fill(self, key: str, value: float, source: str) -> float:
        self.filled.append(f"{key} = {value:.6g} ({source})")
        return value


def _transport(
    spec: TransportSpec, benches: Mapping[str, Any], name: str, log: _Log
) -> TransportSpec:
    points, source = pd_transport_points(benches, name), f"bench pd {name}"
    if not points:
        points, source = transport_bench_points(benches, name), f"bench transport {name}"
    out: dict[str, float] = {}
    if points:
        overhead, bandwidth = fit_op_cost(points)
        out["op_overhead_s"] = log.fill("[transport] op_overhead_s", overhead, source)
        out["bandwidth_bytes_s"] = log.fill("[transport] bandwidth_bytes_s", bandwidth, source)
    else:
        log.missing.append(f"[transport] bandwidth_bytes_s, op_overhead_s: no {name} figures")
    lag = pd_lag_s(benches, name)
    protocol = benches.get("protocol")
    rtt = _num(protocol.get("rtt_us")) if isinstance(protocol, dict) else None
    if lag is not None:
        out["rtt_s"] = log.fill("[transport] rtt_s", lag, f"bench pd {name} non-pipelined lag")
    elif rtt is not None:
        out["rtt_s"] = log.fill("[transport] rtt_s", rtt / 1e6, "bench protocol rtt_us")
    else:
        log.missing.append("[transport] rtt_s: no bench pd tail nor bench protocol rtt_us")
    return dataclasses.replace(spec, **out)


def _tier(spec: TierSpec, benches: Mapping[str, Any], log: _Log) -> TierSpec:
    section = f"[tiers.{spec.name}]"
    points = offload_points(benches, spec.name) if spec.name in OFFLOAD_TIERS else []
    if not points:
        log.missing.append(f"{section} bandwidth_bytes_s, op_overhead_s: no bench offload rows")
        return spec
    overhead, bandwidth = fit_op_cost(points)
    source = f"bench offload {spec.name}"
    return dataclasses.replace(
        spec,
        op_overhead_s=log.fill(f"{section} op_overhead_s", overhead, source),
        bandwidth_bytes_s=log.fill(f"{section} bandwidth_bytes_s", bandwidth, source),
    )


def _prefill(spec: PrefillSpec, benches: Mapping[str, Any], name: str, log: _Log) -> PrefillSpec:
    got = prefill_cost(benches, name)
    if got is None:
        log.missing.append("[prefill] token_s, contention, setup_s: no bench pd step compute")
        return spec
    return dataclasses.replace(
        spec,
        token_s=log.fill("[prefill] token_s", got.token_s, got.source + " (non-pipelined)"),
        contention=log.fill("[prefill] contention", got.contention, got.source + " (pipelined)"),
        setup_s=log.fill("[prefill] setup_s", got.setup_s, got.source + " (non-pipelined TTFT)"),
        pair_s=log.fill("[prefill] pair_s", 0.0, "folded into token_s"),
        step_s=log.fill("[prefill] step_s", 0.0, "folded into token_s"),
    )


def calibrate(
    spec: ClusterSpec, doc: Mapping[str, Any], transport: str | None = None
) -> Calibrated:
    """``spec`` with the figures of ``doc`` (``kvplane bench all --json``) in place of its own:
    ``[transport]`` from ``transport``'s figures (default: the one ``bench pd`` ran first),
    each host/disk/remote tier, ``[prefill]``. ``[decode]`` and a device tier are never
    measured here and always listed missing. ``ConfigError`` when ``doc`` is not that output."""
    benches = _benches(doc)
    name = transport or default_transport(benches)
    log = _Log()
    new = dataclasses.replace(
        spec,
        transport=_transport(spec.transport, benches, name, log),
        tiers=tuple(_tier(t, benches, log) for t in spec.tiers),
        prefill=_prefill(spec.prefill, benches, name, log),
    )
    log.missing.append("[decode] token_s, ctx_token_s: no bench measures decode per token")
    return Calibrated(new, tuple(log.filled), tuple(log.missing))
