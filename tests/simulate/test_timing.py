"""The cost model and the event loop, by exact arithmetic."""

from __future__ import annotations

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.simulate.events import EventLoop
from kvplane.simulate.spec import DecodeSpec, PrefillSpec, TransportSpec
from kvplane.simulate.timing import (
    Lane,
    batch_s,
    book_op,
    compute_s,
    contention_of,
    prefill_slices,
    replayed_op,
    step_hold_s,
    tpot_s,
    transfer_pieces,
)
from kvplane.simulate.workload import Replayed


def test_lane_is_fifo() -> None:
    lane = Lane()
    assert lane.reserve(1.0, 2.0) == 3.0
    assert lane.reserve(0.0, 1.0) == 4.0  # ready earlier, but behind the first booking
    assert lane.reserve(10.0, 1.0) == 11.0
    assert lane.busy_s == 4.0


def test_batch_and_compute_costs() -> None:
    assert batch_s(3, 600, 0.5, 100.0) == 7.5
    spec = PrefillSpec(token_s=2.0, pair_s=1.0, step_s=10.0)
    assert compute_s(spec, 2, 5) == 10.0 + 2.0 * 3 + (2 + 3 + 4)
    assert tpot_s(DecodeSpec(token_s=0.5, ctx_token_s=0.25), 4) == 1.5


def test_prefill_slices_cover_the_uncached_tokens() -> None:
    spec = PrefillSpec(token_s=1.0, slice_tokens=4)
    assert prefill_slices(spec, 2, 12, 100.0) == [(2, 6, 104.0), (6, 10, 108.0), (10, 12, 110.0)]


def test_contention_stretches_pipelined_slices_computed_beside_a_transfer() -> None:
    spec = PrefillSpec(token_s=1.0, slice_tokens=4, contention=0.5)
    # the first slice has nothing in flight beside it; the next two are 1.5 times as long
    assert prefill_slices(spec, 0, 10, 0.0) == [(0, 4, 4.0), (4, 8, 10.0), (8, 10, 13.0)]
    # a loaded prefix is sent at once: every slice is stretched
    assert prefill_slices(spec, 2, 6, 0.0) == [(2, 6, 6.0)]
    quiet = PrefillSpec(token_s=1.0, slice_tokens=4, contention=0.5, pipelined=False)
    assert prefill_slices(quiet, 0, 10, 0.0)[-1] == (8, 10, 10.0)
    # 8 steps averaging 14.4 against 12.8 quiet: 7 of them stretched by 1/7
    assert contention_of(14.4, 12.8, 8) == pytest.approx(1 / 7)
    assert (contention_of(12.0, 12.8, 8), contention_of(20.0, 10.0, 1)) == (0.0, 0.0)


def test_transfer_pieces_pipelined_or_whole() -> None:
    pieces = [(1.0, 10), (2.0, 20)]
    assert transfer_pieces(pieces, 2.5, True) == pieces
    assert transfer_pieces(pieces, 2.5, False) == [(2.5, 30)]


def test_book_op_waits_for_both_lanes() -> None:
    t = TransportSpec(bandwidth_bytes_s=100.0, rtt_s=0.5, op_overhead_s=1.0)
    send, recv = Lane(), Lane()
    recv.reserve(0.0, 5.0)
    assert book_op(t, 1.0, 200, send, recv) == (5.0, 8.5)  # 1 + 200/100 held, lands 0.5 later
    assert send.free_at == recv.free_at == 8.0


def test_replayed_steps_and_ops_else_the_model() -> None:
    spec = PrefillSpec(token_s=1e-3, slice_tokens=512)
    measured = Replayed(step_s=(0.2, 0.3), after_s=(0.05,), op_s=(0.4, 0.6), submit_s=(0.01,))
    assert step_hold_s(spec, 0, 512, 0, None) == (0.512, 0.0)
    assert step_hold_s(spec, 0, 512, 0, measured) == (0.2, 0.05)
    assert step_hold_s(spec, 512, 1024, 1, measured) == (0.3, 0.0)  # no time after it
    assert step_hold_s(spec, 1024, 1100, 2, measured) == pytest.approx((0.076, 0.0))  # model
    # three ops (a loaded prefix, two slices), two spans and one delay measured: each aligned
    # to the last ones
    assert [replayed_op(measured, i, 3) for i in range(3)] == [(0, 0), (0, 0.4), (0.01, 0.6)]
    assert replayed_op(Replayed(), 0, 1) == (0.0, 0.0)


def test_event_loop_runs_in_time_then_schedule_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, int, int]] = []

    def record(a: int, b: int) -> None:
        seen.append((loop.now, a, b))
        if a == 1:
            loop.at(loop.now, 0, 9, 9)  # same time, scheduled later: runs after the others

    loop.at(2.0, 0, 2)
    loop.at(1.0, 0, 1)
    loop.at(1.0, 0, 3)
    loop.run([record])
    assert seen == [(1.0, 1, 0), (1.0, 3, 0), (1.0, 9, 9), (2.0, 2, 0)]
    assert loop.processed == 4
    with pytest.raises(InvalidArgumentError, match="before now"):
        loop.at(1.0, 0)
