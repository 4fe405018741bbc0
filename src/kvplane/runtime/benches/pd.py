"""``kvplane bench pd``: pipelined vs non-pipelined prefill→decode transfer, per transport.

One workload (default 8 requests × 4,096 tokens, DeepSeek-V3's MLA layout -- 61 layers of 512
+ 64 bf16 -- steps of 512 tokens, so a slice is 36 MB; ``--quick``: 4 × 2,048 with steps of
256) runs through a real prefill worker process and decode worker process (``kvplane serve``,
real sockets, the named transport; a router in this process), once *pipelined* (a slice after
every step) and once *non-pipelined* (everything after the prefill ends). Separate processes,
as deployed: in one interpreter the two workers' threads would queue on one GIL. Workers run
with one torch thread each (two share this host), so their transports copy on one thread too;
``--copy-threads`` would change that (measured on 2 cores: a lone shm slice 7.5 -> 6.7 ms, but
tcp's pipelined TTFT ratio 0.62 -> 0.74, its copies then fighting the socket's).

Calibration first measures one step's transfer time (the median of nine one-step requests on a
pair without compute); the two measured pairs then spend that long per step
(``--compute-ms-per-step``), so per-step compute ≈ per-step transfer — the regime where
pipelining matters most. Requests run one at a time, the two modes interleaved (load changes on
a shared machine hit both alike); rows report medians.

Per (transport, mode) row: ``ttft_ms`` (submit → first token ready on the decode side),
``exposed_tail_ms`` (last prefill step end → decode ready), ``overlap_ratio`` (transfer time
hidden under prefill compute / transfer time), ``slice_transfer_ms`` (one slice's transfer),
all from the workers' timelines; plus ``memcpy_slice_ms``, the physical limit (copying one
slice's bytes in memory). The pipelined row adds ``ttft_ratio``, pipelined / non-pipelined TTFT
paired request by request (:func:`ttft_ratio`); the non-pipelined row adds
``per_step_transfer_ms``, its one slice's transfer divided by the steps it holds -- one step's
share of a bulk transfer, against the calibrated step (a lone slice, fixed costs included), the
two numbers that bound the ratio: ``zero_stretch_ttft_ratio`` (:func:`zero_stretch_ratio`) is
the least ``ttft_ratio`` they allow, if no step stretched and no slice waited. Targets (reported
as booleans): pipelined exposed tail ≤ 1.5 × slice transfer, ``ttft_ratio`` ≤ 0.7, overlap ratio
≥ 0.8.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvplane.runtime.benches import paired_ratio
from kvplane.runtime.demo_procs import ProcessGroup
from kvplane.runtime.router import Router
from kvplane.runtime.timeline import request_times
from kvplane.runtime.trace import events_from_dicts
from kvplane.transports.registry import available

NAME = "pd"
DEEPSEEK_V3_LAYERS = 61
"""The default layer count: with a real model's depth a slice's transfer is dominated by its
bytes, not by the fixed per-slice cost (planning, control round trips) that a toy depth
exaggerates."""
CALIBRATION_REQUESTS = 9
"""One-step requests whose median slice sets the step compute (it is cheap: a few ms each;
with five, tcp's calibrated step read 11, 24 and 16 ms in three runs on this shared host)."""
VOCAB = 30_000
"""Token ids of the bench prompts lie in ``[0, VOCAB)``."""
HELP = "Pipelined vs non-pipelined PD transfer: TTFT, exposed tail, overlap (tcp, shm)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transports", default="tcp,shm", help="comma-separated transports")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)


@dataclass(frozen=True, slots=True)
class _Spec:
    transport: str
    requests: int
    tokens: int
    step: int
    layers: int


