"""``kvplane simulate``: the shipped trace on the shipped cluster, as JSON and as a table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplane.apps.simulate import parse_poisson
from kvplane.cli import main
from kvplane.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TRACE = str(ROOT / "examples" / "traces" / "mooncake_synthetic.jsonl")
H200 = str(ROOT / "examples" / "h200x8.toml")
CPU2 = str(ROOT / "examples" / "cpu2.toml")


def test_shipped_trace_on_h200x8_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", TRACE, "--cluster", H200, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"] == doc["completed"] == 3993
    assert set(doc["ttft_s"]) == {"p50", "p90", "p99", "mean", "max", "count"}
    assert [t["name"] for t in doc["tiers"]] == ["device", "host", "disk", "remote"]
    for key in ("transport_bytes", "overlap_ratio", "transfer_amplification", "exposed_tail_s"):
        assert key in doc
    assert 0 < doc["prefix_hit_rate"] < 1
    assert doc["ttft_s"]["p50"] <= doc["ttft_s"]["p90"] <= doc["ttft_s"]["p99"]


def test_poisson_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--poisson", "5,50", "--cluster", CPU2, "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "50 / 50" in out and "TTFT ms p50/p90/p99" in out and "tier disk" in out


def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["simulate", "--poisson", "5", "--cluster", CPU2]) == 1
    assert "--poisson must be RATE,N" in capsys.readouterr().err
    bad = tmp_path / "c.toml"
    bad.write_text(Path(CPU2).read_text().replace("token_s = 2e-5", "token_s = -2e-5"))
    assert main(["simulate", "--poisson", "5,5", "--cluster", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvplane: error: [prefill] token_s") and err.count("\n") == 1


@pytest.mark.parametrize(("text", "message"), [("0,5", "RATE"), ("1,0", "N"), ("a,b", "RATE,N")])
def test_parse_poisson(text: str, message: str) -> None:
    assert parse_poisson("2.5,10") == (2.5, 10)
    with pytest.raises(ConfigError, match=message):
        parse_poisson(text)
