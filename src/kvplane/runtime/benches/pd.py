"""``kvplane bench pd``: pipelined vs non-pipelined prefill→decode transfer, per transport.

One workload (default 8 requests × 4,096 tokens, MLA layout, steps of 512 tokens; ``--quick``:
4 × 2,048 with steps of 256 and fewer layers) runs through a real prefill worker and decode
worker (threads of this process, real sockets, the named transport), once *pipelined* (a slice
after every step) and once *non-pipelined* (everything after the prefill ends).

Calibration first measures one step's transfer time (the median of five one-step requests, no
compute); the synthetic producer then spends that long per step, so per-step compute ≈
per-step transfer — the regime where pipelining matters most. Requests run one at a time, the
two modes interleaved (load changes on a shared machine hit both alike); rows report medians.

Per (transport, mode) row: ``ttft_ms`` (submit → first token ready on the decode side),
``exposed_tail_ms`` (last prefill step end → decode ready), ``overlap_ratio`` (transfer time
hidden under prefill compute / transfer time), ``slice_transfer_ms`` (one slice's transfer),
all from the workers' timelines; plus ``memcpy_slice_ms``, the physical limit (copying one
slice's bytes in memory). Targets (reported as booleans): pipelined exposed tail ≤ 1.5 × slice
transfer, pipelined TTFT ≤ 0.7 × non-pipelined, overlap ratio ≥ 0.8.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from kvplane.pd.timers import Timings
from kvplane.runtime.decode_worker import DecodeWorker
from kvplane.runtime.prefill_worker import PrefillWorker
from kvplane.runtime.router import Router
from kvplane.runtime.synthetic_model import SyntheticDecoder, SyntheticProducer, SyntheticSpec
from kvplane.runtime.timeline import request_times
from kvplane.runtime.worker_config import WorkerConfig
from kvplane.transports.registry import available

NAME = "pd"
HELP = "Pipelined vs non-pipelined PD transfer: TTFT, exposed tail, overlap (tcp, shm)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transports", default="tcp,shm", help="comma-separated transports")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)


class _Pair:
    """A prefill and a decode worker and a router, in this process."""

    def __init__(self, spec: SyntheticSpec, config: WorkerConfig) -> None:
        self.producer = SyntheticProducer(spec)
        self.prefill = PrefillWorker(config, self.producer)
        self.decode = DecodeWorker(replace(config, name="decode"), SyntheticDecoder(spec))
        self.prefill.start()
        self.decode.start()
        self.router = Router([self.prefill.address], [self.decode.address], timeout_s=120.0)
        self.router.connect()

    def run(self, rid: str, tokens: list[int], step: int) -> dict[str, float]:
        t0 = time.monotonic()
        res = self.router.generate(rid, tokens, step_size=step)
        if res.state != "success" or res.mismatches != 0:
            raise RuntimeError(f"bench request {rid} ended {res.state} ({res.reason})")
        times = request_times(self.prefill.timeline.events(rid) + self.decode.timeline.events(rid))
        return {
            "ttft_ms": (res.ready_at - t0) * 1e3,
            "exposed_tail_ms": (times.exposed_tail_s or 0.0) * 1e3,
            "overlap_ratio": times.overlap_ratio,
            "slice_transfer_ms": statistics.mean(times.slice_transfer_s) * 1e3,
        }

    def close(self) -> None:
        self.router.close()
        self.prefill.close()
        self.decode.close()


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


def _transport_rows(
    transport: str, spec: SyntheticSpec, n_req: int, n_tok: int, step: int
) -> tuple[list[dict[str, Any]], float]:
    blocks = 2 * -(-n_tok // 16) + 8
    config = WorkerConfig(
        name="prefill", transport=transport, num_blocks=blocks, block_size=16, num_slots=4,
        step_size=step, slice_timeout_s=60.0,
        timings=Timings(deadline_s=120.0, heartbeat_s=1.0, lease_s=10.0),
    )  # fmt: skip
    pairs = {
        "pipelined": _Pair(spec, config),
        "non_pipelined": _Pair(spec, replace(config, pipelined=False)),
    }
    try:
        pipe = pairs["pipelined"]
        pipe.run("warm", list(range(step)), step)
        per_slice = statistics.median(  # one step's KV, alone: the per-step transfer time
            pipe.run(f"cal{i}", [(i + t) % 30000 for t in range(step)], step)["slice_transfer_ms"]
            for i in range(5)
        )
        for pair in pairs.values():
            pair.producer.retime(per_slice / 1e3)
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in pairs}
        for i in range(n_req):  # interleaved, so load changes hit both modes alike
            tokens = [(i * 7919 + t) % 30000 for t in range(n_tok)]
            for mode, pair in pairs.items():
                runs[mode].append(pair.run(f"{mode}{i}", tokens, step))
    finally:
        for pair in pairs.values():
            pair.close()
    rows = []
    for mode, got in runs.items():
        row: dict[str, Any] = {"transport": transport, "mode": mode}
        for key in ("ttft_ms", "exposed_tail_ms", "overlap_ratio", "slice_transfer_ms"):
            row[key] = _median(got, key)
        rows.append(row)
    return rows, per_slice


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    n_req = args.requests or (4 if quick else 8)
    n_tok = args.tokens or (2048 if quick else 4096)
    step = args.step or (256 if quick else 512)
    layers = args.layers or (4 if quick else 8)
    spec = SyntheticSpec(kind="mla", num_layers=layers, latent_dim=512, rope_dim=64)
    usable = available()
    rows: list[dict[str, Any]] = []
    targets: dict[str, dict[str, bool]] = {}
    slice_bytes = step * layers * 576 * 2
    for transport in [t.strip() for t in args.transports.split(",") if t.strip()]:
        reason = usable.get(transport, "unknown transport")
        if reason is not None:
            rows.append({"transport": transport, "skipped": reason})
            continue
        got, calib_ms = _transport_rows(transport, spec, n_req, n_tok, step)
        rows.extend(got)
        pipe, base = got[0], got[1]
        targets[transport] = {
            "exposed_tail_le_1.5x_slice": pipe["exposed_tail_ms"]
            <= 1.5 * pipe["slice_transfer_ms"],
            "ttft_le_0.7x_non_pipelined": pipe["ttft_ms"] <= 0.7 * base["ttft_ms"],
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
