"""``--pipelining auto``: the model's choice per request (exact figures from the tiny link)."""

from __future__ import annotations

import dataclasses

import pytest
from simulate_testlib import BYTES_PER_TOKEN, SLICE_BW, tiny_spec

from kvplane.simulate.calibrate import PD_LINKS
from kvplane.simulate.pipelining import (
    EXPLORE,
    LINK_WINDOW,
    REFRESH,
    WINDOW,
    AutoPipelining,
    Choice,
)
from kvplane.simulate.spec import PrefillSpec, TransportSpec
from kvplane.simulate.timing import alone_ttft_s, choose_pipelining

# the tiny link: 5 ms an op + 0.1 s per 512 tokens of bytes, lands 10 ms later
LINK = tiny_spec().transport


def test_alone_ttft_is_the_engines_arithmetic() -> None:
    spec = PrefillSpec(token_s=1e-3, slice_tokens=512)
    # 4 slices of 0.512 s compute; the last op (0.105 s) starts at 2.048 s, lands 0.01 s later
    assert alone_ttft_s(spec, LINK, BYTES_PER_TOKEN, 2048) == pytest.approx(2.048 + 0.115)
    bulk = dataclasses.replace(spec, pipelined=False)
    assert alone_ttft_s(bulk, LINK, BYTES_PER_TOKEN, 2048) == pytest.approx(2.048 + 0.415)
    # a 1,024-token hit sent at once, then 2 computed slices
    assert alone_ttft_s(spec, LINK, BYTES_PER_TOKEN, 2048, 1024) == pytest.approx(1.024 + 0.115)


def test_choice_follows_the_compute_to_transfer_balance() -> None:
    spec = PrefillSpec(token_s=1e-3, slice_tokens=512)
    assert choose_pipelining(spec, LINK, BYTES_PER_TOKEN, 2048) == spec  # slices hide
    # per-op cost far above a slice's compute: one bulk op after the prefill wins
    slow_ops = TransportSpec(bandwidth_bytes_s=1e12, op_overhead_s=3.0)
    got = choose_pipelining(spec, slow_ops, BYTES_PER_TOKEN, 2048)
    assert got == dataclasses.replace(spec, pipelined=False)
    # slices that stretch the compute (shared memory bandwidth) lose to a quiet prefill:
    # 0.358 s + 3 x 0.512 s + 0.115 s pipelined against 4 x 0.358 s + 0.415 s
    quiet = PrefillSpec(token_s=0.7e-3, slice_tokens=512, contention=3 / 7)
    assert alone_ttft_s(quiet, LINK, BYTES_PER_TOKEN, 2048) == pytest.approx(0.3584 + 1.651)
    got = choose_pipelining(quiet, LINK, BYTES_PER_TOKEN, 2048)
    assert got == dataclasses.replace(quiet, pipelined=False)
    assert alone_ttft_s(got, LINK, BYTES_PER_TOKEN, 2048) == pytest.approx(1.4336 + 0.415)
    # 128-token steps: an op costs 5 ms + 25 ms against 128 ms of compute; 1 step a slice
    short = PrefillSpec(token_s=1e-3, slice_tokens=128)
    assert choose_pipelining(short, LINK, BYTES_PER_TOKEN, 2048).slice_tokens == 128
    fixed = TransportSpec(bandwidth_bytes_s=1e12, op_overhead_s=0.2)  # op 200 ms, 128 ms steps
    assert choose_pipelining(short, fixed, BYTES_PER_TOKEN, 2048).slice_tokens == 256


def _explored(busy: float, quiet: float = 1e-3) -> AutoPipelining:
    """An auto choice that explored both modes (each :data:`EXPLORE` times, alternately) on
    2,048-token requests at ``busy`` and ``quiet`` seconds a token."""
    auto = AutoPipelining(LINK, BYTES_PER_TOKEN)
    for mode in (True, False) * EXPLORE:
        assert auto.choose(2048, 0, 512) == Choice(mode)
        auto.observe(mode, 2048, 2048 * (busy if mode else quiet))
    return auto


def test_auto_explores_both_modes_then_asks_the_model() -> None:
    auto = _explored(1e-3)
    assert auto.choose(2048, 0, 512) == Choice(True, 1)  # no contention: slices hide
    # pipelined steps 1.6 ms a token: contention 0.6 x 4 / 3 = 0.8; 3.39 s against 2.46 s
    slowed = _explored(1.6e-3)
    assert slowed.choose(2048, 0, 512) == Choice(False)
    slowed.observe(False, 2048, 2048 * 5e-3)  # a load spike: the least sample stands
    assert slowed.token_s(False) == 1e-3
    assert slowed.choose(2048, 0, 512) == Choice(False)
    # 1.18 ms: contention 0.24, non-pipelined 2.463 s against 2.532 s is under MARGIN
    assert _explored(1.18e-3).choose(2048, 0, 512) == Choice(True, 1)
    assert _explored(1.25e-3).choose(2048, 0, 512) == Choice(False)  # 2.463 s against 2.675 s
    assert auto.choose(512, 0, 512) == Choice(True)  # one step: nothing to choose
    assert AutoPipelining(None, 1).choose(4096, 0, 256) == Choice(True)
    assert set(PD_LINKS) == {"tcp", "shm"}


