"""End to end in one process (real sockets, real transports, worker threads): byte-exact KV.

Every request's decode-side KV is checked element by element against the synthetic producer
(the decoder returns the number of differing elements, state bytes and token values), and every
test ends with both workers' pools empty and every pool and ledger consistent.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import msgspec
import numpy as np
import pytest

from kvplane.errors import ProtocolError
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.pools import TAIL_BYTES
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer, SyntheticSpec
from kvplane.serving.router.router import Router
from kvplane.testing.cluster import (
    GQA,
    MLA,
    TEST_SECRET,
    Cluster,
    base_config,
    check_balanced,
    cluster,
    prompt,
    wait_for,
)
from kvplane.transfer import OpGrouping


@pytest.fixture
def mla() -> Iterator[Cluster]:
    c = cluster(MLA, decode={"block_size": 8})
    yield c
    c.close()


def test_mla_byte_exact_with_different_block_sizes_and_unaligned_ends(mla: Cluster) -> None:
    rng = np.random.default_rng(1)
    for i, n in enumerate([1, 7, 16, 31, 32, 33, 95, 200]):
        res = mla.router.generate(f"r{i}", prompt(rng, n))
        assert (res.state, res.mismatches, res.num_tokens, res.prefix_tokens) == (
            "success",
            0,
            n,
            0,
        )
        assert len(res.tokens) == 1
    stats = check_balanced(mla.router)
    assert stats["prefill"].counters["session_finished_sender_success"] == 8
    assert stats["decode"].counters["session_finished_receiver_success"] == 8


def test_slices_planned_ahead_begin_in_the_call_that_sends_them() -> None:
    """A pipelined request's slices are planned while it computes (50 ms a step, far longer
    than a plan), the first as soon as the receiver's request names the destination; each then
    begins in the same PD-loop call that sends its SubmitSlice (one thread hop, not two)."""
    with cluster(replace(MLA, compute_s_per_step=0.05)) as c:
        res = c.router.generate("ahead", prompt(np.random.default_rng(3), 200), step_size=32)
        assert (res.state, res.mismatches) == ("success", 0)
        counters = check_balanced(c.router)["prefill"].counters
    # 7 slices, all planned ahead: the first once DestinationKnown names the destination
    # (during its 50 ms step), the other 6 while the steps before them compute
    assert counters["driver_sessions_expected"] == 1
    assert counters["driver_plans_ready"] == 7
    assert counters["driver_begun_in_call"] == 7


def test_the_only_slice_of_a_short_prompt_is_planned_before_its_step_ends() -> None:
    """A one-step request has no earlier step to plan its slice in: the session's
    DestinationKnown hint lets the driver plan it while the step computes, so the slice begins
    in the call that sends its SubmitSlice instead of being planned after the step."""
    with cluster(replace(MLA, compute_s_per_step=0.05)) as c:
        res = c.router.generate("short", prompt(np.random.default_rng(4), 20), step_size=32)
        assert (res.state, res.mismatches, res.num_tokens) == ("success", 0, 20)
        counters = check_balanced(c.router)["prefill"].counters
    assert counters["driver_sessions_expected"] == 1
    assert counters["driver_plans_ready"] == 1 and counters["driver_begun_in_call"] == 1


def test_a_destination_known_before_the_requests_memory_waits_for_it() -> None:
    """Request b waits for prefill memory (a 5-block pool; a holds 4 blocks until its KV has
    moved), so its DestinationKnown comes long before its blocks: the hint waits, and when b is
    admitted its only slice is still planned during its 50 ms step."""
    with cluster(replace(MLA, compute_s_per_step=0.05), prefill={"num_blocks": 5}) as c:
        rng = np.random.default_rng(5)
        a = c.router.submit("a", prompt(rng, 50), step_size=32)
        time.sleep(0.01)
        b = c.router.submit("b", prompt(rng, 20), step_size=32)
        for res in (a.result(timeout=30), b.result(timeout=30)):
            assert (res.state, res.mismatches) == ("success", 0)
        counters = check_balanced(c.router)["prefill"].counters
    assert counters["driver_sessions_expected"] == 2
    assert counters["driver_plans_ready"] == 3 and counters["driver_begun_in_call"] == 3


def test_a_waiting_hint_goes_with_its_session_when_it_ends_without_memory() -> None:
    """A hint waiting for memory the request never gets (cancelled while queued; an order
    the prefill refuses) is dropped when its session ends, not kept for the worker's life."""
    with cluster(replace(MLA, compute_s_per_step=0.05), prefill={"num_blocks": 5}) as c:
        rng = np.random.default_rng(5)
        driver = c.prefill.driver
        a = c.router.submit("a", prompt(rng, 50), step_size=32)
        time.sleep(0.01)
        b = c.router.submit("b", prompt(rng, 20), step_size=32)
        wait_for(lambda: len(driver._waiting) == 1, 10, "b's hint waiting for memory")
        c.router.cancel("b", side="decode", reason="client gone")
        assert (a.result(timeout=30).state, b.result(timeout=30).state) == ("success", "aborted")
        big = c.router.submit("big", prompt(rng, 100), step_size=32)  # 7 blocks: refused
        got = big.result(timeout=30)  # at once: the router's cancel follows the decode order
        assert got.state == "aborted" and got.reason.startswith("prefill refused: "), got
        check_balanced(c.router)
        wait_for(lambda: not driver._waiting and not driver._sessions, 10, "hints dropped")


