"""``--sweep``: the cross product of overrides, each parsed like the file, and the best point.

The tiny cluster: 512 B of KV per token, 1 ms of prefill per token, a PD op of a 512-token
slice 5 ms + 100 ms, RTT 10 ms. Two 1,024-token requests arrive at 0 (TTFT by hand below).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from simulate_testlib import OVERHEAD, RTT, SLICE_BW

from kvplane.cli import main
from kvplane.errors import ConfigError
from kvplane.simulate import simulate
from kvplane.simulate.sweep import (
    SweepPoint,
    best_point,
    goal_of,
    override,
    parse_sweep,
    sweep_specs,
)
from kvplane.simulate.workload import Request

DOC: dict[str, Any] = {
    "model": {"kind": "gqa", "layers": 1, "kv_heads": 1, "head_dim": 64, "dtype": "float32"},
    "cluster": {"prefill_workers": 1, "decode_workers": 1},
    "prefill": {"token_s": 1e-3, "slice_tokens": 512},
    "decode": {"token_s": 0.02},
    "transport": {"bandwidth_bytes_s": SLICE_BW, "rtt_s": RTT, "op_overhead_s": OVERHEAD},
}
TOML = """
[model]
kind = "gqa"
layers = 1
kv_heads = 1
head_dim = 64
dtype = "float32"
[cluster]
prefill_workers = 1
decode_workers = 1
[prefill]
token_s = 1e-3
slice_tokens = 512
[decode]
token_s = 0.02
[transport]
bandwidth_bytes_s = 2621440.0
rtt_s = 0.01
op_overhead_s = 0.005
"""
REQUESTS = (Request(0, 0.0, 1024, 11, (1, 2)), Request(1, 0.0, 1024, 11, (3, 4)))
AXES = ["prefill.slice_tokens=512,1024", "cluster.prefill_workers=1,2"]
# TTFT p90 by hand (interpolated between the two requests' TTFTs):
#  512, 1 worker: 1.139 and 2.163 (the second queues 1.024 s) -> 1.139 + 0.9 * 1.024
#  512, 2 workers: 1.139 and 1.244 (the last slices queue on the decode link) -> + 0.9 * 0.105
#  1024, 1 worker: 1.239 and 2.263; 1024, 2 workers: 1.239 and 1.444
P90 = [2.0606, 1.2335, 2.1606, 1.4235]


def test_cross_product_and_best(tmp_path: Path) -> None:
    axes = parse_sweep(AXES)
    assert axes == (("prefill.slice_tokens", (512, 1024)), ("cluster.prefill_workers", (1, 2)))
    specs = sweep_specs(DOC, tmp_path, axes)
    assert [s for s, _ in specs] == [
        (("prefill.slice_tokens", a), ("cluster.prefill_workers", b))
        for a in (512, 1024)
        for b in (1, 2)
    ]
    assert [(sp.prefill.slice_tokens, sp.prefill_workers) for _, sp in specs] == [
        (512, 1), (512, 2), (1024, 1), (1024, 2),
    ]  # fmt: skip
    points = [SweepPoint(s, simulate(sp, REQUESTS)[0]) for s, sp in specs]
    assert [p.result.ttft_s.p90 for p in points] == pytest.approx(P90, rel=1e-9)
    best = best_point(points, "ttft_p90")
    assert best is points[1]
    assert best_point(points, "queue_max") is points[1]  # no queue with 2 workers: first of equals
    assert points[3].result.queue_s.max == 0.0
    assert DOC["prefill"]["slice_tokens"] == 512  # overrides copy the document


def test_command_json_is_deterministic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text(TOML)
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 11, "hash_ids": list(r.hash_ids)}
        for r in REQUESTS
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["simulate", "--trace", str(trace), "--cluster", str(cluster), "--json"]
    for axis in AXES:
        argv += ["--sweep", axis]
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)
    assert doc["goal"] == "ttft_p90"
    assert [p["settings"] for p in doc["points"]] == [
        {"prefill.slice_tokens": a, "cluster.prefill_workers": b}
        for a in (512, 1024)
        for b in (1, 2)
    ]
    assert [p["result"]["ttft_s"]["p90"] for p in doc["points"]] == pytest.approx(P90, rel=1e-9)
    assert doc["best"]["settings"] == {"prefill.slice_tokens": 512, "cluster.prefill_workers": 2}
    assert main(argv) == 0
    assert capsys.readouterr().out == out
    assert main([*argv[:-5], "--sweep", AXES[1]]) == 0  # the table
    table = capsys.readouterr().out
    assert "best for ttft_p90: cluster.prefill_workers=2 (1.234 s)" in table


@pytest.mark.parametrize(
    ("axis", "message"),
    [
        ("prefill.slice_tokenz=1", "--sweep prefill.slice_tokenz=1: [prefill] has unknown key"),
        ("prefill.slice_tokens=0,512", "--sweep prefill.slice_tokens=0: [prefill] slice_tokens"),
        ("cluster.router=fastest", "--sweep cluster.router='fastest': [cluster] router"),
        ("racks.count=2", "--sweep racks.count=2: unknown section [racks]"),
        ("prefill.token_s.x=1", "--sweep prefill.token_s.x: prefill.token_s is not a table"),
    ],
)  # fmt: skip
def test_bad_sweep_is_a_config_error_naming_it(axis: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        sweep_specs(DOC, tmp_path, parse_sweep([axis]))
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "texts", [["prefill"], ["=1"], ["a.b="], ["a..b=1"], ["a.b=1,"], ["a=1", "a=2"]]
)
def test_malformed_sweep(texts: list[str]) -> None:
    with pytest.raises(ConfigError, match="--sweep"):
        parse_sweep(texts)


def test_values_read_as_toml_and_bad_goal() -> None:
    assert parse_sweep(['a.b=1,2.5,true,x,"y"']) == (("a.b", (1, 2.5, True, "x", "y")),)
    assert override({"a": {"b": 1}}, "a.c.d", 2) == {"a": {"b": 1, "c": {"d": 2}}}
    with pytest.raises(ConfigError, match="--goal must be one of ttft_p50"):
        goal_of("ttft_p95")


def test_bad_sweep_through_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text(TOML)
    argv = ["simulate", "--poisson", "1,2", "--cluster", str(cluster), "--sweep", "prefill.x=1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvplane: error: --sweep prefill.x=1: [prefill] has unknown key 'x'")
    assert err.count("\n") == 1
    assert main([*argv, "--png", str(tmp_path / "p.png")]) == 1
    assert "--png draws one run" in capsys.readouterr().err
