"""``--pipelining auto``: the model's choice per request (exact figures from the tiny link)."""

from __future__ import annotations

import dataclasses

import pytest
from simulate_testlib import BYTES_PER_TOKEN, tiny_spec

from kvplane.simulate.calibrate import PD_LINKS
from kvplane.simulate.pipelining import EXPLORE, REFRESH, WINDOW, AutoPipelining, Choice
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
