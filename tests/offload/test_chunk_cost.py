"""The chunk cost model: the fit recovers known lines, the rule picks the documented size."""

from __future__ import annotations

import math

import pytest

from kvplane.errors import ConfigError
from kvplane.offload.chunk_cost import Fit, Sample, choose, fit

KIB = 1 << 10
BLOCK = 16 * KIB


def _line(op_s: float, bw: float, sizes: list[int]) -> list[Sample]:
    return [Sample(b, op_s + b / bw) for b in sizes]


@pytest.mark.parametrize(("op_s", "bw"), [(50e-6, 1e9), (2e-6, 12e9), (120e-6, 0.4e9), (0.0, 3e9)])
def test_fit_recovers_a_known_line(op_s: float, bw: float) -> None:
    f = fit(_line(op_s, bw, [16 * KIB, 64 * KIB, 256 * KIB, 4096 * KIB]))
    assert f.op_s == pytest.approx(op_s, abs=1e-12)
    assert f.bytes_per_s == pytest.approx(bw, rel=1e-9)
    assert f.residual_s == pytest.approx(0.0, abs=1e-12)
    assert f.samples == 4
    assert f.seconds(BLOCK) == pytest.approx(op_s + BLOCK / bw, rel=1e-9)


def test_fit_residual_is_the_rms_of_the_misses() -> None:
    # 1, 3, 3, 5 us at 1..4 blocks: line 1.2 us/block through 0, residuals -.2, .6, -.6, .2
    xs = [BLOCK, 2 * BLOCK, 3 * BLOCK, 4 * BLOCK]
    f = fit([Sample(x, s * 1e-6) for x, s in zip(xs, [1.0, 3.0, 3.0, 5.0], strict=True)])
    assert f.residual_s == pytest.approx(math.sqrt((0.04 + 0.36 + 0.36 + 0.04) / 4) * 1e-6)
    assert f.bytes_per_s == pytest.approx(BLOCK / 1.2e-6)
    assert f.op_s == pytest.approx(0.0, abs=1e-15)


def test_fit_without_a_bandwidth_cost_is_infinite_bandwidth() -> None:
    f = fit([Sample(BLOCK, 5e-6), Sample(4 * BLOCK, 5e-6)])
    assert f.bytes_per_s == math.inf
    assert f.op_s == pytest.approx(5e-6)
    assert f.seconds(BLOCK) == pytest.approx(5e-6)


@pytest.mark.parametrize(
    "samples",
    [[], [Sample(BLOCK, 1e-6)], [Sample(BLOCK, 1e-6), Sample(BLOCK, 2e-6)],
     [Sample(0, 1e-6), Sample(BLOCK, 1e-6)], [Sample(BLOCK, math.nan), Sample(2, 1e-6)]],
)  # fmt: skip
def test_fit_refuses_too_few_sizes_or_bad_samples(samples: list[Sample]) -> None:
    with pytest.raises(ConfigError):
        fit(samples)


def _choose(op_s: float, bw: float, capacity: int = 1 << 30, **kw: float) -> tuple[int, ...]:
    c = choose(Fit(op_s, bw, 0.0, 2), block_bytes=BLOCK, capacity_bytes=capacity, **kw)  # type: ignore[arg-type]
    return c.blocks_per_chunk, c.wanted_blocks, c.cap_blocks


def test_choose_smallest_power_of_two_within_the_overhead_share() -> None:
    # need 100e-6 * 1e9 / (0.1 * 16384) = 61.04 blocks -> 64; cap 2^30 / (64 * 16 KiB) = 1024
    assert _choose(100e-6, 1e9) == (64, 64, 1024)
    c = choose(Fit(100e-6, 1e9, 0.0, 2), block_bytes=BLOCK, capacity_bytes=1 << 30)
    assert c.chunk_bytes == 64 * BLOCK
    assert c.overhead_share == pytest.approx(100e-6 / (64 * BLOCK / 1e9))
    # a looser share halves the need: 30.5 -> 32
    assert _choose(100e-6, 1e9, max_overhead=0.2) == (32, 32, 1024)


def test_choose_an_exact_power_of_two_is_not_rounded_up() -> None:
    # op_s * bw = 0.1 * 4 * 16384: exactly 4 blocks
    assert _choose(6.5536e-6, 1e9)[0] == 4


def test_choose_capacity_caps_the_size() -> None:
    # need 610 -> 1024 blocks; 64 MiB / (64 chunks * 16 KiB) = 64 blocks
    assert _choose(1e-3, 1e9, capacity=64 << 20) == (64, 1024, 64)
    assert _choose(1e-3, 1e9, capacity=64 << 20, min_chunks=16) == (256, 1024, 256)
    # 100 MiB / 1 MiB = 100 -> the power of two below, 64
    assert _choose(1e-3, 1e9, capacity=100 << 20)[2] == 64
    # less than min_chunks blocks in all: still one block per chunk
    assert _choose(1e-3, 1e9, capacity=BLOCK) == (1, 1024, 1)


def test_choose_edge_fits() -> None:
    assert _choose(-3e-6, 1e9) == (1, 1, 1024)  # no overhead: the smallest size
    assert _choose(0.0, 1e9) == (1, 1, 1024)
    assert _choose(5e-6, math.inf) == (1024, 1024, 1024)  # only overhead: the cap


@pytest.mark.parametrize(
    "kw", [{"max_overhead": 0.0}, {"max_overhead": 1.5}, {"min_chunks": 0}, {"block_bytes": 0},
           {"capacity_bytes": 0}],
)  # fmt: skip
def test_choose_refuses_bad_parameters(kw: dict[str, float]) -> None:
    args: dict[str, float] = {"block_bytes": BLOCK, "capacity_bytes": 1 << 30} | kw
    with pytest.raises(ConfigError):
        choose(Fit(1e-6, 1e9, 0.0, 2), **args)  # type: ignore[arg-type]
