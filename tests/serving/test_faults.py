"""Cancel from either side at any moment, slice timeouts, transport failures and peer loss:
every request ends in exactly one terminal state and every block comes back."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import StatsQuery, WorkerStats
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer, SyntheticSpec
from kvplane.serving.router.router import Router
from kvplane.testing.chaos import worker_hooks
from kvplane.testing.cluster import (
    FAST,
    TEST_SECRET,
    Cluster,
    base_config,
    check_balanced,
    cluster,
    idle,
    prompt,
    wait_for,
)
from kvplane.testing.faults import FaultPlan, TransferFaults

SLOW = SyntheticSpec(kind="mla", num_layers=2, latent_dim=32, rope_dim=16, compute_s_per_step=0.01)
TERMINAL = {"success", "aborted", "failed"}


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_cancel_mid_transfer_from_either_side(side: str) -> None:
    with cluster(SLOW) as c:
        fut = c.router.submit("x", list(range(300)), step_size=16)
        wait_for(
            lambda: c.prefill.metrics.value("pd_slices", {"result": "done"}, "_total") >= 2,
            what="two slices moved",
        )
        assert c.router.cancel("x", side=side, reason="user gave up")
        res = fut.result(timeout=10)
        assert res.state == "aborted"
        assert "user gave up" in res.reason or res.reason
        check_balanced(c.router)
        assert c.prefill.metrics.value("pd_release_latency_seconds_count") == 1


def test_a_decode_cancel_before_its_memory_frees_the_prefill_side_at_once() -> None:
    """b waits for decode memory behind a; cancelled there, it never opens its receiver, and
    the prefill session its order opened ends at once (it held b's prefill blocks until the
    8 s deadline before, and requests queued behind it waited as long)."""
    with cluster(SLOW, decode={"num_blocks": 6}) as c:
        a = c.router.submit("a", list(range(90)), step_size=8)  # all 6 decode blocks, 120 ms
        time.sleep(0.02)
        b = c.router.submit("b", list(range(1000, 1040)), step_size=16)
        wait_for(lambda: "b" in c.prefill._requests, what="b's prefill order")
        begun = time.monotonic()
        assert c.router.cancel("b", side="decode", reason="client gone")
        assert b.result(timeout=10).state == "aborted"
        wait_for(lambda: "b" not in c.prefill._requests, timeout_s=3.0, what="b freed")
        assert time.monotonic() - begun < FAST.deadline_s / 2
        assert a.result(timeout=20).state == "success"
        check_balanced(c.router)
        assert c.decode.endpoint.participant.counters["abandoned_receivers"] == 1


def test_random_cancels_on_both_sides_leave_every_request_terminal() -> None:
    rng = np.random.default_rng(7)
    with cluster(SLOW) as c:
        futs = {}
        for i in range(16):
            rid = f"k{i}"
            futs[rid] = c.router.submit(
                rid, prompt(rng, int(rng.integers(1, 120))), step_size=int(rng.integers(4, 40))
            )
            if rng.random() < 0.6:
                time.sleep(float(rng.random()) * 0.03)
                c.router.cancel(rid, side=str(rng.choice(["decode", "prefill"])))
        results = {rid: f.result(timeout=20) for rid, f in futs.items()}
        assert {r.state for r in results.values()} <= TERMINAL
        assert all(r.mismatches == 0 for r in results.values() if r.state == "success")
        check_balanced(c.router)


def test_cancel_of_an_unknown_request_changes_nothing() -> None:
    with cluster() as c:
        assert not c.router.cancel("nope")
        assert c.router.generate("ok", list(range(20))).state == "success"
        check_balanced(c.router)


def _faulty_cluster(plan: FaultPlan, **prefill: object) -> Cluster:
    base = base_config(num_slots=8)
    spec = SyntheticSpec(kind="mla", num_layers=2, latent_dim=32, rope_dim=16)
    p = PrefillWorker(replace(base, **prefill), SyntheticProducer(spec), hooks=worker_hooks(plan))  # type: ignore[arg-type]
    d = DecodeWorker(replace(base, name="decode"), SyntheticDecoder(spec))
    p.start()
    d.start()
    r = Router([p.address], [d.address], timeout_s=20.0, secret=TEST_SECRET)
    r.connect()
    return Cluster(p, d, r)


def test_a_failed_slice_fails_the_request_and_releases_everything() -> None:
    c = _faulty_cluster(FaultPlan(seed=1, transfers=TransferFaults(fail=1.0)))
    try:
        res = c.router.generate("f", list(range(100)))
        assert res.state == "failed"
        assert c.prefill.metrics.value("pd_slices", {"result": "failed"}, "_total") >= 1
        check_balanced(c.router)
    finally:
        c.close()


def test_a_slice_past_its_timeout_ends_in_doubt_and_is_released_at_the_deadline() -> None:
    c = _faulty_cluster(
        FaultPlan(seed=2, transfers=TransferFaults(late=1.0, late_s=3.0)), slice_timeout_s=0.1
    )
    try:
        t0 = time.monotonic()
        res = c.router.generate("t", list(range(40)))
        assert res.state == "failed"
        stats = check_balanced(c.router)
        # the run waits CANCEL_GRACE_S after its deadline, then the unit is IN_DOUBT until
        # its fail-closed release deadline: released through EXPIRED, never earlier
        assert time.monotonic() - t0 >= 1.0
        assert stats["prefill"].counters["session_finished_sender_failed"] == 1
        # both slices ([0, 32) and the final [32, 40)) were in flight on the link, queued in
        # order, when the first one's deadline passed: both end in doubt
        assert c.prefill.metrics.value("pd_slices", {"result": "in_doubt"}, "_total") == 2
    finally:
        c.close()


def test_peer_loss_releases_the_survivors_memory_within_lease_plus_heartbeat() -> None:
    c = cluster(SLOW)
    try:
        fut = c.router.submit("d", list(range(400)), step_size=16)
        wait_for(
            lambda: c.prefill.metrics.value("pd_slices", {"result": "done"}, "_total") >= 2,
            what="two slices moved",
        )
        killed = time.monotonic()
        c.decode.close()  # the decode worker disappears mid-transfer
        client = c.router.prefill[0].client

        def prefill_idle() -> bool:
            got = client.call(StatsQuery())
            return isinstance(got, WorkerStats) and idle(got)

        wait_for(prefill_idle, timeout_s=10.0, what="prefill memory released")
        latency = time.monotonic() - killed
        assert latency <= FAST.lease_s + FAST.heartbeat_s + 0.3  # + polling slack
        got = client.call(StatsQuery())
        assert isinstance(got, WorkerStats) and got.integrity == ""
        assert not fut.done() or fut.result().state != "success"
    finally:
        c.router.close()
        c.prefill.close()
