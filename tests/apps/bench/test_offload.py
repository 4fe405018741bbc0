"""``kvplane bench offload``: the result has the documented shape and consistent numbers, and
a ``bench all`` row per limit.
(Timings are not asserted: performance claims live in the bench output, not in tests.)"""

from __future__ import annotations

import argparse
import json

import pytest

from kvplane.apps.bench import offload as bench
from kvplane.apps.bench import (
    offload_codecs,
    offload_rows,
    offload_shared,
    offload_sweep,
    offload_tuned,
)
from kvplane.apps.bench.redis_limit import redis_benchmark_support
from kvplane.cli import build_parser
from kvplane.transports.native_copy import kernel


def test_quick_run_reports_every_tier_op_and_size(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, tmp_path: object
) -> None:
    monkeypatch.setattr(bench, "CHUNK_SIZES", (64 << 10, 128 << 10))  # small: a shape check
    monkeypatch.setattr(bench, "CHUNKS_PER_REPEAT", {True: (4, 2)})
    monkeypatch.setattr(offload_rows, "REPEATS", {True: (2, 2)})
    # no settling pause between a run and its limit's, one warm-up repeat dropped (not two):
    # both only steady the timings, which a shape check does not read
    monkeypatch.setattr(offload_rows, "SETTLE_S", 0.0)
    monkeypatch.setattr(offload_rows, "WARMUP", 1)
    monkeypatch.setattr(offload_sweep, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "SWEEP_BLOCKS", {True: 64})
    monkeypatch.setattr(offload_codecs, "CODEC_CHUNK", 256 << 10)
    monkeypatch.setattr(offload_codecs, "CODEC_CHUNKS", {True: 2})
    small = offload_tuned.TunedChunks(host_blocks_per_chunk=2, disk_blocks_per_chunk=4,
                                      remote_blocks_per_chunk=8)  # fmt: skip
    monkeypatch.setattr(offload_tuned, "DEFAULT_TUNED", small)
    monkeypatch.setattr(offload_tuned, "RUN_BYTES", {True: 16 << 14})
    monkeypatch.setattr(offload_shared, "SHARED_CHUNKS", {True: 2})
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
    rows_named = [line["row"] for line in lines]
    end = rows_named.index("sweep_us_per_block_16_vs_1") + 1  # tuned, then codec rows follow
    _check_tuned(result, lines[end : end + 4])
    _check_codecs(result, lines[end + 4 : -3])
    _check_shared(result, lines[-3:], redis_url)
    lines = lines[:end]
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


def _check_tuned(result: dict[str, object], lines: list[dict[str, object]]) -> None:
    """Per cold tier, store and load at its tuned size (disk 4, Redis 8 blocks of 16 KiB)
    against the global (host) size of 2 blocks, target 1.3."""
    want = ["disk_store_tuned_vs_global_64k", "disk_load_tuned_vs_global_64k",
            "remote_store_tuned_vs_global_128k", "remote_load_tuned_vs_global_128k"]  # fmt: skip
    assert [r["row"] for r in lines] == want
    assert all(r["target"] == 1.3 and r["limit_name"] == "global 2 blocks" for r in lines)
    summary = result["tuned_vs_global"]
    assert isinstance(summary, list)
    assert [(s["tier"], s["op"], s["tuned_blocks"], s["global_blocks"]) for s in summary] == [
        ("disk", "store", 4, 2), ("disk", "load", 4, 2),
        ("remote", "store", 8, 2), ("remote", "load", 8, 2),
    ]  # fmt: skip
    assert all(s["ratio_min"] <= s["ratio_median"] <= s["ratio_max"] for s in summary)


def _check_shared(result: dict[str, object], lines: list[dict[str, object]], url: str) -> None:
    """Three shared-store rows against the private remote tier (no target), summarised, and
    nothing of the bench left on the server."""
    import redis

    want = ["shared_store_new_256k", "shared_store_dedup_256k", "shared_load_other_256k"]
    assert [r["row"] for r in lines] == want
    assert all(r["limit_name"] == "private remote tier" and r["target"] is None for r in lines)
    assert all(r["repeats"] == 2 and r["figure"] > 0 and r["limit"] > 0 for r in lines)
    summary = result["shared_store"]
    assert isinstance(summary, list)
    assert [s["op"] for s in summary] == ["store_new", "store_dedup", "load_other"]
    assert all(s["ratio_min"] <= s["ratio_median"] <= s["ratio_max"] for s in summary)
    assert [s["gbps"] for s in summary] == [r["figure"] for r in lines]
    client = redis.Redis.from_url(url)
    try:
        assert list(client.scan_iter(match="kvbench-shared*")) == []
    finally:
        client.close()


def _check_codecs(result: dict[str, object], lines: list[dict[str, object]]) -> None:
    """Per codec and cold tier: store and load rows against the raw tier (no target), and one
    stored-bytes row per codec (FP8's target 0.55, met)."""
    codecs = ["lz4", "zstd", "fp8", "fp8-chunk", "int8"]
    want = [f"{t}_{op}_{c}_256k" for c in codecs for t in ("disk", "remote")
            for op in ("store", "load")]  # fmt: skip
    assert [str(r["row"]) for r in lines if not str(r["row"]).startswith("stored_")] == want
    assert all(r["target"] is None and r["limit_name"].endswith("tier, raw") for r in lines
               if not str(r["row"]).startswith("stored_"))  # fmt: skip
    stored = {str(r["row"]): r for r in lines if str(r["row"]).startswith("stored_")}
    assert list(stored) == [f"stored_ratio_{c}" for c in codecs]
    assert stored["stored_ratio_fp8"]["target"] == 0.55 and stored["stored_ratio_fp8"]["met"]
    assert stored["stored_ratio_int8"]["target"] is None
    assert set(result["codec_auto"]) == {"disk", "remote"}  # type: ignore[arg-type]
    assert set(result["codec_auto"].values()) <= {"raw", "lz4", "zstd"}  # type: ignore[attr-defined]
    summary = result["codecs"]
    assert isinstance(summary, list) and len(summary) == 2 * len(codecs)
    for s in summary:
        assert set(s) == {"tier", "codec", "stored_ratio", "encode_gbps", "decode_gbps",
                          "raw_tier_store_gbps", "keeps_up", "fit_reasons"}  # fmt: skip
        assert 0 < s["stored_ratio"] <= 1 and s["encode_gbps"] > 0
        assert s["keeps_up"] == (s["fit_reasons"] == [])


def test_registered_with_the_cli() -> None:
    args = build_parser().parse_args(["bench", "offload", "--quick", "--json", "--sync", "data"])
    assert args._bench is bench and args.quick and args.sync == "data"
