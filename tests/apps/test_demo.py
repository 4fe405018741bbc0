"""``kvplane demo`` as a user runs it: three worker processes, parity, offload hits from host and
disk, trace and picture, ``kvplane report`` redrawing them; a killed worker is reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from kvplane.apps.demo import demo_prompts
from kvplane.cli import main
from kvplane.metrics import SEED_METRICS
from kvplane.models import save_checkpoint, tiny_config


def kvplane(*args: str, timeout: float = 150.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "kvplane", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_demo_json_parity_offload_trace_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    # the disk tier stores zstd-coded chunks: its 3 hits decode to the exact KV (parity)
    done = kvplane(
        "demo", "--json", "--out", str(out), "--max-new-tokens", "8", "--disk-codec", "zstd"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1  # exactly one JSON object on stdout; progress went to stderr
    got = json.loads(lines[0])
    assert got["parity"] is True
    assert got["requests"] == len(demo_prompts(1024))
    m = got["metrics"]
    assert (m["chunk_hits_host"], m["chunk_hits_disk"]) == (5.0, 3.0)
    assert got["offload_hit_chunks"] == 8
    assert m["transfer_amplification"] == 1.0
    assert m["fallback_ratio"] == 0.0 and m["attention_plans"] > 0
    assert 0.0 <= m["overlap_ratio_mean"] <= 1.0
    assert got["integrity"] == {"prefill": "", "decode": ""}
    # concurrent waves; every process's /metrics showed the six seed families mid-run
    assert got["concurrency"] == 4
    assert got["scraped"] == {
        role: sorted(SEED_METRICS) for role in ("prefill", "decode", "router")
    }
    for key in (
        "transfer_amplification",
        "blocks_per_op_p99",
        "overlap_ratio_p50",
        "exposed_tail_ms_p99",
        "release_latency_ms_p99",
        "fallback_ratio",
    ):
        assert key in m, key  # fmt: skip
    trace = json.loads((out / "trace.json").read_text())
    names = {r["cat"] for r in trace["traceEvents"] if r["ph"] == "X"}
    assert names >= {"prefill step", "slice transfer", "offload load", "offload store", "decode"}
    # order handling: the decode worker's accept (loop took it .. its session opened) once per
    # request, and each order's receipt once per request by each worker, prefill and decode
    accepts = [r for r in trace["traceEvents"] if r["ph"] == "X" and r["cat"] == "order accept"]
    received = Counter(r["pid"] for r in trace["traceEvents"] if r["name"] == "order_received")
    assert len(accepts) == got["requests"]
    assert sorted(received.values()) == [got["requests"]] * 2
    assert trace["otherData"]["metrics"] == m
    png = out / "timeline.png"
    png.unlink()
    assert main(["report", str(out)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["report", "--json", str(out)]) == 0  # the CLI's code, in this process
    shown = json.loads(capsys.readouterr().out)
    assert shown["metrics"] == m and shown["concurrency"] == 4 and shown["parity"] is True


def test_demo_reports_a_killed_worker_instead_of_hanging(tmp_path: Path) -> None:
    started = time.monotonic()
    done = kvplane("demo", "--json", "--chaos-kill", "prefill", "--chaos-kill-after", "1")
    assert time.monotonic() - started < 60
    assert done.returncode == 3
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["parity"] is False
    assert "the prefill worker" in got["error"]
    assert "exited with code -9 while serving request r1" in got["error"]


def test_demo_refuses_unsupported_checkpoint_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    save_checkpoint(tiny_config("tiny-llama"), ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["architectures"] = ["MambaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    assert main(["demo", "--model", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "MambaForCausalLM" in err and "LlamaForCausalLM" in err
    assert main(["demo", "--max-new-tokens", "0"]) == 1
    assert "--max-new-tokens must be positive, got 0" in capsys.readouterr().err


def test_demo_refuses_a_data_plane_that_cannot_authenticate_unless_insecure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--transport", "nixl"]) == 1
    assert "transport 'nixl' cannot authenticate its data plane" in capsys.readouterr().err
