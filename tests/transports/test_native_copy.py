"""native_copy: the C run copier moves exactly the requested bytes -- any run lengths (zero
included) and byte offsets, any cut of the move into thread windows, with and without
streaming stores -- and refuses runs outside their buffers before copying anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runs_testlib import RUN_SLACK, disjoint_runs, reference_runs

from kvplane.errors import InvalidArgumentError
from kvplane.native import KernelBuild
from kvplane.transports import native_copy
from kvplane.transports.native_copy import SPLIT_MIN, STREAM_MIN, copy_runs_native, kernel
from kvplane.transports.workers import CopyWorkers

pytestmark = pytest.mark.skipif(
    kernel().library is None, reason="needs a C compiler to build the run copier"
)


def _case(seed, count, max_len, equal):
    rng = np.random.default_rng(seed)
    ln = np.full(count, max_len) if equal else rng.integers(0, max_len + 1, count)
    ln = ln.astype(np.int64)
    space = int(ln.sum()) + RUN_SLACK * count
    src = torch.from_numpy(rng.integers(0, 256, space, dtype=np.uint8))
    dst = torch.from_numpy(rng.integers(0, 256, space, dtype=np.uint8))
    return rng, src, disjoint_runs(rng, ln, space), dst, disjoint_runs(rng, ln, space), ln


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    count=st.sampled_from([1, 3, 40]),
    max_len=st.sampled_from([1, 255, 256, 1000, 5000]),
    equal=st.booleans(),
    stream=st.sampled_from([0, 1]),
    cuts=st.integers(0, 6),
)
def test_windows_of_any_cut_add_up_to_the_whole_move(*, seed, count, max_len, equal, stream, cuts):
    rng, src, so, dst, do, ln = _case(seed, count, max_len, equal)
    want = reference_runs(src, so, dst, do, ln)
    total = int(ln.sum())
    bounds = [0, *sorted(rng.integers(0, total + 1, cuts).tolist()), total]
    ends = None if equal else np.cumsum(ln)
    fn = kernel().library.kvp_copy_window
    for i in rng.permutation(len(bounds) - 1).tolist():  # any order: windows are disjoint
        a, b = bounds[i], bounds[i + 1]
        fn(src.data_ptr(), dst.data_ptr(), so.ctypes.data, do.ctypes.data,
           None if ends is None else ends.ctypes.data, max_len, count, a, b, stream)  # fmt: skip
    assert torch.equal(dst, want)


@pytest.mark.parametrize("threads", [None, 2, 3])
@pytest.mark.parametrize("equal", [True, False])
def test_a_streamed_move_on_several_threads_is_exact(threads, equal):
    """Over :data:`STREAM_MIN` bytes (streaming stores), odd offsets and lengths, windows cut
    inside runs; every byte outside the runs keeps its value."""
    _, src, so, dst, do, ln = _case(7, 700, 12_345, equal)
    assert int(ln.sum()) >= max(STREAM_MIN, 2 * SPLIT_MIN)  # streamed, and split in windows
    want = reference_runs(src, so, dst, do, ln)
    workers = None if threads is None else CopyWorkers(threads)
    try:
        assert copy_runs_native(src, so, dst, do, ln, workers=workers)
    finally:
        if workers is not None:
            workers.close()
    assert torch.equal(dst, want)


def test_a_run_outside_its_buffer_is_refused_before_any_byte_moves():
    _, src, so, dst, do, ln = _case(3, 5, 100, True)
    before = dst.clone()
    for bad_so, bad_do, bad_ln, side in (
        (so, np.append(do[:-1], dst.numel() - 99), ln, "destination"),
        (np.append(so[:-1], src.numel() - 10), do, ln, "source"),
        (np.append(so[:-1], -1), do, ln, "source"),
        (so, np.append(do[:-1], 2**63 - 50), ln, "destination"),  # offset + length wraps
        (so, do, np.append(ln[:-1], -1), "negative"),
    ):
        with pytest.raises(InvalidArgumentError, match=side):
            copy_runs_native(src, bad_so, dst, bad_do, bad_ln, workers=None)
        assert torch.equal(dst, before)


def test_buffers_it_cannot_take_and_a_missing_kernel_leave_the_move_to_the_caller(monkeypatch):
    _, src, so, dst, do, ln = _case(4, 4, 50, False)
    before = dst.clone()
    assert not copy_runs_native(src[::2], so // 2, dst, do, ln, workers=None)  # strided
    assert not copy_runs_native(src, so, dst.view(torch.int8), do, ln, workers=None)
    assert not copy_runs_native(src, so, dst.view(1, -1), do, ln, workers=None)
    monkeypatch.setattr(native_copy, "kernel", lambda: KernelBuild(None, "no C compiler found"))
    assert not copy_runs_native(src, so, dst, do, ln, workers=None)
    assert torch.equal(dst, before)


def test_empty_moves_copy_nothing():
    src, dst = torch.ones(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    empty = np.zeros(0, dtype=np.int64)
    assert copy_runs_native(src, empty, dst, empty, empty, workers=None)
    zeros = np.zeros(3, dtype=np.int64)
    assert copy_runs_native(src, zeros, dst, np.array([0, 5, 9]), zeros, workers=None)
    assert not dst.any()
