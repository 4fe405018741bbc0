"""Step-by-step growth of a window group's table on a pool's reservations: the pool's
reservation count (reserve, unreserve, allocate drawing on it, touch refused on it, integrity),
:class:`Growth` admission, :meth:`BlockTable.grow_to` and the reservation kept at "peak less
held", :func:`window_peak` against a replay of the steps, and a Hypothesis property: requests
admitted concurrently over one pool never over-commit it and every one finishes its prefill
without a refused growth; pools and reservations balance at the end."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.blocks import BlockHasher, BlockPool, BlockTable, Growth, window_peak
from kvplane.errors import BlockStateError, InvalidArgumentError
from kvplane.ids import BlockId, RequestId, TokenRange

Snap = Callable[[Any], tuple[Any, ...]]

RID = RequestId("r")


@dataclass(frozen=True)
class _Window:
    """A window group's layout as the growth reads it: window ``w``."""

    w: int

    def window_start(self, num_tokens: int) -> int:
        return max(0, num_tokens + 1 - self.w)


def _hasher() -> BlockHasher:
    return BlockHasher(seed=0, fingerprint=b"growth")


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n)


# -- the pool's reservations ---------------------------------------------------------------------
def test_reserved_blocks_are_free_but_only_their_holder_takes_them() -> None:
    pool = BlockPool(6, 2)
    assert pool.reserve(4) and pool.num_reserved_blocks == 4
    assert (pool.num_free_blocks, pool.num_available_blocks) == (6, 2)
    assert not pool.reserve(3)  # 2 available: nothing changes
    assert pool.allocate(3) is None and pool.num_reserved_blocks == 4
    got = pool.allocate(3, reserved=1)  # 2 available + 1 of the reservation
    assert got is not None and len(got) == 3
    assert (pool.num_free_blocks, pool.num_reserved_blocks, pool.num_available_blocks) == (3, 3, 0)
    pool.check_integrity()
    pool.unreserve(3)
    assert (pool.num_reserved_blocks, pool.num_available_blocks) == (0, 3)
    pool.free(got)
    pool.check_integrity()
    assert (pool.num_free_blocks, pool.num_used_blocks) == (6, 0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.reserve(-1), "reserve's n"),
        (lambda p: p.unreserve(3), "unreserve's n"),
        (lambda p: p.allocate(1, reserved=2), "allocate's reserved"),
        (lambda p: p.allocate(3, reserved=3), "allocate's reserved"),
    ],
)
def test_a_bad_reservation_call_is_refused_before_any_change(
    call: object, message: str, snap_pool: Snap
) -> None:
    pool = BlockPool(6, 2)
    assert pool.reserve(2)
    before = (snap_pool(pool), pool.num_reserved_blocks)
    with pytest.raises(InvalidArgumentError, match=message):
        call(pool)  # type: ignore[operator]
    assert (snap_pool(pool), pool.num_reserved_blocks) == before


def test_a_touch_may_not_take_a_reserved_free_block(snap_pool: Snap) -> None:
    pool, hasher = BlockPool(2, 2), _hasher()
    table = BlockTable(RID, 2, hasher)
    assert table.admit(pool, _tokens(2)) is not None
    table.mark_computed(pool, 2)  # block cached, then freed: matchable
    table.release(pool)
    block = pool.lookup(hasher.hash_blocks(_tokens(2), 2)[0])
    assert block is not None
    assert pool.reserve(2)
    before = snap_pool(pool)
    with pytest.raises(BlockStateError, match="reserved"):
        pool.touch([block])
    assert snap_pool(pool) == before
    pool.unreserve(1)
    pool.touch([block])
    pool.free([block])
    pool.unreserve(1)
    pool.check_integrity()


