"""``--calibrate``: a fixed ``bench all --json`` document fills a spec with hand-computed costs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from simulate_testlib import tiny_spec

from kvplane.cli import main
from kvplane.errors import ConfigError
from kvplane.simulate.calibrate import calibrate, fit_op_cost, pd_lag_s
from kvplane.simulate.spec import TierSpec

ROOT = Path(__file__).resolve().parents[2]
CPU2 = str(ROOT / "examples" / "cpu2.toml")


def _offload(tier: str, op: str, kib: int, seconds: float) -> dict[str, Any]:
    return {"row": f"{tier}_{op}_{kib}k", "figure": kib * 1024 / seconds / 1e9, "unit": "GB/s"}


DOC: dict[str, Any] = {
    "quick": True,
    "benches": {
        "protocol": {"rtt_us": 200.0},
        "transport": {
            "results": [  # shm blocks: 2e-4 s for 200 kB, 6e-4 s for 1 MB: 1e-4 s + 2 GB/s
                {"transport": "shm", "block_bytes": 200_000, "gbps": 1.0},
                {"transport": "shm", "block_bytes": 1_000_000, "gbps": 1e6 / 6e-4 / 1e9},
                {"planner": "contiguous_4k"},
            ]
        },
        "offload": {
            "rows": [  # host: 1e-4 s per 256 KiB chunk, 1e-3 s per 4 MiB (store and load)
                _offload("host", "store", 256, 1e-4),
                _offload("host", "load", 256, 1e-4),
                _offload("host", "store", 4096, 1e-3),
                _offload("host", "load", 4096, 1e-3),
                # disk: 2e-4 s and 1e-4 s per 256 KiB; its 4 MiB load is missing
                _offload("disk", "store", 256, 2e-4),
                _offload("disk", "load", 256, 1e-4),
                _offload("disk", "store", 4096, 1e-3),
            ]
        },
        "pd": {  # tcp: a 1 MB slice in 3 ms, the 8 MB bulk in 10 ms; a 256-token step 12.8 ms
            # quiet, 14.4 ms on average with slices in flight (the first of 8 quiet)
            "workload": {"tokens": 2048, "step": 256, "slice_bytes": 1_000_000},
            "modes": [
                {
                    "transport": "tcp",
                    "mode": "pipelined",
                    "slice_transfer_ms": 3.0,
                    "step_compute_ms": 14.4,
                },
                {
                    "transport": "tcp",
                    "mode": "non_pipelined",
                    "slice_transfer_ms": 10.0,
                    "step_compute_ms": 12.8,
                    "ttft_ms": 130.0,  # 8 steps, a 25 ms tail: 2.6 ms of setup; the tail
                    "exposed_tail_ms": 25.0,  # beyond the 10 ms op: a 15 ms lag
                },
                {"transport": "shm", "skipped": "not here"},
            ],
            "model": None,
        },
    },
}


def _tiers() -> tuple[TierSpec, ...]:
    return tuple(
        TierSpec(name=n, capacity_bytes=1 << 30, bandwidth_bytes_s=1e9, op_overhead_s=1e-6)
        for n in ("device", "host", "disk", "remote")
    )


def test_fit_op_cost() -> None:
    assert fit_op_cost([(8e6, 10e-3), (1e6, 3e-3)]) == pytest.approx((2e-3, 1e9), rel=1e-12)
    assert fit_op_cost([(1e6, 4e-3), (8e6, 2e-3)]) == (0.0, 4e9)  # no positive slope
    assert fit_op_cost([(1e6, 1e-3), (8e6, 10e-3)]) == (0.0, 8e8)  # negative intercept
    assert fit_op_cost([(1e6, 1e-3)]) == (0.0, 1e9)


def test_pd_bench_fills_transport_prefill_and_tiers() -> None:
    spec = dataclasses.replace(tiny_spec(), tiers=_tiers())
    got = calibrate(spec, DOC)
    t = got.spec.transport
    assert (t.op_overhead_s, t.bandwidth_bytes_s, t.rtt_s) == pytest.approx((2e-3, 1e9, 15e-3))
    assert "[transport] rtt_s = 0.015 (bench pd tcp non-pipelined lag)" in got.filled
    assert got.spec.prefill.token_s == pytest.approx(5e-5)
    # 1 + 7 / 8 * c = 14.4 / 12.8: 7 stretched steps of 8
    assert got.spec.prefill.contention == pytest.approx(1 / 7)
    assert got.spec.prefill.setup_s == pytest.approx(2.6e-3)
    assert (got.spec.prefill.pair_s, got.spec.prefill.step_s) == (0.0, 0.0)
    assert got.spec.prefill.slice_tokens == spec.prefill.slice_tokens
    device, host, disk, remote = got.spec.tiers
    assert device == spec.tiers[0] and remote == spec.tiers[3]
    assert host.op_overhead_s == pytest.approx(4e-5)
    assert host.bandwidth_bytes_s == pytest.approx((4096 - 256) * 1024 / 9e-4)
    assert (disk.op_overhead_s, disk.bandwidth_bytes_s) == pytest.approx((0.0, 262144 / 1.5e-4))
    assert host.capacity_bytes == 1 << 30  # capacities are the spec's
    assert got.spec.decode == spec.decode
    assert got.filled[0] == "[transport] op_overhead_s = 0.002 (bench pd tcp)"
    assert len(got.filled) == 12
    assert got.missing == (
        "[tiers.device] bandwidth_bytes_s, op_overhead_s: no bench offload rows",
        "[tiers.remote] bandwidth_bytes_s, op_overhead_s: no bench offload rows",
        "[decode] token_s, ctx_token_s: no bench measures decode per token",
    )


def test_transport_bench_when_pd_lacks_it() -> None:
    got = calibrate(tiny_spec(), DOC, "shm")
    t = got.spec.transport
    assert (t.op_overhead_s, t.bandwidth_bytes_s) == pytest.approx((1e-4, 2e9))
    assert t.rtt_s == pytest.approx(2e-4)  # no shm tail: bench protocol's round trip
    assert "[transport] bandwidth_bytes_s = 2e+09 (bench transport shm)" in got.filled
    assert got.spec.prefill == tiny_spec().prefill  # no shm step compute
    assert "[prefill] token_s, contention, setup_s: no bench pd step compute" in got.missing


def test_pd_lag_needs_a_tail_beyond_the_op() -> None:
    bulk = {"transport": "tcp", "mode": "non_pipelined", "slice_transfer_ms": 10.0}
    lag = {"pd": {"modes": [{**bulk, "exposed_tail_ms": 13.5}]}}
    assert pd_lag_s(lag, "tcp") == pytest.approx(3.5e-3)
    assert pd_lag_s(lag, "shm") is None
    assert pd_lag_s({"pd": {"modes": [bulk]}}, "tcp") is None
    assert pd_lag_s({"pd": {"modes": [{**bulk, "exposed_tail_ms": 9.0}]}}, "tcp") is None


def test_nothing_measured_keeps_the_spec() -> None:
    got = calibrate(tiny_spec(), {"benches": {}}, "nixl")
    assert got.spec == tiny_spec() and got.filled == ()
    assert got.missing[0] == "[transport] bandwidth_bytes_s, op_overhead_s: no nixl figures"
    with pytest.raises(ConfigError, match="bench all --json"):
        calibrate(tiny_spec(), {"rows": []})


def test_command_calibrates(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc = tmp_path / "bench.json"
    doc.write_text(json.dumps(DOC))
    argv = ["simulate", "--poisson", "2,20", "--cluster", CPU2, "--calibrate", str(doc)]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completed"] == 20
    assert "[transport] bandwidth_bytes_s = 1e+09 (bench pd tcp)" in out["calibration"]["filled"]
    assert main(argv) == 0
    assert "calibration missing: [decode] token_s" in capsys.readouterr().out
    doc.write_text("[1]")
    assert main(argv) == 1
    assert "not a JSON object" in capsys.readouterr().err
