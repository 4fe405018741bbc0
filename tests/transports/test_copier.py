"""copier: vectorised copies equal a reference gather/scatter (with and without copy workers),
both by the C run copier and by the NumPy/torch paths used without it; descriptor arithmetic is
exact."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runs_testlib import RUN_SLACK, disjoint_runs, reference_runs

from kvplane.errors import PlanError
from kvplane.ids import RegionId
from kvplane.transports import copier
from kvplane.transports.base import DescriptorList
from kvplane.transports.copier import (
    LOOP_MAX,
    _np_loop,
    check_disjoint,
    check_no_cross_overlap,
    coalesce,
    copy_packed,
    copy_pairs,
    copy_runs,
    split,
)
from kvplane.transports.native_copy import kernel
from kvplane.transports.rows import PART_BYTES
from kvplane.transports.workers import CopyWorkers

SRC, DST = RegionId(1), RegionId(2)


@pytest.fixture(autouse=True, scope="module", params=["native", "numpy_torch"])
def copy_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test of this module runs with the C run copier and with it disabled."""
    if request.param == "native" and kernel().library is None:
        pytest.skip("needs a C compiler to build the run copier")
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "numpy_torch":
            mp.setattr(copier, "copy_runs_native", lambda *a, **k: False)
        yield str(request.param)


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("torch_pool", [False, True])
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), max_run=st.sampled_from([1, 7, 64, 4096, 200_000]),
       max_desc=st.sampled_from([1, LOOP_MAX, 300]))  # fmt: skip
def test_copy_pairs_matchesreference_runs(kit, seed, max_run, max_desc, torch_pool):
    rng = np.random.default_rng(seed)
    src_len, dst_len = 1 << 20, 1 << 20
    s, d = kit.random_batch(rng, SRC, src_len, DST, dst_len, max_desc=max_desc, max_run=max_run)
    src, dst = _bytes(src_len, seed), _bytes(dst_len, seed + 1)
    expected = kit.reference(src, dst, s, d)
    copy_pairs({SRC: src}, {DST: dst}, s, d, torch_pool=torch_pool)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("torch_pool", [False, True])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), length=st.sampled_from([3, 512, 4096, 65536]),
       shifts=st.sampled_from([(0, 0), (4, 8), (5, 4), (0, 4)]))  # fmt: skip
def test_equal_runs_back_to_back_and_shuffled(kit, seed, length, shifts, torch_pool):
    """The vectorised paths: contiguous source, contiguous destination, a permuted destination
    span, a sparse destination, both scattered; bases shifted off 8-byte alignment."""
    rng = np.random.default_rng(seed)
    src_shift, dst_shift = shifts
    n = 40
    size = 2 * n * length + 8
    sparse = rng.choice(2 * n, n, replace=False)
    for src_order, dst_order in ((np.arange(n), rng.permutation(n)),
                                 (rng.permutation(n), np.arange(n)),
                                 (np.arange(n), sparse),
                                 (rng.permutation(n), sparse),
                                 (rng.permutation(n), rng.permutation(n))):  # fmt: skip
        s = DescriptorList(np.full(n, SRC), src_order * length + src_shift, np.full(n, length))
        d = DescriptorList(np.full(n, DST), dst_order * length + dst_shift, np.full(n, length))
        src, dst = _bytes(size, seed), torch.zeros(size, dtype=torch.uint8)
        expected = kit.reference(src, dst, s, d)
        copy_pairs({SRC: src}, {DST: dst}, s, d, torch_pool=torch_pool)
        assert torch.equal(dst, expected)


def test_copy_packed_round_trips(kit):
    rng = np.random.default_rng(3)
    s, d = kit.random_batch(rng, SRC, 1 << 16, DST, 1 << 16, max_desc=500, max_run=100)
    src = _bytes(1 << 16, 3)
    packed = torch.zeros(s.total_bytes + 10, dtype=torch.uint8)
    copy_packed({SRC: src}, s, packed, unpack=False)
    assert torch.equal(packed[: s.total_bytes], src[kit.byte_index(s)])
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    copy_packed({DST: dst}, d, packed[: s.total_bytes], unpack=True)
    assert torch.equal(dst, kit.reference(src, torch.zeros(1 << 16, dtype=torch.uint8), s, d))