def test_auto_measures_an_unused_mode_again() -> None:
    auto = _explored(1.6e-3)
    for _ in range(REFRESH):  # the model keeps choosing non-pipelined...
        auto.observe(False, 2048, 2.048)
    assert auto.choose(2048, 0, 512) == Choice(True)  # ...so pipelined is measured again
    auto.observe(True, 2048, 2.048)  # now as fast as the quiet steps
    assert auto.choose(2048, 0, 512) == Choice(True, 1)
    for _ in range(WINDOW):  # the window forgets the fast samples
        auto.observe(True, 2048, 2048 * 1.6e-3)
    assert auto.token_s(True) == pytest.approx(1.6e-3)


SLICE = 512 * BYTES_PER_TOKEN  # one 512-token slice's bytes: 0.1 s at SLICE_BW


def test_the_link_bandwidth_converges_to_the_observed_cost() -> None:
    auto = AutoPipelining(LINK, BYTES_PER_TOKEN)
    assert auto.learned_link(LINK) == LINK  # nothing observed: the prior
    auto.observe_link([0.205] * 4, [SLICE] * 4)  # the prior's 0.105 s op: 5 ms + 0.2 s of bytes
    got = auto.learned_link(LINK)
    assert got.bandwidth_bytes_s == pytest.approx(SLICE_BW / 2)
    assert (got.op_overhead_s, got.rtt_s) == (LINK.op_overhead_s, LINK.rtt_s)
    assert got.op_overhead_s + SLICE / got.bandwidth_bytes_s == pytest.approx(0.205)
    # a spike, a short op and one under the overhead (free bytes) move the median a rank each
    auto.observe_link([1.005, 0.105, 0.001], [SLICE] * 3)
    assert auto.learned_link(LINK).bandwidth_bytes_s == pytest.approx(SLICE_BW / 2)
    # ignored: lengths that differ (a slice not done), an op with no bytes or no time
    auto.observe_link([9.0], [SLICE, SLICE])
    auto.observe_link([9.0, 0.0], [0, SLICE])
    assert len(auto.link_s_per_byte) == 7
    for _ in range(LINK_WINDOW):  # the window forgets: now 0.3 s of bytes
        auto.observe_link([0.305], [SLICE])
    assert auto.learned_link(LINK).bandwidth_bytes_s == pytest.approx(SLICE_BW / 3)
    fast = AutoPipelining(LINK, BYTES_PER_TOKEN)
    fast.observe_link([0.001], [SLICE])  # no bytes time at all: the prior stands
    assert fast.learned_link(LINK) == LINK
    AutoPipelining(None, 1).observe_link([1.0], [SLICE])  # no link: nothing to learn


def test_a_learned_link_bandwidth_flips_the_slice_size() -> None:
    # ops of 0.5 s + 0.1 s per 512 tokens outrun 512-token steps of 0.512 s: a slice a step
    # queues (2.912 s), two 2-step slices land at 2.748 s (more than 5% sooner)
    link = TransportSpec(bandwidth_bytes_s=SLICE_BW, op_overhead_s=0.5)
    auto = AutoPipelining(link, BYTES_PER_TOKEN)
    for mode in (True, False) * EXPLORE:
        assert auto.choose(2048, 0, 512) == Choice(mode)
        auto.observe(mode, 2048, 2.048)
    assert auto.choose(2048, 0, 512) == Choice(True, 2)
    one = PrefillSpec(token_s=1e-3, slice_tokens=512)
    two = dataclasses.replace(one, slice_tokens=1024)
    assert alone_ttft_s(one, link, BYTES_PER_TOKEN, 2048) == pytest.approx(2.912)
    assert alone_ttft_s(two, link, BYTES_PER_TOKEN, 2048) == pytest.approx(2.748)
    # the worker's slices took 0.51 s: bytes 10x faster, 0.51 s ops under the 0.512 s steps
    auto.observe_link([0.51] * 4, [SLICE] * 4)
    assert auto.choose(2048, 0, 512) == Choice(True, 1)
    learned = auto.learned_link(link)
    assert alone_ttft_s(one, learned, BYTES_PER_TOKEN, 2048) == pytest.approx(2.558)
    assert alone_ttft_s(two, learned, BYTES_PER_TOKEN, 2048) == pytest.approx(2.568)
    # later slices at the prior's cost: once they are the median, 2-step slices again
    auto.observe_link([0.6] * 5, [SLICE] * 5)
    assert auto.choose(2048, 0, 512) == Choice(True, 2)
