"""Device staging: runs between a device buffer and host memory move as staged row copies,
byte-exact against a per-run reference, in both directions and for every host-side shape (back
to back, rows, unaligned pieces); runs that sit on no device rows are left to the caller. The
device here is the CPU (the staging code is device-agnostic; a GPU run uses the same steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplane.transports.staging import copy_runs_staged, stage_rows


def _bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _reference(
    src: torch.Tensor, so: list[int], dst: torch.Tensor, do: list[int], ln: list[int]
) -> torch.Tensor:
    out = dst.clone()
    for s, d, n in zip(so, do, ln, strict=True):
        out[d : d + n] = src[s : s + n]
    return out


I64 = np.int64
CASES = {
    # device offsets (rows of 64 bytes, any order), host offsets, lengths
    "host back to back": ([640, 0, 128], [0, 64, 128], [64, 64, 64]),
    "host rows, permuted": ([0, 64, 192], [256, 0, 128], [64, 64, 64]),
    "host unaligned pieces": ([0, 192, 64], [3, 101, 500], [64, 64, 64]),
    "mixed lengths cut to pieces": ([0, 256, 512], [0, 192, 1000], [128, 64, 192]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("stage_bytes", [64, 1 << 20])
def test_staged_rows_match_a_per_run_copy_both_ways(name: str, stage_bytes: int) -> None:
    dev_off, host_off, lengths = (np.array(c, dtype=I64) for c in CASES[name])
    dev, host = _bytes(4096, 1), _bytes(4096, 2)
    want_host = _reference(dev, dev_off.tolist(), host, host_off.tolist(), lengths.tolist())
    assert stage_rows(dev, dev_off, host, host_off, lengths, to_host=True,
                      stage_bytes=stage_bytes)  # fmt: skip
    assert torch.equal(host, want_host)
    fresh = _bytes(4096, 3)
    want_dev = _reference(host, host_off.tolist(), fresh, dev_off.tolist(), lengths.tolist())
    assert stage_rows(fresh, dev_off, host, host_off, lengths, to_host=False,
                      stage_bytes=stage_bytes)  # fmt: skip
    assert torch.equal(fresh, want_dev)


def test_runs_off_device_rows_are_left_to_the_caller() -> None:
    dev, host = _bytes(1024, 1), torch.zeros(1024, dtype=torch.uint8)
    so, do, ln = (np.array(v, dtype=I64) for v in ([0, 100], [0, 64], [64, 64]))
    assert not stage_rows(dev, so, host, do, ln, to_host=True, stage_bytes=1 << 20)
    assert not host.any()  # nothing copied
    empty = np.zeros(0, dtype=I64)
    assert copy_runs_staged(dev, empty, host, empty, empty, stage_bytes=64)
    assert not host.any()


def test_cpu_destination_means_device_to_host() -> None:
    """``copy_runs_staged`` reads the direction from which buffer is on the CPU."""
    dev, host = _bytes(512, 4), torch.zeros(512, dtype=torch.uint8)
    so, do, ln = (np.array(v, dtype=I64) for v in ([128, 0], [0, 256], [64, 64]))
    assert copy_runs_staged(dev, so, host, do, ln, stage_bytes=1 << 20)
    assert torch.equal(host, _reference(dev, [128, 0], torch.zeros_like(host), [0, 256], [64, 64]))