def test_coalesce_merges_only_runs_continued_on_both_sides():
    s = DescriptorList.of([(1, 0, 10), (1, 10, 5), (1, 15, 5), (1, 40, 5), (2, 45, 5)])
    d = DescriptorList.of([(2, 100, 10), (2, 110, 5), (2, 200, 5), (2, 205, 5), (2, 210, 5)])
    assert coalesce(s, d)[0] is s  # 5 -> 4 pairs is not worth breaking the batch's shape
    cs, cd = coalesce(s, d, min_gain=1.0)
    assert cs.equals(DescriptorList.of([(1, 0, 15), (1, 15, 5), (1, 40, 5), (2, 45, 5)]))
    assert cd.equals(DescriptorList.of([(2, 100, 15), (2, 200, 5), (2, 205, 5), (2, 210, 5)]))
    assert cs.total_bytes == s.total_bytes


def test_coalesce_keeps_a_merge_that_halves_the_pairs():
    s = DescriptorList.of([(1, i * 8, 8) for i in range(6)])
    d = DescriptorList.of([(2, 100 + i * 8, 8) for i in (0, 1, 2, 3)] + [(2, 0, 8), (2, 50, 8)])
    cs, cd = coalesce(s, d)
    assert cs.equals(DescriptorList.of([(1, 0, 32), (1, 32, 8), (1, 40, 8)]))
    assert cd.equals(DescriptorList.of([(2, 100, 32), (2, 0, 8), (2, 50, 8)]))


def test_split_cuts_long_runs_in_order():
    s = DescriptorList.of([(1, 0, 10), (1, 50, 3)])
    d = DescriptorList.of([(2, 7, 10), (2, 0, 3)])
    ss, sd = split(s, d, 4)
    assert ss.equals(DescriptorList.of([(1, 0, 4), (1, 4, 4), (1, 8, 2), (1, 50, 3)]))
    assert sd.equals(DescriptorList.of([(2, 7, 4), (2, 11, 4), (2, 15, 2), (2, 0, 3)]))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 60), st.integers(1, 12)),
                min_size=1, max_size=12))  # fmt: skip
def test_check_disjoint_matches_brute_force(triples):
    descs = DescriptorList.of(triples)
    clash = any(
        a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]
        for i, a in enumerate(triples) for b in triples[i + 1 :]
    )  # fmt: skip
    if clash:
        with pytest.raises(PlanError, match="overlap"):
            check_disjoint(descs, "destination")
    else:
        check_disjoint(descs, "destination")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2), st.integers(0, 60), st.integers(1, 12)),
                min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(1, 2), st.integers(0, 60), st.integers(1, 12)),
                min_size=1, max_size=8))  # fmt: skip
def test_cross_overlap_matches_brute_force(srcs, dsts):
    clash = any(
        a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2] for a in srcs for b in dsts
    )
    if clash:
        with pytest.raises(PlanError, match="overlaps a source"):
            check_no_cross_overlap(DescriptorList.of(srcs), DescriptorList.of(dsts))
    else:
        check_no_cross_overlap(DescriptorList.of(srcs), DescriptorList.of(dsts))


def test_same_buffer_disjoint_blocks(kit):
    """Loopback inside one region: the row views share memory, so the NumPy path runs."""
    buf = _bytes(64 * 256, 9)
    original = buf.clone()
    perm = np.random.default_rng(9).permutation(32)
    s = DescriptorList(np.full(32, SRC), np.arange(32) * 256, np.full(32, 256))
    d = DescriptorList(np.full(32, SRC), (32 + perm) * 256, np.full(32, 256))
    copy_pairs({SRC: buf}, {SRC: buf}, s, d)
    assert torch.equal(buf, kit.reference(original, original, s, d))


# -- copy_runs with copy workers: runs laid end to end, cut at thread boundaries -------------
@pytest.mark.parametrize("threads", [None, 2, 3])
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    count=st.sampled_from([1, 5, 17, 40]),
    kind=st.sampled_from(["short", "long", "mixed", "equal_long"]),
)
def test_copy_runs_matchesreference_runs(seed, count, kind, threads):
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
    space = int(ln.sum()) + RUN_SLACK * count
    src = torch.from_numpy(rng.integers(0, 256, space, dtype=np.uint8))
    dst = torch.zeros(space, dtype=torch.uint8)
    so, do = disjoint_runs(rng, ln, space), disjoint_runs(rng, ln, space)
    want = reference_runs(src, so, dst, do, ln)
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
    want = reference_runs(src, so, dst, do, ln)
    workers = CopyWorkers(3)
    try:
        _np_loop(src.numpy(), so, dst.numpy(), do, ln, workers=workers)
    finally:
        workers.close()
    assert torch.equal(dst, want)
