"""How the engine's workers take orders (exact figures on the tiny cluster): a serial decode
worker's one loop serving orders and landed KVs in arrival order, each order holding it for
its accept, KVs in landing order, with their measured lag; a prefill worker taking an arrived
order before it steps again, its setup after, and its own time after a step spent once
those orders are taken."""

from __future__ import annotations

import dataclasses

import pytest
from simulate_testlib import OVERHEAD, RTT, SLICE_BW, request, tiny_spec

from kvplane.simulate.spec import DecodeSpec, PrefillSpec
from kvplane.simulate.summary import simulate
from kvplane.simulate.workload import Replayed, Request

EXACT = 1e-12
SERIAL = DecodeSpec(token_s=0.02, serial=True)
OP_64 = OVERHEAD + 64 * 512 / SLICE_BW  # a 64-token op's hold on the link: 0.0175 s
TURNS = PrefillSpec(token_s=1e-3, slice_tokens=512, interleave=True)


def _replayed(*pairs: tuple[Request, Replayed]) -> list[Request]:
    """Each request with its replayed costs."""
    return [dataclasses.replace(r, replayed=costs) for r, costs in pairs]


def test_a_measured_accept_holds_the_loop_and_orders_wait_in_turn() -> None:
    # r0 lands at 0.627 s and decodes till 0.827 s. r1 (64 tokens, at 0.7 s) waits for that
    # end; its accept holds the loop 0.03 s, then its op goes (0.857-0.8745 s) and lands
    # RTT later. r2 (at 0.75 s) sends its decode order 0.1 s late: it reaches the loop at
    # 0.85 s, during r1's accept, and is taken when that ends (no hold of its own: the
    # cluster's accept_s is 0); its op queues behind r1's on the link, and its decode
    # behind r1's
    r1 = dataclasses.replace(request(1, 0.7, 64), replayed=Replayed(accept_s=0.03))
    r2 = dataclasses.replace(request(2, 0.75, 64), replayed=Replayed(order_s=0.1))
    _, sim = simulate(tiny_spec(decode=SERIAL), [request(0, 0.0, 512), r1, r2])
    o0, o1, o2 = sim.outcomes()
    assert o0.done_s == pytest.approx(0.827, rel=EXACT)
    assert o1.ready_s == o1.decode_start_s == pytest.approx(0.857 + OP_64 + RTT, rel=EXACT)
    assert sim.flights[2].ordered == pytest.approx(0.85, rel=EXACT)
    assert o2.ready_s == pytest.approx(0.857 + 2 * OP_64 + RTT, rel=EXACT)
    assert o2.decode_start_s == pytest.approx(o1.decode_start_s + 0.2, rel=EXACT)


def test_a_kv_landing_during_an_accept_waits_for_it() -> None:
    # r1's order comes at 0.6 s to an idle loop, which takes it for 0.1 s; r0's KV lands at
    # 0.627 s, during it, so r0 decodes from 0.7 s; r1's op goes at 0.7 s (its step ended
    # at 0.664 s) and its decode waits for r0's
    r1 = dataclasses.replace(request(1, 0.6, 64), replayed=Replayed(accept_s=0.1))
    _, sim = simulate(tiny_spec(decode=SERIAL), [request(0, 0.0, 512), r1])
    o0, o1 = sim.outcomes()
    assert (o0.ready_s, o0.decode_start_s) == pytest.approx((0.627, 0.7), rel=EXACT)
    assert o1.ready_s == pytest.approx(0.7 + OP_64 + RTT, rel=EXACT)
    assert o1.decode_start_s == pytest.approx(0.9, rel=EXACT)


def test_a_prefill_worker_takes_an_arrived_order_before_stepping_again() -> None:
    # interleaving. r0 (1024 tokens, taken at once, no setup) steps 0-0.2 s, then owes 0.05 s
    # of its own time. r1 arrived at 0.1 s but is taken at 0.25 s (its order's measured
    # delay): the worker steps nothing meanwhile, sets r1 up (0.02 s), then spends what it
    # owed (0.27-0.32 s); r0's second step (0.32-0.52 s), r1's one (the model's 0.512 s)
    turns = dataclasses.replace(TURNS, setup_s=0.5)  # not used: each has its own
    r0 = Replayed(step_s=(0.2, 0.2), after_s=(0.05,), prefill_s=0.0, setup_s=0.0)
    r1 = Replayed(prefill_s=0.15, setup_s=0.02)
    reqs = _replayed((request(0, 0.0, 1024), r0), (request(1, 0.1, 512), r1))
    _, sim = simulate(tiny_spec(prefill=turns), reqs)
    o0, o1 = sim.outcomes()
    assert (o1.prefill_start_s, o1.compute_start_s) == pytest.approx((0.25, 0.27), rel=EXACT)
    assert (o0.prefill_end_s, o1.prefill_end_s) == pytest.approx((0.52, 1.032), rel=EXACT)
    busy = 0.2 + 0.02 + 0.05 + 0.2 + 0.512
    assert sim.prefill[0].busy_s == pytest.approx(busy, rel=EXACT)


def test_a_measured_lag_replaces_the_links_latency() -> None:
    ops = Replayed(op_s=(0.1,), lag_s=0.003)
    _, sim = simulate(tiny_spec(), [dataclasses.replace(request(0, 0.0, 512), replayed=ops)])
    (o,) = sim.outcomes()
    assert o.ready_s == pytest.approx(0.512 + 0.1 + 0.003, rel=EXACT)


def test_an_order_reaching_the_inbox_later_lets_the_worker_step_meanwhile() -> None:
    # as above, but r1's order reaches the worker's inbox only at 0.26 s (its measured take
    # at 0.3 s): after its own time (0.2-0.25 s) the worker steps r0 again (0.25-0.45 s),
    # then takes r1 (between steps), sets it up (0.45-0.47 s) and steps it (0.512 s)
    r0 = Replayed(step_s=(0.2, 0.2), after_s=(0.05,))
    r1 = Replayed(prefill_s=0.2, inbox_s=0.16, setup_s=0.02)
    reqs = _replayed((request(0, 0.0, 1024), r0), (request(1, 0.1, 512), r1))
    _, sim = simulate(tiny_spec(prefill=TURNS), reqs)
    o0, o1 = sim.outcomes()
    assert (o1.prefill_start_s, o1.compute_start_s) == pytest.approx((0.45, 0.47), rel=EXACT)
    assert (o0.prefill_end_s, o1.prefill_end_s) == pytest.approx((0.45, 0.982), rel=EXACT)


def test_a_serial_worker_decodes_landed_kvs_in_landing_order() -> None:
    # r0's op ends at 0.612 s but its KV reaches the loop 0.05 s later (its measured lag);
    # r1's lands at 0.615 s, ready at once, behind r0 in the loop's inbox: r0 decodes from
    # 0.662 s (10 tokens, 0.2 s), then r1
    r0 = Replayed(op_s=(0.1,), lag_s=0.05)
    r1 = Replayed(op_s=(0.001,), lag_s=0.0)
    reqs = _replayed((request(0, 0.0, 512), r0), (request(1, 0.55, 64), r1))
    _, sim = simulate(tiny_spec(decode=SERIAL), reqs)
    o0, o1 = sim.outcomes()
    assert (o0.ready_s, o1.ready_s) == pytest.approx((0.662, 0.615), rel=EXACT)
    assert (o0.decode_start_s, o1.decode_start_s) == pytest.approx((0.662, 0.862), rel=EXACT)