# -- a table grown step by step -----------------------------------------------------------------
def test_a_growth_table_holds_its_first_step_and_reserves_up_to_its_peak() -> None:
    pool, hasher = BlockPool(13, 4, null_block=True), _hasher()
    table = BlockTable(RID, 4, hasher)
    window, n = _Window(8), 45
    peak = window_peak(window, n, 4, 8)
    assert peak == 5  # 8 + 8 - 1 positions: at most 5 blocks of 4
    got = table.admit(pool, _tokens(n), grow=Growth(8, peak))
    assert got is not None and len(got.block_ids) == 2
    assert (table.num_covered_tokens, table.num_held_blocks, table.num_reserved_blocks) == (8, 2, 3)
    assert pool.num_reserved_blocks == 3 and pool.num_available_blocks == 12 - 2 - 3
    held, reserved = [], []
    for s in range(8, n, 8):  # drop before the step's window, then grow by its blocks
        table.drop_before(pool, window.window_start(s))
        assert table.grow_to(pool, min(s + 8, n))
        held.append(table.num_held_blocks)
        reserved.append(table.num_reserved_blocks)
        pool.check_integrity()
    assert held == [4, 4, 4, 4, 4]
    assert reserved == [1, 1, 1, 1, 0]  # peak 5 less 4 held, at most what it lacks of 12
    assert table.num_covered_tokens == n and len(table.block_ids) == 12
    table.release(pool)
    pool.check_integrity()
    assert (pool.num_used_blocks, pool.num_reserved_blocks) == (0, 0)


def test_admission_needs_the_peak_available_and_grow_to_refuses_without_change(
    snap_pool: Snap, snap_table: Snap
) -> None:
    pool, hasher = BlockPool(7, 4, null_block=True), _hasher()
    first = BlockTable(RID, 4, hasher)
    assert first.admit(pool, _tokens(40), grow=Growth(8, 5)) is not None  # holds 2, reserves 3
    second = BlockTable(RequestId("s"), 4, hasher)
    before = snap_pool(pool)
    assert second.admit(pool, _tokens(40, 1), grow=Growth(8, 2)) is None  # 1 available, needs 2
    assert snap_pool(pool) == before
    assert second.admit(pool, _tokens(40, 1), grow=Growth(4, 1)) is not None  # takes the last
    assert pool.num_available_blocks == 0
    # past its peak a table draws on available blocks only: none
    assert first.grow_to(pool, 20)  # 3 more: its reservation
    snap = (snap_pool(pool), snap_table(first), first.num_reserved_blocks)
    assert not first.grow_to(pool, 24)
    assert (snap_pool(pool), snap_table(first), first.num_reserved_blocks) == snap
    with pytest.raises(InvalidArgumentError, match="end"):
        first.grow_to(pool, 41)
    with pytest.raises(InvalidArgumentError, match=r"Growth\.peak"):
        Growth(4, 0)
    assert (snap_pool(pool), snap_table(first)) == snap[:2]
    # dropping gives the reservation back as blocks are freed: the next growth is covered
    assert first.drop_before(pool, 12) == 3 and first.num_reserved_blocks == 3
    assert first.grow_to(pool, 32) and first.num_held_blocks == 5
    for table in (first, second):
        table.release(pool)
    pool.check_integrity()
    assert (pool.num_used_blocks, pool.num_reserved_blocks) == (0, 0)


def test_a_grown_table_maps_and_computes_only_what_it_covers() -> None:
    pool = BlockPool(9, 2, null_block=True)
    table = BlockTable(RID, 2, _hasher())
    assert table.admit(pool, _tokens(16), grow=Growth(2, 4)) is not None
    assert table.drop_before(pool, 2) == 1 and table.num_reserved_blocks == 4
    assert table.grow_to(pool, 12) and len(table.block_ids) == 6
    assert (table.num_dropped_blocks, table.num_held_blocks, table.num_reserved_blocks) == (1, 5, 0)
    with pytest.raises(InvalidArgumentError, match="outside"):
        table.slot_mapping(TokenRange(10, 14))  # beyond what its blocks cover
    with pytest.raises(InvalidArgumentError, match="cannot mark"):
        table.mark_computed(pool, 13)
    assert table.slot_mapping(TokenRange(8, 12)).tolist()[0] == int(table.block_ids[4]) * 2
    table.mark_computed(pool, 12)
    table.release(pool)
    pool.check_integrity()
    assert (pool.num_used_blocks, pool.num_reserved_blocks) == (0, 0)


