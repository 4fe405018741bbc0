"""``kvplane bench pd``: pipelined vs non-pipelined prefill→decode transfer, per transport.

Runs real ``kvplane serve`` worker processes on a calibrated DeepSeek-V3-deep synthetic
workload (a step's compute is a sleep: ``compute_model``), on the tiny real model
(:mod:`.pd_model`) and with the prefill split over TP or PP ranks (:mod:`.pd_layouts`), and
reports TTFT, exposed tail and overlap from their timelines, the TTFT ratio paired request by
request. Workload, calibration, limit and verdicts: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.apps.bench.pd_layouts import layout_result
from kvplane.apps.bench.pd_metrics import (
    TARGET_DEFINITIONS,
    TTFT_RATIO_MAX,
    bench_rows,
    calibration,
    median_or_none,
    memcpy_slice_ms,
    targets,
)
from kvplane.apps.bench.pd_model import COMPUTE_MODEL, model_result
from kvplane.apps.bench.pd_pair import Pair, PairSpec, compare_modes, mode_rows, prompt
from kvplane.apps.bench.pd_ranks import BASE_LAYOUT
from kvplane.apps.bench.spread import Row, paired_ratio, spread_of
from kvplane.errors import KVPlaneError
from kvplane.transports.registry import available

NAME = "pd"
DEEPSEEK_V3_LAYERS = 61
"""The default layer count: with a real model's depth a slice's transfer is dominated by its
bytes, not by the fixed per-slice cost (planning, control round trips) that a toy depth
exaggerates."""
CALIBRATION_REQUESTS = 9
"""One-step requests whose median slice sets the step compute (it is cheap: a few ms each;
with five, tcp's calibrated step read 11, 24 and 16 ms in three runs on this shared host)."""
CAP_S = {True: 10.0, False: 60.0}
"""Seconds the requests of one comparison may keep repeating for a stable TTFT ratio (after
``--requests``, at most twice as many), per ``--quick``."""
TRANSPORTS = {True: "tcp", False: "tcp,shm"}
"""Default ``--transports`` per ``--quick`` (each transport starts six worker processes)."""
MODEL_ROWS = {True: False, False: True}
NO_MODEL_IN_QUICK = "full run only (not in --quick)"
"""Whether the real-model comparison runs (four more worker processes), per ``--quick``."""
HELP = "Pipelined vs non-pipelined PD transfer: TTFT, exposed tail, overlap (tcp, shm)."
AUTO_RATIO_MAX = 1.1
"""Target: ``--pipelining auto``'s TTFT within 10% (this host's noise) of the better fixed
mode's, paired request by request."""


@dataclass(frozen=True, slots=True)
class _Spec:
    transport: str
    requests: int
    tokens: int
    step: int
    layers: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--transports", default=None,
        help="comma-separated transports (default: tcp,shm; with --quick tcp)",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--no-model", action="store_true", help="skip the real-model rows")
    parser.add_argument(
        "--layouts", action=argparse.BooleanOptionalAction, default=None,
        help="the TP 2->1 and PP 2->1 layout rows (default: on, off with --quick)",
    )  # fmt: skip


def _synthetic(spec: _Spec, compute_ms: float) -> PairSpec:
    """The pair of the synthetic workload: MLA 512 + 64 bf16 KV of ``spec.layers`` layers, a
    step's compute a sleep of ``compute_ms`` after its KV's streaming-store write."""
    producer = (
        "--layout", "mla", "--layers", str(spec.layers), "--latent-dim", "512",
        "--rope-dim", "64", "--compute-ms-per-step", f"{compute_ms:.4f}",
    )  # fmt: skip
    blocks = 2 * -(-spec.tokens // 16) + 8
    return PairSpec(spec.transport, spec.tokens, spec.step, blocks, producer)


def _calibrate(work: Path, spec: _Spec) -> float:
    """One step's transfer time, ms: the median slice of :data:`CALIBRATION_REQUESTS` one-step
    requests, no compute."""
    pair = Pair(work / "calibrate", _synthetic(spec, 0.0), mode="pipelined")
    try:
        pair.run("warm", prompt(-1, spec.step), spec.step)
        rids = [f"cal{i}" for i in range(CALIBRATION_REQUESTS)]
        for i, rid in enumerate(rids):
            pair.run(rid, prompt(i, spec.step), spec.step)
        got = median_or_none([r["slice_transfer_ms"] for r in pair.times(rids)[0]])
    finally:
        pair.close()
    if got is None or got <= 0:
        raise KVPlaneError("bench pd calibration: the one-step requests' timelines hold no slice")
    return got


def _transport_rows(
    spec: _Spec, work: Path, quick: bool
) -> tuple[list[dict[str, Any]], float, list[dict[str, object]]]:
    per_slice = _calibrate(work, spec)
    pair_spec = _synthetic(spec, per_slice)
    served, times, _same = compare_modes(
        work, pair_spec, (spec.requests, 2 * spec.requests), CAP_S[quick]
    )
    rows = mode_rows(spec.transport, served, times)
    ttft = served.ttft_ms
    rows[0]["ttft_ratio"] = round(ttft_ratio(ttft["pipelined"], ttft["non_pipelined"]), 4)
    rows[0]["requests"] = len(served.rids)
    steps = -(-spec.tokens // spec.step)  # the non-pipelined mode's one slice holds every step
    bulk_slice = rows[1]["slice_transfer_ms"]
    bulk = None if bulk_slice is None else bulk_slice / steps
    rows[1]["per_step_transfer_ms"] = None if bulk is None else round(bulk, 4)
    rows[0]["zero_stretch_ttft_ratio"] = (
        None if bulk is None else round(zero_stretch_ratio(steps, per_slice, bulk), 4)
    )
    lines = bench_rows(spec.transport, ttft, times["pipelined"][0], ttft_target=TTFT_RATIO_MAX)
    if "auto" in ttft:
        lines.append(auto_row(spec.transport, ttft))
        rows[2]["ttft_vs_best_fixed"] = lines[-1]["ratio_median"]
    return rows, per_slice, lines


def auto_row(transport: str, ttft_ms: Mapping[str, Sequence[float]]) -> dict[str, object]:
    """The ``bench all`` row of ``--pipelining auto``: its TTFT against the better of the two
    fixed modes, request by request (``auto_i / min(pipelined_i, non_pipelined_i)``), target
    :data:`AUTO_RATIO_MAX` (lower is better)."""
    auto, p, n = ttft_ms["auto"], ttft_ms["pipelined"], ttft_ms["non_pipelined"]
    best = [min(a, b) for a, b in zip(p, n, strict=True)]
    ratios = spread_of([a / b for a, b in zip(auto, best, strict=True)])
    return Row(
        "pd", f"{transport}_ttft_auto_vs_best_fixed", statistics.median(auto), "ms",
        statistics.median(best), "the better fixed mode", ratios, AUTO_RATIO_MAX, False,
    ).as_dict() | {"layout": BASE_LAYOUT}  # fmt: skip


def zero_stretch_ratio(steps: int, step_ms: float, bulk_step_ms: float) -> float:
    """The pipelined / non-pipelined TTFT ratio if nothing stretched: ``steps`` steps of
    ``step_ms`` then one lone slice (calibrated to take ``step_ms`` too), against the same
    steps then a bulk transfer of ``bulk_step_ms`` per step. Costs both modes share (the
    order's hand-off, the decode side's last hop) are left out, so the ratio reachable on the
    host is at least this; a lone slice's fixed costs (control round trips, thread wake-ups)
    raise it, since they set the step but vanish from the bulk transfer."""
    return (steps + 1) * step_ms / (steps * (step_ms + bulk_step_ms))


def ttft_ratio(pipelined_ms: Sequence[float], non_pipelined_ms: Sequence[float]) -> float:
    """Pipelined TTFT / non-pipelined TTFT: the median of the per-request ratios. Request ``i``
    ran in both modes back to back (interleaved), under the same machine load; on a shared host
    the load drifts between requests, and a ratio of the two medians would divide TTFTs taken
    under different conditions. Equal-length, positive sequences. It is
    :func:`~kvplane.apps.bench.common.paired_ratio` with the non-pipelined run as "ours" and the
    pipelined one as the "limit" (both are times: the median of ``pipelined / non_pipelined``)."""
    return paired_ratio(non_pipelined_ms, pipelined_ms)


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    n_req = args.requests or (4 if quick else 8)
    n_tok = args.tokens or (2048 if quick else 4096)
    step = args.step or (256 if quick else 512)
    layers = args.layers or DEEPSEEK_V3_LAYERS
    usable = available()
    modes: list[dict[str, Any]] = []
    lines: list[dict[str, object]] = []
    targets_by: dict[str, dict[str, bool]] = {}
    calibrations: dict[str, dict[str, object]] = {}
    slice_bytes = step * layers * 576 * 2
    ran: list[str] = []
    chosen = getattr(args, "transports", None) or TRANSPORTS[quick]
    for transport in [t.strip() for t in chosen.split(",") if t.strip()]:
        reason = usable.get(transport, "unknown transport")
        if reason is not None:
            modes.append({"transport": transport, "skipped": reason})
            continue
        with tempfile.TemporaryDirectory(prefix="kvplane-bench-pd-") as work:
            got, calib_ms, rows = _transport_rows(
                _Spec(transport, n_req, n_tok, step, layers), Path(work), quick
            )
        modes.extend(got)
        lines.extend(rows)
        ran.append(transport)
        targets_by[transport] = targets(got[0])
        calibrations[transport] = calibration(got[0], calib_ms)
    model: dict[str, Any] | None = None
    if ran and MODEL_ROWS[quick] and not getattr(args, "no_model", False):
        model = model_result(ran[0], n_tok, step, (n_req, 2 * n_req), CAP_S[quick])
        lines.extend(model["rows"])
    layouts: dict[str, Any] | None = None
    want_layouts = getattr(args, "layouts", None)
    if ran and (not quick if want_layouts is None else want_layouts):
        layouts = layout_result(ran[0], n_tok, step, (n_req, 2 * n_req), CAP_S[quick])
        lines.extend(layouts["rows"])
    block_bytes = 16 * layers * 576 * 2  # the workers' block: 16 tokens, every layer
    memcpy_ms, scattered_ms = memcpy_slice_ms(
        slice_bytes, block_bytes if step % 16 == 0 else slice_bytes
    )
    return {
        "rows": lines,
        "compute_model": COMPUTE_MODEL,
        "workload": {
            "requests": n_req,
            "tokens": n_tok,
            "step": step,
            "layers": layers,
            "layout": "mla 512+64 bf16",
            "slice_bytes": slice_bytes,
        },
        "memcpy_slice_ms": memcpy_ms,
        "memcpy_slice_scattered_ms": scattered_ms,
        "modes": modes,
        "model": model,
        "layouts": layouts,
        **({} if MODEL_ROWS[quick] else {"model_skipped": NO_MODEL_IN_QUICK}),
        "calibration": calibrations,
        "targets": targets_by,
        "target_definitions": TARGET_DEFINITIONS,
    }
