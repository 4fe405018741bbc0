"""The engine on hand-computed scenarios: TTFT by arithmetic, pipelined vs not, prefix loads,
decode queueing, a worker killed mid-prefill."""

from __future__ import annotations

import pytest
from simulate_testlib import (
    BYTES_PER_TOKEN,
    OVERHEAD,
    RTT,
    SLICE_BW,
    device_tier,
    request,
    tiny_spec,
)

from kvplane.simulate.spec import DecodeSpec, FailureSpec, PrefillSpec
from kvplane.simulate.summary import simulate

EXACT = 1e-12
SLICE_OP = OVERHEAD + 512 * BYTES_PER_TOKEN / SLICE_BW + RTT  # 0.115 s: send to landing


def test_one_request_pipelined_ttft_is_compute_plus_last_slice() -> None:
    result, sim = simulate(tiny_spec(), [request(0, 0.0, 2048)])
    (o,) = sim.outcomes()
    # 4 slices of 512 tokens at 1 ms per token end at 0.512, 1.024, 1.536, 2.048 s; each
    # transfer (0.115 s) ends before the next slice does, so only the last one is exposed.
    assert o.prefill_end_s == pytest.approx(2.048, rel=EXACT)
    assert o.ttft_s == pytest.approx(2.048 + SLICE_OP, rel=EXACT)
    assert o.exposed_tail_s == pytest.approx(SLICE_OP, rel=EXACT)
    assert result.overlap_ratio == pytest.approx(0.75, rel=EXACT)  # 3 of 4 equal ops hidden
    assert o.done_s - o.ready_s == pytest.approx(10 * 0.02, rel=EXACT)  # 10 tokens after the 1st
    assert result.tpot_s.p50 == pytest.approx(0.02, rel=EXACT)
    assert result.transport_bytes == result.logical_bytes == 2048 * BYTES_PER_TOKEN
    assert result.transfer_amplification == 1.0


def test_setup_delays_the_first_step() -> None:
    spec = tiny_spec(prefill=PrefillSpec(token_s=1e-3, slice_tokens=512, setup_s=0.25))
    _, sim = simulate(spec, [request(0, 1.0, 2048), request(1, 1.0, 512)])
    first, second = sim.outcomes()
    assert (first.compute_start_s, first.prefill_end_s) == pytest.approx((1.25, 3.298), rel=EXACT)
    # the worker is held through the setup: the second request starts after the first
    assert second.compute_start_s == pytest.approx(3.298 + 0.25, rel=EXACT)


def test_non_pipelined_sends_everything_after_prefill() -> None:
    spec = tiny_spec(prefill=PrefillSpec(token_s=1e-3, slice_tokens=512, pipelined=False))
    result, sim = simulate(spec, [request(0, 0.0, 2048)])
    (o,) = sim.outcomes()
    whole = OVERHEAD + 2048 * BYTES_PER_TOKEN / SLICE_BW + RTT  # 0.415 s
    assert o.ttft_s == pytest.approx(2.048 + whole, rel=EXACT)
    assert o.exposed_tail_s == pytest.approx(whole, rel=EXACT)
    assert result.overlap_ratio == 0.0


def test_pipelined_tail_is_the_last_slice_even_when_short() -> None:
    _, sim = simulate(tiny_spec(), [request(0, 0.0, 1200)])  # slices 512, 512, 176 tokens
    (o,) = sim.outcomes()
    last = OVERHEAD + 176 * BYTES_PER_TOKEN / SLICE_BW + RTT
    assert o.prefill_end_s == pytest.approx(1.2, rel=EXACT)
    assert o.exposed_tail_s == pytest.approx(last, rel=EXACT)


def test_a_last_slice_shorter_than_a_transfer_waits_for_the_link() -> None:
    _, sim = simulate(tiny_spec(), [request(0, 0.0, 1100)])  # slices 512, 512, 76 tokens
    (o,) = sim.outcomes()
    # slice 2's op holds the link until 1.024 + 0.105 s; slice 3 is ready at 1.1 s
    last = OVERHEAD + 76 * BYTES_PER_TOKEN / SLICE_BW + RTT
    assert o.exposed_tail_s == pytest.approx(1.129 - 1.1 + last, rel=EXACT)


