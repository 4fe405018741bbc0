"""``kvplane serve``'s own policies in the engine: interleaved prefill steps, a serial decode
worker that takes no order while it decodes or behind a landed KV, replayed decode times
(exact figures on the tiny cluster)."""

from __future__ import annotations

import dataclasses

import pytest
from simulate_testlib import BYTES_PER_TOKEN, OVERHEAD, RTT, SLICE_BW, request, tiny_spec

from kvplane.simulate.spec import DecodeSpec, PrefillSpec
from kvplane.simulate.summary import simulate

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
    r0 = sim.flights[0]  # its first two slices were sent while steps still ran: hidden
    assert (r0.hidden_s, r0.transfer_s) == pytest.approx((0.23, 0.345), rel=EXACT)


def test_interleaved_contention_and_setup() -> None:
    spec = PrefillSpec(token_s=1e-3, slice_tokens=512, interleave=True, contention=0.5, setup_s=0.1)
    _, sim = simulate(tiny_spec(prefill=spec), [request(0, 0.0, 1024)])
    (o,) = sim.outcomes()
    assert o.compute_start_s == pytest.approx(0.1, rel=EXACT)
    assert o.prefill_end_s == pytest.approx(0.1 + 0.512 + 0.768, rel=EXACT)  # 2nd step x 1.5


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