def test_first_token_arrives_with_the_final_slice(mla: Cluster) -> None:
    tokens = list(range(40))
    res = mla.router.generate("t", tokens)
    expected = mla.prefill.producer.kv.first_token(np.array(tokens), MLA.vocab_size)
    assert res.tokens == (expected,)
    check_balanced(mla.router)


def test_prefix_reuse_moves_only_the_rest(mla: Cluster) -> None:
    base = list(range(1000, 1100))
    first = mla.router.generate("a", base)
    assert (first.state, first.prefix_tokens, first.mismatches) == ("success", 0, 0)
    moved_before = mla.prefill.metrics.value("pd_bytes_moved", suffix="_total")
    second = mla.router.generate("b", [*base, 7, 8, 9])
    # decode blocks of 8: 96 tokens cached (the capped admission keeps the last token out)
    assert (second.state, second.prefix_tokens, second.mismatches) == ("success", 96, 0)
    moved = mla.prefill.metrics.value("pd_bytes_moved", suffix="_total") - moved_before
    layout = mla.decode.pools.kv.layout
    per_token = layout.num_layers * layout.bytes_per_token_per_layer
    assert moved == (103 - 96) * per_token + TAIL_BYTES  # the rest of the KV + the tail
    check_balanced(mla.router)


def test_slices_inside_the_receivers_prefix_are_skipped_not_sent() -> None:
    with cluster(MLA, prefill={"step_size": 16}) as c:
        res = c.router.generate("e", list(range(64)), step_size=16)
        assert (res.state, res.mismatches) == ("success", 0)
        assert c.prefill.metrics.value("pd_slices", {"result": "done"}, "_total") == 4
        again = c.router.generate("f", list(range(64)), step_size=16)
        assert (again.state, again.prefix_tokens, again.mismatches) == ("success", 48, 0)
        assert c.prefill.metrics.value("pd_slices", {"result": "skipped"}, "_total") == 3
        assert c.prefill.metrics.value("pd_slices", {"result": "done"}, "_total") == 5
        check_balanced(c.router)


def test_gqa_with_tp_head_ranges_and_layer_ops() -> None:
    with cluster(
        GQA,
        prefill={"grouping": OpGrouping.LAYER, "block_size": 4},
        decode={"head_range": (1, 3), "block_size": 16},
    ) as c:
        rng = np.random.default_rng(2)
        for i, n in enumerate([5, 64, 77]):
            res = c.router.generate(f"g{i}", prompt(rng, n))
            assert (res.state, res.mismatches) == ("success", 0)
        check_balanced(c.router)


@pytest.mark.parametrize("says_heads", [True, False])
@pytest.mark.parametrize(("ours", "theirs"), [((1, 3), (0, 4)), ((0, 2), (1, 3))])
def test_a_destination_with_heads_we_lack_is_refused_at_pairing(
    ours: tuple[int, int], theirs: tuple[int, int], says_heads: bool
) -> None:
    """One sender per session: heads of the decode rank that this prefill rank does not hold
    would never arrive (the request used to end "success" with those heads unwritten, then to
    fail at its first slice). The pairing is refused, naming both ranges; nothing is held. With
    workers that say their heads the router refuses it itself and never asks; with a decode
    worker that does not (an older one), the decode worker's handshake refuses it."""
    p = PrefillWorker(base_config(head_range=ours), SyntheticProducer(GQA))
    d = DecodeWorker(base_config(name="decode", head_range=theirs), SyntheticDecoder(GQA))
    if not says_heads:
        info = d.info
        d.info = lambda: msgspec.structs.replace(info(), head_ranges=(), paged_pools=0)  # type: ignore[method-assign]
    p.start()
    d.start()
    r = Router([p.address], [d.address], timeout_s=20.0, secret=TEST_SECRET)
    with Cluster(p, d, r):
        if says_heads:
            why = (
                f"decode worker at {d.address} (KV heads per pool ({theirs}, (0, 1))) cannot "
                "pair: no prefill worker up holds all its KV heads (one sender per session); "
                f"prefill workers up: {p.address} (KV heads per pool ({ours}, (0, 1)))"
            )
        else:
            why = f"the receiver's {theirs} are not all in the sender's {ours}"
        with pytest.raises(ProtocolError, match=re.escape(why)) as err:
            r.connect()
        assert "cannot pair: " in str(err.value)
        refused = "peer prefill is incompatible" in str(err.value)
        assert refused is not says_heads
        assert p.endpoint.snapshot().get("handshakes_refused", 0) == (0 if says_heads else 1)
        assert r.decode[0].repair is not says_heads  # a refused pairing is tried again
        if says_heads:  # nothing can serve: refused before any order is sent
            assert not r.ready()
            with pytest.raises(ProtocolError, match="no prefill worker up holds all the KV"):
                r.submit("x", [1, 2, 3])
            assert r.refresh() == []  # reported once, at connect; nothing to re-pair
        for w in (p, d):
            assert _peers_and_sessions(w) == ([], 0)
            assert w.pools.blocks.num_used_blocks == w.pools.slots.num_used_blocks == 0