def test_quadratic_prefill_term() -> None:
    spec = tiny_spec(prefill=PrefillSpec(token_s=0.0, pair_s=1e-6, step_s=0.5, slice_tokens=512))
    _, sim = simulate(spec, [request(0, 0.0, 1024)])
    # two steps: 0.5 + 1e-6 * (0 + ... + 511), 0.5 + 1e-6 * (512 + ... + 1023)
    assert sim.outcomes()[0].prefill_end_s == pytest.approx(1.0 + 1e-6 * 1023 * 1024 / 2, rel=EXACT)


def test_a_prefix_hit_loads_then_computes_the_rest() -> None:
    tier = device_tier(100, bandwidth_bytes_s=1536 * BYTES_PER_TOKEN / 0.03, op_overhead_s=0.001)
    same = tuple(range(4))
    reqs = [request(0, 0.0, 2048, ids=same), request(1, 100.0, 2048, ids=same)]
    result, sim = simulate(tiny_spec(tiers=(tier,)), reqs)
    second = sim.outcomes()[1]
    # 3 of 4 blocks hit (the last token is always computed): 3 ops + 1536 tokens' bytes = 33 ms
    assert second.hit_tokens == 1536
    assert second.compute_start_s - second.prefill_start_s == pytest.approx(0.033, rel=EXACT)
    assert second.prefill_end_s == pytest.approx(100.033 + 0.512, rel=EXACT)
    # the loaded 1536 tokens go first (0.3 s + op, hidden); the one computed slice is exposed
    assert second.exposed_tail_s == pytest.approx(SLICE_OP, rel=EXACT)
    assert result.prefix_hit_rate == pytest.approx(1536 / 4096, rel=EXACT)
    assert result.tiers[0].hit_bytes == 3 * 512 * BYTES_PER_TOKEN
    assert result.tiers[0].stored_bytes == 4 * 512 * BYTES_PER_TOKEN  # 4 full blocks, once


def test_decode_waits_for_a_batch_slot() -> None:
    spec = tiny_spec(prefill_workers=2, decode=DecodeSpec(token_s=0.02, max_batch=1))
    _, sim = simulate(spec, [request(0, 0.0, 512), request(1, 0.0, 512)])
    first, second = sim.outcomes()
    assert second.ready_s < first.done_s
    assert second.decode_start_s == pytest.approx(first.done_s, rel=EXACT)


def test_transfers_to_one_decode_worker_share_its_link() -> None:
    spec = tiny_spec(prefill_workers=2)
    _, sim = simulate(spec, [request(0, 0.0, 512), request(1, 0.0, 512)])
    first, second = sim.outcomes()
    hold = OVERHEAD + 512 * BYTES_PER_TOKEN / SLICE_BW
    assert first.ready_s == pytest.approx(0.512 + hold + RTT, rel=EXACT)
    assert second.ready_s == pytest.approx(0.512 + 2 * hold + RTT, rel=EXACT)


def test_killed_prefill_worker_reroutes_and_reports_release() -> None:
    spec = tiny_spec(prefill_workers=2, lease_s=0.5, failures=(FailureSpec("prefill", 0, 1.0),))
    result, sim = simulate(spec, [request(0, 0.0, 2048), request(1, 0.001, 2048)])
    lost, other = sim.outcomes()
    (failure,) = result.failures
    assert (failure.rerouted, failure.at_s) == (1, 1.0)
    assert failure.release_latency_s == pytest.approx(0.5 + RTT, rel=EXACT)
    assert lost.attempts == 2
    # seen dead at 1.5 s, queued behind request 1 on worker 1 (ends 2.049 s), 2.048 s again
    assert lost.prefill_start_s == pytest.approx(2.049, rel=EXACT)
    assert lost.ttft_s == pytest.approx(2.049 + 2.048 + SLICE_OP, rel=EXACT)
    assert other.attempts == 1
    assert result.completed == 2
    assert result.transfer_amplification > 1.0  # the lost attempt's first slice was sent


def test_killed_decode_worker_reroutes_its_sequences() -> None:
    spec = tiny_spec(
        decode_workers=2, lease_s=0.5, failures=(FailureSpec("decode", 0, 1.0),),
        decode=DecodeSpec(token_s=1.0),
    )  # fmt: skip
    result, sim = simulate(spec, [request(0, 0.0, 512, out=5)])
    (o,) = sim.outcomes()
    assert result.failures[0].rerouted == 1
    assert o.attempts == 2
    assert o.prefill_start_s == pytest.approx(1.5, rel=EXACT)  # computed again after the lease
    assert result.completed == 1
