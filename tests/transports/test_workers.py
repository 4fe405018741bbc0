"""workers: a copy split among helper threads covers its range exactly once; errors surface."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvplane.errors import InvalidArgumentError
from kvplane.transports.copier import copy_runs
from kvplane.transports.workers import CopyWorkers


def test_parts_cover_the_range_once_and_use_the_helpers():
    w = CopyWorkers(3)
    seen = np.zeros(100, dtype=np.int64)
    threads: dict[int, int] = {}
    lock = threading.Lock()

    def fn(a: int, b: int) -> None:
        with lock:
            seen[a:b] += 1
            threads[a] = threading.get_ident()

    w.run(fn, 100)
    assert seen.tolist() == [1] * 100
    assert sorted(threads) == [0, 33, 66]
    assert threads[0] == threading.get_ident()  # the caller runs the first part itself
    assert threads[33] != threads[0] and threads[66] != threads[0]
    w.close()


def test_min_part_limits_the_split_and_small_ranges_stay_on_the_caller():
    w = CopyWorkers(4)
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()

    def fn(a: int, b: int) -> None:
        with lock:
            calls.append((a, b))

    w.run(fn, 10, min_part=5)
    assert sorted(calls) == [(0, 5), (5, 10)]
    calls.clear()
    w.run(fn, 3, min_part=5)
    assert calls == [(0, 3)]
    calls.clear()
    w.run(fn, 0)
    assert calls == []
    w.close()


def test_a_failing_part_raises_after_every_part_ended():
    w = CopyWorkers(2)
    done = []

    def fn(a: int, b: int) -> None:
        if a == 0:
            raise ValueError("part 0 failed")
        done.append((a, b))

    with pytest.raises(ValueError, match="part 0 failed"):
        w.run(fn, 10)
    assert done == [(5, 10)]
    w.close()


def test_closed_workers_run_on_the_caller_and_bad_thread_counts_are_refused():
    w = CopyWorkers(2)
    w.close()
    w.close()
    idents = []
    w.run(lambda a, b: idents.append((threading.get_ident(), a, b)), 10)
    assert idents == [(threading.get_ident(), 0, 10)]
    for bad in (0, -1, True, 2.0):
        with pytest.raises(InvalidArgumentError, match="threads must be an int >= 1"):
            CopyWorkers(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [3, 4096])
def test_copy_runs_with_workers_matches_the_reference(kit, length):
    """The NumPy scatter, gather and two-sided shapes, split among workers, move exact bytes."""
    rng = np.random.default_rng(length)
    n = max(64, (1 << 20) // length)
    w = CopyWorkers(2)
    for so, do in ((np.arange(n), rng.permutation(n)), (rng.permutation(n), np.arange(n)),
                   (rng.permutation(n), rng.permutation(n))):  # fmt: skip
        src = torch.from_numpy(rng.integers(0, 256, n * length, dtype=np.uint8))
        dst = torch.zeros(n * length, dtype=torch.uint8)
        lengths = np.full(n, length, dtype=np.int64)
        expected = torch.zeros_like(dst)
        expected.view(n, length)[torch.from_numpy(do)] = src.view(n, length)[torch.from_numpy(so)]
        copy_runs(src, so * length, dst, do * length, lengths, workers=w)
        assert torch.equal(dst, expected)
    w.close()
