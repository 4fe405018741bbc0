"""The simulator against a measured run: ``kvplane bench pd``'s workload, simulated and compared.

:func:`pd_bench_cluster` is that bench's synthetic workload as a cluster (one prefill and one
decode worker, MLA 512 + 64 bf16 KV of the bench's depth, one request at a time, slices of one
step, pipelined or not); :func:`check_pd_bench` calibrates it from the same ``bench all --json``
document (:mod:`.calibrate`), simulates each mode and sets the predicted TTFT median and
overlap beside the measured ones. Plain data in, plain data out; runs no bench.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.errors import ConfigError
from kvplane.simulate.calibrate import calibrate, pd_modes
from kvplane.simulate.geometry import mla_geometry
from kvplane.simulate.spec import ClusterSpec, DecodeSpec, PrefillSpec, TransportSpec
from kvplane.simulate.summary import simulate
from kvplane.simulate.workload import Request

GAP_S = 10.0
"""Seconds between simulated arrivals: the bench serves one request at a time."""
MODES = {"pipelined": True, "non_pipelined": False}


@dataclass(frozen=True, slots=True)
class Comparison:
    """One bench mode: predicted and measured TTFT median (ms) and overlap ratio."""

    transport: str
    mode: str
    predicted_ttft_ms: float
    measured_ttft_ms: float
    predicted_overlap: float
    measured_overlap: float

    @property
    def ttft_error(self) -> float:
        """``predicted / measured - 1``."""
        return self.predicted_ttft_ms / self.measured_ttft_ms - 1.0

    @property
    def overlap_error(self) -> float:
        """The overlap's relative error; the absolute difference where the measured one is 0."""
        if self.measured_overlap == 0:
            return abs(self.predicted_overlap)
        return self.predicted_overlap / self.measured_overlap - 1.0


def pd_bench_cluster(workload: Mapping[str, Any], pipelined: bool) -> ClusterSpec:
    """``bench pd``'s synthetic workload (its JSON ``workload``: ``layers``, ``step``) as an
    uncalibrated cluster: placeholder costs that :func:`~.calibrate.calibrate` replaces."""
    layers, step = workload.get("layers"), workload.get("step")
    if not isinstance(layers, int) or not isinstance(step, int):
        raise ConfigError(f"bench pd workload lacks layers or step: {dict(workload)}")
    return ClusterSpec(
        geometry=mla_geometry(layers, 512, 64, "bfloat16", 1),
        prefill=PrefillSpec(token_s=1e-5, slice_tokens=step, pipelined=pipelined),
        decode=DecodeSpec(token_s=1e-3),
        transport=TransportSpec(bandwidth_bytes_s=1e9),
        prefill_workers=1,
        decode_workers=1,
    )


def pd_bench_requests(tokens: int, count: int) -> tuple[Request, ...]:
    """``count`` prompts of ``tokens`` sharing no block, :data:`GAP_S` apart."""
    blocks = -(-tokens // 512)
    return tuple(
        Request(i, i * GAP_S, tokens, 2, tuple(i * blocks + b for b in range(blocks)))
        for i in range(count)
    )


def check_pd_bench(doc: Mapping[str, Any], transport: str) -> list[Comparison]:
    """Each mode ``bench pd`` measured for ``transport`` in ``doc`` (``bench all --json``),
    simulated on the cluster calibrated from ``doc``, beside its measurement."""
    benches = doc.get("benches")
    if not isinstance(benches, dict):
        raise ConfigError("not `kvplane bench all --json` output (no 'benches')")
    pd = benches.get("pd")
    if not isinstance(pd, dict) or not isinstance(pd.get("workload"), dict):
        raise ConfigError("no bench pd result in the document")
    work, measured = pd["workload"], pd_modes(benches, transport)
    out = []
    for mode, pipelined in MODES.items():
        row = measured.get(mode)
        if row is None:
            continue
        spec = calibrate(pd_bench_cluster(work, pipelined), doc, transport).spec
        spec = dataclasses.replace(
            spec, prefill=dataclasses.replace(spec.prefill, slice_tokens=work["step"])
        )
        count = int(measured["pipelined"].get("requests") or work.get("requests") or 4)
        result, _ = simulate(spec, pd_bench_requests(int(work["tokens"]), count))
        out.append(
            Comparison(
                transport,
                mode,
                result.ttft_s.p50 * 1e3,
                float(row["ttft_ms"]),
                result.overlap_ratio,
                float(row["overlap_ratio"]),
            )
        )
    return out