class _Pair:
    """A prefill and a decode worker process (one mode, one compute time) and a router."""

    def __init__(self, work: Path, spec: _Spec, compute_ms: float, *, pipelined: bool) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.group = ProcessGroup(work)
        common = [
            "--transport", spec.transport, "--layout", "mla", "--layers", str(spec.layers),
            "--latent-dim", "512", "--rope-dim", "64", "--block-size", "16",
            "--num-blocks", str(2 * -(-spec.tokens // 16) + 8), "--num-slots", "4",
            "--step-size", str(spec.step), "--compute-ms-per-step", f"{compute_ms:.4f}",
            "--slice-timeout", "60", "--deadline", "120", "--heartbeat", "1", "--lease", "10",
        ]  # fmt: skip
        if not pipelined:
            common.append("--no-pipeline")
        deadline = time.monotonic() + 60.0
        try:
            pre = self.group.start("prefill", ["--name", "prefill", *common], deadline)
            dec = self.group.start("decode", ["--name", "decode", *common], deadline)
            self.router = Router([str(pre["control"])], [str(dec["control"])], timeout_s=120.0)
            self.router.connect()
        except BaseException:
            self.group.stop()
            raise

    def run(self, rid: str, tokens: list[int], step: int) -> float:
        """Serve one request; its TTFT (submit → first token ready on the decode side), ms."""
        self.group.check(f"serving {rid}")
        t0 = time.monotonic()
        res = self.router.generate(rid, tokens, step_size=step)
        if res.state != "success" or res.mismatches != 0:
            raise RuntimeError(f"bench request {rid} ended {res.state} ({res.reason})")
        return (res.ready_at - t0) * 1e3

    def times(self, rids: list[str]) -> list[dict[str, float]]:
        """Exposed tail, overlap and mean slice transfer of each request, from both workers'
        timelines (one monotonic clock on this host)."""
        stats = self.router.stats(timeline=True)
        events = events_from_dicts(e for w in stats.values() for e in w.timeline)
        out = []
        for rid in rids:
            t = request_times(e for e in events if e.request_id == rid)
            out.append({
                "exposed_tail_ms": (t.exposed_tail_s or 0.0) * 1e3,
                "overlap_ratio": t.overlap_ratio,
                "slice_transfer_ms": statistics.mean(t.slice_transfer_s or (0.0,)) * 1e3,
            })  # fmt: skip
        return out

    def close(self) -> None:
        self.router.close()
        self.group.stop()


def _memcpy_ms(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _median(runs: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 4)


def prompt(i: int, num_tokens: int) -> list[int]:
    """The tokens of bench request ``i`` (``i < 0``: a warm-up request). Prompts of different
    ``i`` differ from their first token on, so no request finds another's KV in the decode
    side's prefix cache (a hit moves only the rest: a calibration request that repeated the
    warm-up's tokens once timed a near-empty slice)."""
    start = (i + 1) * 7919 % VOCAB if i >= 0 else VOCAB + i
    return [(start + t) % VOCAB for t in range(num_tokens)]


def _calibrate(work: Path, spec: _Spec) -> float:
    """One step's transfer time, ms: the median slice of :data:`CALIBRATION_REQUESTS` one-step
    requests, no compute."""
    pair = _Pair(work / "calibrate", spec, 0.0, pipelined=True)
    try:
        pair.run("warm", prompt(-1, spec.step), spec.step)
        rids = [f"cal{i}" for i in range(CALIBRATION_REQUESTS)]
        for i, rid in enumerate(rids):
            pair.run(rid, prompt(i, spec.step), spec.step)
        return statistics.median(r["slice_transfer_ms"] for r in pair.times(rids))
    finally:
        pair.close()


def _transport_rows(spec: _Spec, work: Path) -> tuple[list[dict[str, Any]], float]:
    per_slice = _calibrate(work, spec)
    pairs: dict[str, _Pair] = {}
    try:
        for mode in ("pipelined", "non_pipelined"):
            pairs[mode] = _Pair(work / mode, spec, per_slice, pipelined=mode == "pipelined")
        ttft: dict[str, list[float]] = {mode: [] for mode in pairs}
        for pair in pairs.values():
            pair.run("warm", prompt(-1, spec.step), spec.step)
        for i in range(spec.requests):  # interleaved, so load changes hit both modes alike
            tokens = prompt(i, spec.tokens)
            for mode, pair in pairs.items():
                ttft[mode].append(pair.run(f"r{i}", tokens, spec.step))
        runs = {
            mode: [
                {"ttft_ms": t, **times}
                for t, times in zip(
                    ttft[mode], pair.times([f"r{i}" for i in range(spec.requests)]), strict=True
                )
            ]
            for mode, pair in pairs.items()
        }
    finally:
        for pair in pairs.values():
            pair.close()
    rows = []
    for mode, got in runs.items():
        row: dict[str, Any] = {"transport": spec.transport, "mode": mode}
        for key in ("ttft_ms", "exposed_tail_ms", "overlap_ratio", "slice_transfer_ms"):
            row[key] = _median(got, key)
        rows.append(row)
    rows[0]["ttft_ratio"] = round(ttft_ratio(ttft["pipelined"], ttft["non_pipelined"]), 4)
    steps = -(-spec.tokens // spec.step)  # the non-pipelined mode's one slice holds every step
    bulk = rows[1]["slice_transfer_ms"] / steps
    rows[1]["per_step_transfer_ms"] = round(bulk, 4)
    rows[0]["zero_stretch_ttft_ratio"] = round(zero_stretch_ratio(steps, per_slice, bulk), 4)
    return rows, per_slice


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
    :func:`~kvplane.runtime.benches.paired_ratio` with the non-pipelined run as "ours" and the
    pipelined one as the "limit" (both are times: the median of ``pipelined / non_pipelined``)."""
    return paired_ratio(non_pipelined_ms, pipelined_ms)


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    n_req = args.requests or (4 if quick else 8)
    n_tok = args.tokens or (2048 if quick else 4096)
    step = args.step or (256 if quick else 512)
    layers = args.layers or DEEPSEEK_V3_LAYERS
    usable = available()
    rows: list[dict[str, Any]] = []
    targets: dict[str, dict[str, bool]] = {}
    slice_bytes = step * layers * 576 * 2
    for transport in [t.strip() for t in args.transports.split(",") if t.strip()]:
        reason = usable.get(transport, "unknown transport")
        if reason is not None:
            rows.append({"transport": transport, "skipped": reason})
            continue
        with tempfile.TemporaryDirectory(prefix="kvplane-bench-pd-") as work:
            got, calib_ms = _transport_rows(
                _Spec(transport, n_req, n_tok, step, layers), Path(work)
            )
        rows.extend(got)
        pipe = got[0]
        targets[transport] = {
            "exposed_tail_le_1.5x_slice": pipe["exposed_tail_ms"]
            <= 1.5 * pipe["slice_transfer_ms"],
            "ttft_le_0.7x_non_pipelined": pipe["ttft_ratio"] <= 0.7,
            "overlap_ge_0.8": pipe["overlap_ratio"] >= 0.8,
        }
        pipe["calibrated_step_compute_ms"] = round(calib_ms, 4)
    return {
        "workload": {
            "requests": n_req,
            "tokens": n_tok,
            "step": step,
            "layers": layers,
            "layout": "mla 512+64 bf16",
            "slice_bytes": slice_bytes,
        },
        "memcpy_slice_ms": round(_memcpy_ms(slice_bytes), 4),
        "rows": rows,
        "targets": targets,
    }
