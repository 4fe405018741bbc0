"""``kvplane serve``'s own policies in the engine: interleaved prefill steps, a serial decode
worker that takes no order while it decodes or behind a landed KV (and sends what it held
``accept_s`` after taking it), replayed decode, step and transfer times (exact figures on the
tiny cluster)."""

from __future__ import annotations

import dataclasses

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

from kvplane.errors import ConfigError
from kvplane.simulate.spec import DecodeSpec, PrefillSpec
from kvplane.simulate.summary import simulate
from kvplane.simulate.workload import Replayed

EXACT = 1e-12


def test_interleaved_prefill_steps_each_request_in_turn() -> None:
    fifo = PrefillSpec(token_s=1e-3, slice_tokens=512)
    both = [request(0, 0.0, 1536), request(1, 0.1, 512)]
    _, sim = simulate(tiny_spec(prefill=fifo), both)
    assert [o.prefill_end_s for o in sim.outcomes()] == pytest.approx([1.536, 2.048])
    turns = dataclasses.replace(fifo, interleave=True)
    _, sim = simulate(tiny_spec(prefill=turns), both)
    # as kvplane serve's worker rotates: r0's steps 0 and 1 (r1 joined behind r0 during step
    # 0), r1's only step, r0's last
    assert [o.prefill_end_s for o in sim.outcomes()] == pytest.approx([2.048, 1.536])
    # its first two slices were sent while steps still ran: hidden. An op's transfer time is
    # its span on the link, OVERHEAD + 512 x 512 B / SLICE_BW = 0.105 s (the RTT after it is
    # latency): 2 of 3 such ops hidden
    r0 = sim.flights[0]
    assert (r0.hidden_s, r0.transfer_s) == pytest.approx((0.21, 0.315), rel=EXACT)


def test_interleaved_contention_and_setup() -> None:
    spec = PrefillSpec(token_s=1e-3, slice_tokens=512, interleave=True, contention=0.5, setup_s=0.1)
    _, sim = simulate(tiny_spec(prefill=spec), [request(0, 0.0, 1024)])
    (o,) = sim.outcomes()
    assert o.compute_start_s == pytest.approx(0.1, rel=EXACT)
    assert o.prefill_end_s == pytest.approx(0.1 + 0.512 + 0.768, rel=EXACT)  # 2nd step x 1.5


def test_an_interleaving_workers_setups_hold_it_one_order_at_a_time() -> None:
    # as kvplane serve's worker takes orders between steps: r0's setup holds the worker
    # (0-0.1 s), r1's order (at 0.05 s) waits for it, then its setup (0.1-0.2 s); only then
    # steps: r0 (0.2-0.712), r1's only one (-1.224), r0's last (-1.736)
    spec = PrefillSpec(token_s=1e-3, slice_tokens=512, interleave=True, setup_s=0.1)
    _, sim = simulate(tiny_spec(prefill=spec), [request(0, 0.0, 1024), request(1, 0.05, 512)])
    r0, r1 = sim.outcomes()
    assert (r0.prefill_start_s, r1.prefill_start_s) == pytest.approx((0.0, 0.1), rel=EXACT)
    assert (r0.compute_start_s, r1.compute_start_s) == pytest.approx((0.1, 0.2), rel=EXACT)
    assert (r0.prefill_end_s, r1.prefill_end_s) == pytest.approx((1.736, 1.224), rel=EXACT)
    assert sim.prefill[0].busy_s == pytest.approx(0.2 + 3 * 0.512, rel=EXACT)


def test_a_serial_decode_worker_takes_no_order_while_it_decodes() -> None:
    serial = DecodeSpec(token_s=0.02, serial=True)
    assert serial.max_batch == 1
    # r0 lands at 0.627 s and decodes 10 tokens till 0.827 s; r1 (64 tokens) arrives at 0.7 s
    # and is ready to send at 0.764 s, but its order waits for r0's end
    reqs = [request(0, 0.0, 512), request(1, 0.7, 64)]
    op = OVERHEAD + 64 * BYTES_PER_TOKEN / SLICE_BW + RTT
    _, sim = simulate(tiny_spec(decode=serial), reqs)
    r0, r1 = sim.outcomes()
    assert r0.done_s == pytest.approx(0.827, rel=EXACT)
    assert r1.ready_s == r1.decode_start_s == pytest.approx(0.827 + op, rel=EXACT)
    batch1 = DecodeSpec(token_s=0.02, max_batch=1)  # sends go on, the sequence waits its turn
    _, sim = simulate(tiny_spec(decode=batch1), reqs)
    r1 = sim.outcomes()[1]
    assert (r1.ready_s, r1.decode_start_s) == pytest.approx((0.764 + op, 0.827), rel=EXACT)


def test_a_serial_decode_worker_takes_orders_behind_landed_kv_in_turn() -> None:
    # kvplane serve's decode worker has one FIFO inbox: r1's KV lands at 0.6445 s while r0
    # decodes (0.627-0.827 s); r2's order comes at 0.7 s, behind it, so it is taken only when
    # r1's decode ends (1.027 s), and r2's KV is sent then
    reqs = [request(0, 0.0, 512), request(1, 0.55, 64), request(2, 0.7, 64)]
    op = OVERHEAD + 64 * BYTES_PER_TOKEN / SLICE_BW + RTT
    _, sim = simulate(tiny_spec(decode=DecodeSpec(token_s=0.02, serial=True)), reqs)
    r1, r2 = sim.outcomes()[1:]
    assert r1.ready_s == pytest.approx(0.617 + op, rel=EXACT)  # behind r0's op on the link
    assert (r1.decode_start_s, r1.done_s) == pytest.approx((0.827, 1.027), rel=EXACT)
    assert r2.ready_s == r2.decode_start_s == pytest.approx(1.027 + op, rel=EXACT)


