"""workers: a copy split among helper threads covers its range exactly once; errors surface."""

from __future__ import annotations

import threading
import time

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
        with pytest.raises(InvalidArgumentError, match="threads must be a positive int"):
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


def test_close_between_two_handed_out_parts_waits_and_the_run_covers_everything():
    """close() landing while run() hands parts out (the pool shut down between two submits)
    must neither make run() return before a handed-out part ends nor skip a part."""
    w = CopyWorkers(4)
    w.run(lambda a, b: None, 4)  # the pool exists
    pool = w._pool
    assert pool is not None
    real, calls, closer = pool.submit, [0], []

    def submit(fn, *args):
        calls[0] += 1
        if calls[0] == 2:  # close() arrives between the first and the second part
            closer.append(threading.Thread(target=w.close))
            closer[0].start()
            end = time.monotonic() + 2
            while not w._closed and time.monotonic() < end:
                time.sleep(0.001)
            end = time.monotonic() + 0.2  # the old close shut the pool down at once
            while not pool._shutdown and time.monotonic() < end:
                time.sleep(0.001)
        return real(fn, *args)

    pool.submit = submit
    seen = np.zeros(4, dtype=np.int64)
    helper_done = threading.Event()

    def fn(a: int, b: int) -> None:
        if a == 1:
            time.sleep(0.3)  # the part handed to a helper before close() is still copying
            helper_done.set()
        seen[a:b] += 1

    w.run(fn, 4)
    assert helper_done.is_set()  # run returned only after the handed-out part ended
    assert seen.tolist() == [1, 1, 1, 1]
    closer[0].join(5)
    assert not closer[0].is_alive() and w._pool is None


def test_close_waits_for_a_run_in_progress():
    w = CopyWorkers(2)
    inside, go = threading.Event(), threading.Event()

    def fn(a: int, b: int) -> None:
        if a:
            inside.set()
            go.wait(5)

    runner = threading.Thread(target=w.run, args=(fn, 2))
    runner.start()
    assert inside.wait(5)
    closer = threading.Thread(target=w.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # held off by the run
    go.set()
    runner.join(5)
    closer.join(5)
    assert not closer.is_alive()