# -- the peak against a replay -------------------------------------------------------------------
def _replay(n: int, w: int, bs: int, step: int) -> int:
    """The most blocks a table holds over a prefill of ``n`` in steps of ``step``."""
    window, most = _Window(w), 0
    for s in range(0, n, step):
        e = min(s + step, n)
        most = max(most, -(-e // bs) - window.window_start(s) // bs)
    return most


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 200), w=st.integers(1, 40), bs=st.integers(1, 8), step=st.integers(1, 40),
    shift=st.integers(0, 39),
)  # fmt: skip
def test_window_peak_bounds_every_step_alignment(
    n: int, w: int, bs: int, step: int, shift: int
) -> None:
    """Steps starting at any offset (a loaded prefix shifts them) hold at most the peak."""
    peak = window_peak(_Window(w), n, bs, step)
    window, start = _Window(w), min(shift, n - 1)
    for s in range(start, n, step):
        e = min(s + step, n)
        assert -(-e // bs) - window.window_start(s) // bs <= peak
    assert _replay(n, w, bs, step) <= peak <= -(-n // bs)


def test_window_peak_values_and_bad_counts() -> None:
    assert window_peak(_Window(8), 45, 4, 8) == 5
    assert window_peak(_Window(8), 45, 4, 8, 8) == 7  # + a step's store in flight
    assert window_peak(_Window(8), 45, 4, 1) == 3  # decode-like: the window's span
    assert window_peak(_Window(64), 45, 4, 8) == 12  # the prompt never outgrows its window
    with pytest.raises(InvalidArgumentError, match="step"):
        window_peak(_Window(8), 45, 4, 0)


# -- concurrent admissions -----------------------------------------------------------------------
@dataclass
class _Req:
    table: BlockTable
    window: _Window
    steps: list[TokenRange]
    peak: int
    next_step: int = 0


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(4, 40),
    bs=st.integers(1, 4),
    reqs=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 24), st.integers(1, 16)), min_size=1,
        max_size=8,
    ),
    order=st.lists(st.integers(0, 7), max_size=200),
)  # fmt: skip
def test_concurrent_admissions_never_overcommit_and_every_prefill_finishes(
    capacity: int, bs: int, reqs: list[tuple[int, int, int]], order: list[int]
) -> None:
    pool, hasher = (
        BlockPool(capacity + 1, bs, null_block=True),
        _hasher(),
    )
    waiting: list[tuple[int, int, int, int]] = []
    for i, (n, w, step) in enumerate(reqs):
        if window_peak(_Window(w), n, bs, step) <= capacity:  # what the worker admits at all
            waiting.append((i, n, w, step))
    running: list[_Req] = []
    finished, picks = 0, iter(order)
    while waiting or running:
        while waiting:  # admit in order while the pool's available blocks cover the peak
            i, n, w, step = waiting[0]
            steps = [TokenRange(s, min(s + step, n)) for s in range(0, n, step)]
            peak = window_peak(_Window(w), n, bs, step)
            table = BlockTable(RequestId(f"r{i}"), bs, hasher)
            if table.admit(pool, _tokens(n, i), grow=Growth(steps[0].end, peak)) is None:
                assert running, "an idle pool admits any request that fits"
                break
            waiting.pop(0)
            running.append(_Req(table, _Window(w), steps, peak))
        req = running[next(picks, 0) % len(running)]
        rng = req.steps[req.next_step]
        assert req.table.grow_to(pool, rng.end), "a reserved growth is never refused"
        assert req.table.num_held_blocks <= req.peak
        req.table.drop_before(pool, req.window.window_start(rng.end))
        req.next_step += 1
        assert pool.num_used_blocks + pool.num_reserved_blocks <= capacity
        assert pool.num_reserved_blocks == sum(r.table.num_reserved_blocks for r in running)
        if req.next_step == len(req.steps):
            req.table.release(pool)
            running.remove(req)
            finished += 1
        pool.check_integrity()
    assert finished == len(
        [r for r in reqs if window_peak(_Window(r[1]), r[0], bs, r[2]) <= capacity]
    )
    assert (pool.num_used_blocks, pool.num_reserved_blocks) == (0, 0)
    assert all(pool.ref_count(BlockId(b)) == 0 for b in range(capacity))
