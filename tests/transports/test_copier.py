"""copy_runs against a reference loop, with and without copy workers (runs cut mid-way)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.transports.copier import _np_loop, copy_runs
from kvplane.transports.rows import PART_BYTES
from kvplane.transports.workers import CopyWorkers


def _reference(src, so, dst, do, ln):
    out = dst.clone()
    for s, d, n in zip(so.tolist(), do.tolist(), ln.tolist(), strict=True):
        out[d : d + n] = src[s : s + n]
    return out


def _disjoint_runs(rng, lengths, space):
    """Offsets of ``lengths`` runs in a buffer of ``space`` bytes, non-overlapping, shuffled."""
    order = rng.permutation(len(lengths))
    gaps = rng.integers(0, 64, len(lengths))
    offsets = np.zeros(len(lengths), dtype=np.int64)
    at = 0
    for i in order:
        at += int(gaps[i])
        offsets[i] = at
        at += int(lengths[i])
    assert at <= space
    return offsets


@pytest.mark.parametrize("threads", [None, 2, 3])
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    count=st.sampled_from([1, 5, 17, 40]),
    kind=st.sampled_from(["short", "long", "mixed", "equal_long"]),
)
def test_copy_runs_matches_reference(seed, count, kind, threads):
    rng = np.random.default_rng(seed)
    if kind == "short":
        ln = rng.integers(1, 600, count)
    elif kind == "long":
        ln = rng.integers(PART_BYTES // 2, 3 * PART_BYTES, count)
    elif kind == "equal_long":
        ln = np.full(count, 40 << 10)
    else:
        ln = np.where(rng.random(count) < 0.5, rng.integers(1, 600, count), 3 * PART_BYTES + 7)
    ln = ln.astype(np.int64)
    space = int(ln.sum()) + 64 * count + 1
    src = torch.from_numpy(rng.integers(0, 256, space, dtype=np.uint8))
    dst = torch.zeros(space, dtype=torch.uint8)
    so, do = _disjoint_runs(rng, ln, space), _disjoint_runs(rng, ln, space)
    want = _reference(src, so, dst, do, ln)
    workers = None if threads is None else CopyWorkers(threads)
    try:
        copy_runs(src, so, dst, do, ln, workers=workers)
    finally:
        if workers is not None:
            workers.close()
    assert torch.equal(dst, want)


def test_np_loop_cuts_runs_laid_end_to_end_at_thread_boundaries():
    """Three threads over runs of 3, 1 and 2 parts: the two cuts fall inside runs."""
    ln = np.array([3, 1, 2], dtype=np.int64) * PART_BYTES + np.array([5, 0, 11])
    so = np.array([0, 4, 6], dtype=np.int64) * PART_BYTES
    do = np.array([6, 3, 0], dtype=np.int64) * PART_BYTES  # disjoint destinations
    src = torch.from_numpy(np.random.default_rng(1).integers(0, 256, 10 * PART_BYTES, np.uint8))
    dst = torch.zeros(10 * PART_BYTES + 64, dtype=torch.uint8)
    want = _reference(src, so, dst, do, ln)
    workers = CopyWorkers(3)
    try:
        _np_loop(src.numpy(), so, dst.numpy(), do, ln, workers=workers)
    finally:
        workers.close()
    assert torch.equal(dst, want)