def _peers_and_sessions(w: PrefillWorker | DecodeWorker) -> tuple[list[str], int]:
    """A worker's live PD peers and its number of sessions (read on its PD loop)."""
    part = w.participant
    return w.endpoint.call(lambda: ([str(x) for x in part.peers.live_peers()], len(part.sessions)))


def test_sliding_window_moves_only_the_final_window() -> None:
    spec = SyntheticSpec(kind="gqa", num_layers=2, kv_heads=2, head_dim=8, sliding_window=20)
    with cluster(spec) as c:
        res = c.router.generate("w", list(range(100)))
        assert (res.state, res.mismatches) == ("success", 0)
        layout = c.decode.pools.kv.layout
        per_token = layout.num_layers * layout.bytes_per_token_per_layer
        assert (
            c.prefill.metrics.value("pd_bytes_moved", suffix="_total")
            == 19 * per_token + TAIL_BYTES  # the step at 100 reads (80, 100]
        )
        check_balanced(c.router)


def test_whole_only_state_travels_in_the_final_slice() -> None:
    spec = SyntheticSpec(kind="mla", num_layers=2, latent_dim=16, rope_dim=8, state_dim=24)
    with cluster(spec) as c:
        res = c.router.generate("s", list(range(50)))
        assert (res.state, res.mismatches) == ("success", 0)
        assert c.prefill.metrics.value("pd_bytes_moved", suffix="_total") == (
            50 * 2 * 24 * 2 + 2 * 24 + TAIL_BYTES
        )
        # two slices, two batches: the final one carries its KV, the state and the tail record
        done = {"transport": "tcp", "state": "done"}
        assert c.prefill.metrics.value("transport_batches", done, "_total") == 2
        check_balanced(c.router)


def test_many_concurrent_requests_and_metrics(mla: Cluster) -> None:
    rng = np.random.default_rng(3)
    futs = [
        mla.router.submit(
            f"c{i}", prompt(rng, int(rng.integers(1, 150))), step_size=int(rng.integers(1, 64))
        )
        for i in range(24)
    ]
    results = [f.result(timeout=30) for f in futs]
    assert all((r.state, r.mismatches) == ("success", 0) for r in results)
    check_balanced(mla.router)
    text = mla.prefill.metrics.render().decode()
    for name in (
        "kvplane_pd_overlap_ratio",
        "kvplane_pd_slice_transfer_seconds",
        "kvplane_pd_blocks_per_op",
        "kvplane_pd_transfer_amplification",
        "kvplane_block_pool_usage",
        "kvplane_pd_requests_total",
        "kvplane_transport_batches_total",  # the transport's own metrics, in the worker's
    ):
        assert name in text
    assert (
        mla.prefill.metrics.value("pd_requests", {"role": "prefill", "state": "success"}, "_total")
        == 24
    )


@pytest.mark.parametrize("transport", ["shm", "nixl", "mooncake"])
def test_other_transports_when_available(transport: str) -> None:
    """The same byte-exact pipeline over shm and the NIXL and Mooncake adapters, including a
    one-token request and unaligned ends (each final slice one batch across two regions)."""
    from kvplane.transports.registry import available

    reason = available().get(transport)
    if reason is not None:
        pytest.skip(reason)
    # nixl and mooncake cannot authenticate their data plane: insecure, explicitly
    with cluster(MLA, transport=transport, insecure=transport != "shm") as c:
        rng = np.random.default_rng(7)
        for i, n in enumerate([1, 33, 70]):
            res = c.router.generate(f"m{i}", prompt(rng, n))
            assert (res.state, res.mismatches, res.num_tokens) == ("success", 0, n)
        check_balanced(c.router)


def test_slice_done_is_when_the_transport_ended_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver that gets to a finished slice late still records when its bytes landed."""
    from kvplane.pipeline.driver import SliceDriver
    from kvplane.pipeline.timeline import Mark

    reached: dict[int, float] = {}
    finish = SliceDriver._finish

    def late_finish(self: SliceDriver, job: Any) -> Any:
        reached[int(job.act.slice_id)] = time.monotonic()
        time.sleep(0.05)  # a driver thread busy elsewhere
        return finish(self, job)

    monkeypatch.setattr(SliceDriver, "_finish", late_finish)
    with cluster(MLA) as c:
        res = c.router.generate("late", prompt(np.random.default_rng(5), 100), step_size=32)
        assert (res.state, res.mismatches) == ("success", 0), res.reason
        done = {
            e.slice_id: e.t
            for e in c.prefill.timeline.events("late")
            if e.mark == Mark.SLICE_DONE.value
        }
        assert sorted(done) == sorted(reached) == [0, 1, 2, 3]
        for slice_id, t in done.items():
            assert t <= reached[slice_id]  # stamped before the driver reached it, not after
        check_balanced(c.router)
