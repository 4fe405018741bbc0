"""``--png``: the TTFT CDF and tier occupancy series, the PNG itself, and its missing extra."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from simulate_testlib import device_tier, request, tiny_spec

from kvplane.cli import main
from kvplane.errors import UnsupportedError
from kvplane.simulate import plot, simulate
from kvplane.simulate.engine import Simulation
from kvplane.simulate.plot import tier_occupancy, tiers_by_name, ttft_cdf
from kvplane.simulate.spec import FailureSpec

ROOT = Path(__file__).resolve().parents[2]
CPU2 = str(ROOT / "examples" / "cpu2.toml")
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _run() -> Simulation:
    """Two prefill workers with 3-chunk device tiers and 8 prompts of 4 chunks; worker 1 dies."""
    spec = tiny_spec(
        prefill_workers=2,
        decode_workers=1,
        tiers=(device_tier(3),),
        failures=(FailureSpec("prefill", 1, 5.0),),
    )
    reqs = [request(i, 0.5 * i, 2048, ids=tuple(range(i % 3, i % 3 + 4))) for i in range(8)]
    return simulate(spec, reqs)[1]


def test_occupancy_never_exceeds_capacity() -> None:
    sim = _run()
    tiers = tiers_by_name(sim)["device"]
    assert len(tiers) == 2
    for tier in tiers:
        counts = [n for _, n in tier.occupancy]
        times = [t for t, _ in tier.occupancy]
        assert max(counts) == tier.capacity == 3
        assert times == sorted(times) and tier.occupancy[-1][1] == len(tier.keys)
    assert tiers[1].occupancy[-1] == (5.0, 0)  # lost when its worker died at 5 s
    merged = tier_occupancy(tiers)
    assert all(b <= 2 * 3 * tiers[0].chunk_bytes for _, b in merged)
    assert merged[-1][1] == sum(len(t.keys) for t in tiers) * tiers[0].chunk_bytes


def test_ttft_cdf() -> None:
    sim = _run()
    xs, ys = ttft_cdf(sim.outcomes())
    assert xs == sorted(o.ttft_s for o in sim.outcomes())
    assert ys == [(i + 1) / 8 for i in range(8)]


@pytest.mark.skipif(not HAS_MPL, reason="needs the plot extra (matplotlib)")
def test_png_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "sim.png"
    assert main(["simulate", "--poisson", "5,50", "--cluster", CPU2, "--png", str(png)]) == 0
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")


def test_png_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    real = importlib.util.find_spec
    monkeypatch.setattr(
        plot.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real(name)
    )
    with pytest.raises(UnsupportedError, match=r"kvplane\[plot\]"):
        plot.draw_png(_run(), tmp_path / "x.png")
    png = tmp_path / "sim.png"
    assert main(["simulate", "--poisson", "5,5", "--cluster", CPU2, "--png", str(png)]) == 1
    assert "--png needs matplotlib" in capsys.readouterr().err and not png.exists()
