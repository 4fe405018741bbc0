"""``kvplane bench offload``: the result has the documented shape and consistent numbers, and
a ``bench all`` row per limit.
(Timings are not asserted: performance claims live in the bench output, not in tests.)"""

from __future__ import annotations

import argparse
import json

import pytest

from kvplane.apps.bench import offload as bench
from kvplane.apps.bench import offload_rows
from kvplane.apps.bench.redis_limit import redis_benchmark_support
from kvplane.cli import build_parser
from kvplane.transports.native_copy import kernel


def test_quick_run_reports_every_tier_op_and_size(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, tmp_path: object
) -> None:
    monkeypatch.setattr(bench, "CHUNK_SIZES", (64 << 10, 128 << 10))  # small: a shape check
    monkeypatch.setattr(bench, "CHUNKS_PER_REPEAT", {True: (4, 2)})
    monkeypatch.setattr(offload_rows, "REPEATS", {True: (2, 2)})
    monkeypatch.setattr(bench, "SWEEP_BLOCKS", {True: 64})
    args = argparse.Namespace(
        redis_url=redis_url, disk_dir=str(tmp_path), sync="none", no_direct_io=False
    )
    result = bench.run(True, args)
    json.dumps(result)  # --json prints it as one object
    rows = result["throughput"]
    assert isinstance(rows, list)
    assert sorted((r["tier"], r["op"], r["chunk_bytes"]) for r in rows) == sorted(
        (t, op, size)
        for t in ("host", "disk", "remote")
        for op in ("store", "load")
        for size in (64 << 10, 128 << 10)
    )
    base = {"tier", "op", "chunk_bytes", "gbps", "limit_gbps", "ratio"}
    streamed = kernel().library is not None  # the host rows' second, streaming memcpy limit
    benchmarked = redis_benchmark_support() is None  # the remote rows' main limit
    for r in rows:
        extra = {"stream_limit_gbps", "stream_ratio"} if streamed and r["tier"] == "host" else set()
        if r["tier"] == "remote":
            extra = {"redis_py_limit_gbps", "redis_py_ratio"}
            if not benchmarked:
                assert r["limit_gbps"] is None and r["ratio"] is None
                extra.add("limit_unavailable")
        assert set(r) == base | extra
        assert r["gbps"] > 0 and all(r[k] > 0 for k in extra - {"limit_unavailable"})
        if r["tier"] != "remote" or benchmarked:
            assert r["limit_gbps"] > 0 and r["ratio"] > 0
    lines = result["rows"]
    assert isinstance(lines, list)
    assert (
        len(lines) == len(rows) + sum(len(r) - 6 for r in rows) // 2 + 1
    )  # + second limits, sweep
    assert all(line["bench"] == "offload" and line["repeats"] in (0, 2) for line in lines)
    assert lines[-1]["row"] == "sweep_us_per_block_16_vs_1" and lines[-1]["target"] == 0.2
    sweep = result["blocks_per_chunk_sweep"]
    assert isinstance(sweep, list)
    assert [s["blocks_per_chunk"] for s in sweep] == [1, 4, 16, 64]
    assert all(s["us_per_block"] > 0 and s["us_per_block_one_call"] > 0 for s in sweep)
    per_block = {s["blocks_per_chunk"]: s["us_per_block"] for s in sweep}
    assert result["sweep_ratio_16_vs_1"] == round(per_block[16] / per_block[1], 3)
    met = result["targets_met"]
    assert isinstance(met, dict) and len(met) == len(rows) + 1
    assert result["skipped"] == [] and result["remote_server"] == "configured"


def test_registered_with_the_cli() -> None:
    args = build_parser().parse_args(["bench", "offload", "--quick", "--json", "--sync", "data"])
    assert args._bench is bench and args.quick and args.sync == "data"
