"""The block Hadamard rotation of the fp8 codec: widths, exact +-1 runs, exact inverse on
values whose sums are exact, and a channel's outlier spread over its run."""

from __future__ import annotations

import pytest
import torch

from kvplane.errors import InvalidArgumentError
from kvplane.offload.codecs.rotation import MAX_WIDTH, hadamard_width, rotate, unrotate_


def test_the_width_is_the_largest_power_of_two_divisor_up_to_the_cap() -> None:
    got = [hadamard_width(d) for d in (1, 3, 6, 32, 96, 128, 576)]
    assert got == [1, 1, 2, 32, 32, MAX_WIDTH, MAX_WIDTH]
    with pytest.raises(InvalidArgumentError, match="dim must be"):
        hadamard_width(0)


def test_rotation_is_plus_minus_sums_and_its_inverse_is_exact() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])  # width 2: runs (1, 2) ... (5, 6)
    y = rotate(x)
    assert y.tolist() == [[3.0, -1.0, 7.0, -1.0, 11.0, -1.0]]
    g = torch.Generator().manual_seed(0)
    ints = torch.randint(-1000, 1000, (3, 5, 64), generator=g).float()
    assert torch.equal(unrotate_(rotate(ints)), ints)  # integer sums: no rounding
    odd = torch.randn(2, 7, generator=g)
    assert torch.equal(rotate(odd), odd) and torch.equal(unrotate_(odd.clone()), odd)


def test_an_outlier_channel_is_spread_over_its_run() -> None:
    x = torch.zeros(1, 8)
    x[0, 3] = 8.0
    assert rotate(x).abs().tolist() == [[8.0] * 8]
