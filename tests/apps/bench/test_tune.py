"""``kvplane tune chunks`` with injected measurements: fits, choices, output and ``--write``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

from kvplane.apps.bench import offload_rows, tune
from kvplane.cli import build_parser, main
from kvplane.errors import ConfigError

BLOCK = tune.BLOCK_BYTES
LINES = {"host": ((1e-6, 10e9), (1e-6, 10e9)), "disk": ((20e-6, 2e9), (40e-6, 4e9))}
"""Per tier, (op_s, bytes/s) of store and of load."""


def fake(tier: str, bpc: int, quick: bool) -> tuple[float, float]:
    assert quick
    (so, sb), (lo, lb) = LINES[tier]
    return so + bpc * BLOCK / sb, lo + bpc * BLOCK / lb


def _tune(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    args = build_parser().parse_args(["tune", "chunks", "--quick", "--json", *argv])
    assert tune.tune(args, fake) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_fits_and_choices_from_injected_measurements(capsys: pytest.CaptureFixture[str]) -> None:
    got = _tune(capsys, "--tiers", "host,disk")
    tiers = got["tiers"]
    assert isinstance(tiers, dict)
    assert list(tiers) == ["host", "disk"]
    # host: 1e-6 * 10e9 / (0.1 * 16384) = 6.1 -> 8 blocks, both directions
    assert tiers["host"]["blocks_per_chunk"] == 8
    # disk: store 20e-6 * 2e9 / 1638.4 = 24.4 -> 32; load 40e-6 * 4e9 / 1638.4 = 97.7 -> 128
    d = tiers["disk"]
    assert (d["store"]["blocks_per_chunk"], d["load"]["blocks_per_chunk"]) == (32, 128)
    assert d["blocks_per_chunk"] == 128
    assert d["store"]["op_us"] == pytest.approx(20.0)
    assert d["store"]["gbps"] == pytest.approx(2.0)
    assert d["load"]["residual_us"] == pytest.approx(0.0)
    assert [s["chunk_bytes"] for s in d["store"]["samples"]] == [BLOCK, 8 * BLOCK, 64 * BLOCK]
    assert d["capacity_bytes"] == 65536 << 20
    assert got["skipped"] == {}


def test_capacity_and_overhead_flags(capsys: pytest.CaptureFixture[str]) -> None:
    # 64 MiB / (64 chunks * 16 KiB) = 64 blocks at most; 20% halves the host's need to 4
    got = _tune(capsys, "--tiers", "host,disk", "--capacity-mib", "disk=64",
                "--max-overhead", "0.2")  # fmt: skip
    tiers = got["tiers"]
    assert isinstance(tiers, dict)
    assert tiers["disk"]["load"]["cap_blocks"] == 64
    assert tiers["disk"]["blocks_per_chunk"] == 64
    assert tiers["host"]["blocks_per_chunk"] == 4


def test_write_replaces_the_section_and_keeps_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "serve.toml"
    cfg.write_text(
        '[offload]\nhost_slots = 32\n\n[tune.chunks]\nhost_blocks_per_chunk = 1\nstale = 3\n'
        '\n[pool]\nnum_blocks = 512\n'
    )  # fmt: skip
    _tune(capsys, "--tiers", "host,disk", "--write", str(cfg))
    back = tomllib.loads(cfg.read_text())
    assert back["offload"] == {"host_slots": 32}
    assert back["pool"] == {"num_blocks": 512}
    assert back["tune"]["chunks"] == {
        "block_bytes": BLOCK, "max_overhead": 0.1, "min_chunks": 64,
        "host_blocks_per_chunk": 8, "disk_blocks_per_chunk": 128,
        "disk_gbps": 2.0,  # the lesser fitted bandwidth: store 2e9 B/s, load 4e9
    }  # fmt: skip
    _tune(capsys, "--tiers", "disk", "--write", str(cfg))  # a second write: one section
    back = tomllib.loads(cfg.read_text())
    assert back["tune"]["chunks"]["disk_blocks_per_chunk"] == 128
    assert "host_blocks_per_chunk" not in back["tune"]["chunks"]
    assert cfg.read_text().count("[tune.chunks]") == 1


def test_write_creates_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "new.toml"
    _tune(capsys, "--tiers", "host", "--write", str(cfg))
    assert tomllib.loads(cfg.read_text())["tune"]["chunks"]["host_blocks_per_chunk"] == 8


def test_text_output_names_every_tier(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["tune", "chunks", "--quick", "--tiers", "host,disk"])
    assert tune.tune(args, fake) == 0
    out = capsys.readouterr().out
    assert "host   blocks_per_chunk = 8" in out
    assert "disk   blocks_per_chunk = 128" in out


@pytest.mark.parametrize(
    "argv", [["--tiers", "gpu"], ["--tiers", ","], ["--capacity-mib", "host=0"],
             ["--capacity-mib", "tape=5"], ["--max-overhead", "0"], ["--min-chunks", "0"]],
)  # fmt: skip
def test_bad_flags_are_config_errors(argv: list[str]) -> None:
    args = build_parser().parse_args(["tune", "chunks", "--quick", *argv])
    with pytest.raises(ConfigError):
        tune.tune(args, fake)


def test_cli_reports_a_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "chunks", "--tiers", "gpu"]) == 1
    assert "unknown tier" in capsys.readouterr().err


def test_real_measurement_has_the_documented_shape(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The real measurer on every tier, tiny: a shape check (no timing is asserted)."""
    monkeypatch.setattr(tune, "SIZES", {True: (1, 2)})
    monkeypatch.setattr(tune, "RUN_BYTES", {True: 64 << 10})
    monkeypatch.setattr(offload_rows, "REPEATS", {True: (2, 2)})
    args = build_parser().parse_args(["tune", "chunks", "--quick", "--json", "--redis-url",
                                      redis_url, "--disk-dir", str(tmp_path)])  # fmt: skip
    assert tune.run(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert list(got["tiers"]) == ["host", "disk", "remote"]
    for r in got["tiers"].values():
        assert [s["chunk_bytes"] for s in r["store"]["samples"]] == [BLOCK, 2 * BLOCK]
        assert r["blocks_per_chunk"] >= 1
        assert r["blocks_per_chunk"] & (r["blocks_per_chunk"] - 1) == 0
    assert list(tmp_path.iterdir()) == []  # the disk tier's files are gone


def test_serve_uses_the_written_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvplane.apps.serve import offload_of
    from kvplane.apps.serve_config import settle
    from kvplane.offload.chunk_cost import TunedChunks

    cfg = tmp_path / "serve.toml"
    cfg.write_text("[pool]\nnum_blocks = 64\n")
    _tune(capsys, "--tiers", "host,disk", "--write", str(cfg))
    argv = ["serve", "prefill", "--config", str(cfg), "--offload-host-slots", "4"]
    settings = offload_of(settle(build_parser().parse_args(argv)))
    assert settings is not None
    assert settings.tuned == TunedChunks(16384, 0.1, 64, 8, 128, 0, 2.0)
    # blocks of 4 KiB: host 8 x 16 KiB = 32 blocks, disk 128 x 16 KiB = 512, remote = host
    bpc, offload = settings.resolved(4096)
    assert (bpc, offload.disk_blocks_per_chunk, offload.remote_blocks_per_chunk) == (32, 512, 32)
    assert offload.disk_gbps == 2.0 and offload.remote_gbps == 0.0
    given = build_parser().parse_args([*argv, "--blocks-per-chunk", "2"])
    assert offload_of(settle(given)).resolved(16384)[0] == 2  # type: ignore[union-attr]
    cfg.write_text(cfg.read_text() + "[tune.other]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"\[tune\] may hold only the table \[tune.chunks\]"):
        settle(build_parser().parse_args(argv))


def test_tuned_sizes_round_to_a_pool_s_blocks() -> None:
    from kvplane.offload.chunk_cost import TunedChunks

    t = TunedChunks(host_blocks_per_chunk=16, disk_blocks_per_chunk=64, remote_blocks_per_chunk=96)
    assert t.sizes(16384, 2) == (16, 64, 128)  # the nearest power of two
    assert t.sizes(65536, 2) == (4, 16, 32)
    assert t.sizes(1 << 20, 2) == (1, 1, 2)  # a block larger than a tuned chunk: one block
    assert TunedChunks(disk_blocks_per_chunk=8).sizes(16384, 4) == (4, 8, 4)
    with pytest.raises(ConfigError, match=r"\[tune.chunks\] disk_blocks_per_chunk must be"):
        TunedChunks(disk_blocks_per_chunk=-1)
