"""``kvplane bench pd``: pipelined vs non-pipelined prefill→decode transfer, per transport.

Runs real ``kvplane serve`` worker processes on a calibrated DeepSeek-V3-deep workload and
reports TTFT, exposed tail and overlap from their timelines, the TTFT ratio paired request by
request. Workload, calibration, limit and verdicts: docs/benches.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.apps.bench.common import paired_ratio
from kvplane.apps.bench.pd_metrics import (
    TARGET_DEFINITIONS,
    TIME_FIELDS,
    calibration,
    median_or_none,
    memcpy_slice_ms,
    request_fields,
    targets,
)
from kvplane.apps.demo_procs import ProcessGroup, new_secret
from kvplane.errors import KVPlaneError
from kvplane.pipeline.timeline import request_times
from kvplane.pipeline.trace import events_from_dicts
from kvplane.serving.router.router import Router
from kvplane.serving.worker_config import SECRET_TRANSPORTS
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
        # nixl and mooncake cannot authenticate their data plane: run them --insecure, saying so
        secure = spec.transport in SECRET_TRANSPORTS
        self.group = ProcessGroup(work, new_secret() if secure else None)
        common = [
            "--transport", spec.transport, "--layout", "mla", "--layers", str(spec.layers),
            "--latent-dim", "512", "--rope-dim", "64", "--block-size", "16",
            "--num-blocks", str(2 * -(-spec.tokens // 16) + 8), "--num-slots", "4",
            "--step-size", str(spec.step), "--compute-ms-per-step", f"{compute_ms:.4f}",
            "--slice-timeout", "60", "--deadline", "120", "--heartbeat", "1", "--lease", "10",
            *([] if secure else ["--insecure"]),
        ]  # fmt: skip
        if not pipelined:
            common.append("--no-pipeline")
        deadline = time.monotonic() + 60.0
        try:
            pre = self.group.start("prefill", ["--name", "prefill", *common], deadline)
            dec = self.group.start("decode", ["--name", "decode", *common], deadline)
            self.router = Router(
                [str(pre["control"])], [str(dec["control"])], timeout_s=120.0,
                secret=self.group.secret,
            )  # fmt: skip
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
            raise KVPlaneError(f"bench request {rid} ended {res.state} ({res.reason})")
        return (res.ready_at - t0) * 1e3

    def times(self, rids: list[str]) -> tuple[list[dict[str, float | None]], int]:
        """Per request, :data:`~.pd_metrics.TIME_FIELDS` from both workers' timelines (one
        monotonic clock on this host), and the events the workers left out (when not 0, every
        field is None: a request's events may be incomplete)."""
        stats = self.router.stats(timeline=True)
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
        self.router.close()
        self.group.stop()


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
        got = median_or_none([r["slice_transfer_ms"] for r in pair.times(rids)[0]])
    finally:
        pair.close()
    if got is None or got <= 0:
        raise KVPlaneError("bench pd calibration: the one-step requests' timelines hold no slice")
    return got


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
        rids = [f"r{i}" for i in range(spec.requests)]
        runs = {mode: pair.times(rids) for mode, pair in pairs.items()}
    finally:
        for pair in pairs.values():
            pair.close()
    rows = []
    for mode, (got, truncated) in runs.items():
        row: dict[str, Any] = {"transport": spec.transport, "mode": mode}
        row["ttft_ms"] = median_or_none(ttft[mode])
        for key in TIME_FIELDS:
            row[key] = median_or_none([r[key] for r in got])
        row["timeline_truncated"] = truncated
        rows.append(row)
    rows[0]["ttft_ratio"] = round(ttft_ratio(ttft["pipelined"], ttft["non_pipelined"]), 4)
    steps = -(-spec.tokens // spec.step)  # the non-pipelined mode's one slice holds every step
    bulk_slice = rows[1]["slice_transfer_ms"]
    bulk = None if bulk_slice is None else bulk_slice / steps
    rows[1]["per_step_transfer_ms"] = None if bulk is None else round(bulk, 4)
    rows[0]["zero_stretch_ttft_ratio"] = (
        None if bulk is None else round(zero_stretch_ratio(steps, per_slice, bulk), 4)
    )
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
    :func:`~kvplane.apps.bench.common.paired_ratio` with the non-pipelined run as "ours" and the
    pipelined one as the "limit" (both are times: the median of ``pipelined / non_pipelined``)."""
    return paired_ratio(non_pipelined_ms, pipelined_ms)


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    n_req = args.requests or (4 if quick else 8)
    n_tok = args.tokens or (2048 if quick else 4096)
    step = args.step or (256 if quick else 512)
    layers = args.layers or DEEPSEEK_V3_LAYERS
    usable = available()
    rows: list[dict[str, Any]] = []
    targets_by: dict[str, dict[str, bool]] = {}
    calibrations: dict[str, dict[str, object]] = {}
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
        targets_by[transport] = targets(got[0])
        calibrations[transport] = calibration(got[0], calib_ms)
    block_bytes = 16 * layers * 576 * 2  # the workers' block: 16 tokens, every layer
    memcpy_ms, scattered_ms = memcpy_slice_ms(
        slice_bytes, block_bytes if step % 16 == 0 else slice_bytes
    )
    return {
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
        "rows": rows,
        "calibration": calibrations,
        "targets": targets_by,
        "target_definitions": TARGET_DEFINITIONS,
    }