def test_a_replayed_decode_time_replaces_the_per_token_cost() -> None:
    spec = tiny_spec(decode=DecodeSpec(token_s=0.02, serial=True))
    measured = dataclasses.replace(request(1, 0.0, 512), decode_s=0.3)
    _, sim = simulate(spec, [request(0, 0.0, 512), measured])
    r0, r1 = sim.outcomes()
    assert r0.done_s - r0.decode_start_s == pytest.approx(10 * 0.02, rel=EXACT)
    assert r1.done_s - r1.decode_start_s == pytest.approx(0.3, rel=EXACT)


def test_an_accepted_order_sends_its_held_kv_accept_s_later() -> None:
    # as in the test above, r1's order is taken when r0's decode ends (0.827 s); its one op
    # goes 0.05 s later
    serial = DecodeSpec(token_s=0.02, serial=True, accept_s=0.05)
    op = OVERHEAD + 64 * BYTES_PER_TOKEN / SLICE_BW + RTT
    _, sim = simulate(tiny_spec(decode=serial), [request(0, 0.0, 512), request(1, 0.7, 64)])
    r1 = sim.outcomes()[1]
    assert r1.ready_s == r1.decode_start_s == pytest.approx(0.827 + 0.05 + op, rel=EXACT)


def test_replayed_ops_take_their_measured_seconds_and_book_no_lane() -> None:
    # r0 (1024 tokens) computes two slices ending at 0.512 and 1.024 s; its replayed ops take
    # 0.6 s (overlapping the next one: a measured span holds its wait for the link) and 0.1 s,
    # the second submitted 0.05 s after its step: they end at 1.112 and 1.174 s and land RTT
    # later. Its transfer time is their spans, 0.7 s; hidden: the first op until the
    # prefill's end, 1.024 - 0.512 s
    ops = Replayed(op_s=(0.6, 0.1), submit_s=(0.0, 0.05))
    result, sim = simulate(tiny_spec(), [dataclasses.replace(request(0, 0.0, 1024), replayed=ops)])
    (o,) = sim.outcomes()
    assert o.ready_s == pytest.approx(1.174 + RTT, rel=EXACT)
    f = sim.flights[0]
    assert (f.hidden_s, f.transfer_s) == pytest.approx((0.512, 0.7), rel=EXACT)
    assert result.overlap_ratio == pytest.approx(0.512 / 0.7, rel=EXACT)
    assert result.transport_utilisation == 0.0  # no lane booked


def test_replayed_ops_align_to_the_last_ones() -> None:
    # r1 loads its 512-token prefix from r0's device tier and computes 512 more tokens: two
    # ops (the prefix, the slice), one measured (0.05 s): the slice's. The prefix op, which
    # the measured run did not make, takes 0 s, so the transfer time is 0.05 s, all exposed
    ids = (7, 8)
    spec = tiny_spec(tiers=(device_tier(4),))
    r1 = dataclasses.replace(request(1, 5.0, 1024, ids=ids), replayed=Replayed(op_s=(0.05,)))
    _, sim = simulate(spec, [request(0, 0.0, 1024, ids=ids), r1])
    f = sim.flights[1]
    assert f.hit_tokens == 512
    assert (f.hidden_s, f.transfer_s) == pytest.approx((0.0, 0.05), rel=EXACT)
    assert f.ready == pytest.approx(f.prefill_end + 0.05 + RTT, rel=EXACT)


def test_replayed_steps_and_the_workers_own_time_after_them() -> None:
    # interleaving; r0 (1536 tokens) replays steps of 0.2, 0.3 s (its third: the model's
    # 0.512 s) with 0.05 s of the worker's own time after its first; r1 (512 tokens, at
    # 0.1 s) the model's 0.512 s. Rotation: r0 step 0 (0-0.2), the worker's 0.05 s, r0 step 1
    # (0.25-0.55: r1 joined behind r0 while step 0 ran), r1 (0.55-1.062), r0's last
    # (1.062-1.574); r0's slices go at each step's end, not after the worker's own time
    turns = PrefillSpec(token_s=1e-3, slice_tokens=512, interleave=True)
    steps = Replayed(step_s=(0.2, 0.3), after_s=(0.05,))
    r0 = dataclasses.replace(request(0, 0.0, 1536), replayed=steps)
    _, sim = simulate(tiny_spec(prefill=turns), [r0, request(1, 0.1, 512)])
    assert [o.prefill_end_s for o in sim.outcomes()] == pytest.approx([1.574, 1.062])
    assert sim.prefill[0].busy_s == pytest.approx(0.2 + 0.05 + 0.3 + 0.512 + 0.512, rel=EXACT)


def test_replayed_steps_need_an_interleaving_worker() -> None:
    r0 = dataclasses.replace(request(0, 0.0, 512), replayed=Replayed(step_s=(0.2,)))
    with pytest.raises(ConfigError, match="need an interleaving prefill worker"):
        simulate(tiny_spec(), [r0])
