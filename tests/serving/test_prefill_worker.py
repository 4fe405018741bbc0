"""Worker edge cases: a session id binds one request (either role); attaching stays legitimate;
a failed prefill step sends nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import (
    Ack,
    DecodeOrder,
    ErrorReply,
    PrefillOrder,
    RequestResult,
    SenderPiece,
)
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.base import PoolTensor, ProduceStep, StepOutput
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer
from kvplane.serving.router.router import Router
from kvplane.testing.cluster import (
    MLA,
    TEST_SECRET,
    Cluster,
    base_config,
    check_balanced,
    cluster,
    start_slow,
    wait_for,
)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_reused_session_id_is_refused_and_the_original_completes(role: str) -> None:
    with cluster(replace(MLA, compute_s_per_step=0.05)) as c:
        fut = start_slow(c, "orig", on=(role,))
        worker = c.prefill if role == "prefill" else c.decode
        sid = worker._requests["orig"].sid  # type: ignore[attr-defined]
        intruder: PrefillOrder | DecodeOrder = (
            PrefillOrder(
                request_id="intruder", session_id=sid, decode_peer="decode", token_ids=(1, 2, 3)
            )
            if role == "prefill"
            else DecodeOrder(
                request_id="intruder", session_id=sid, prefill_peer="prefill", token_ids=(1, 2, 3)
            )
        )
        handle = c.router.prefill[0] if role == "prefill" else c.router.decode[0]
        got = handle.client.call(intruder, timeout_s=5)
        assert got == ErrorReply(reason=f"session {sid!r} is already bound to request 'orig'")
        assert "intruder" not in worker._requests  # type: ignore[attr-defined]
        res = fut.result(timeout=15)
        assert (res.state, res.mismatches) == ("success", 0)
        check_balanced(c.router)


def test_an_order_attaches_to_a_session_the_decode_side_opened_first() -> None:
    with cluster() as c:
        tokens = tuple(range(50))
        fut = c.router.decode[0].client.call_async(
            DecodeOrder(request_id="x", session_id="sx", prefill_peer="prefill", token_ids=tokens)
        )
        wait_for(lambda: "sx" in c.prefill.participant.sessions, what="the receiver's request")
        order = PrefillOrder(
            request_id="x", session_id="sx", decode_peer="decode", token_ids=tokens
        )
        assert c.router.prefill[0].client.call(order) == Ack(detail="accepted")
        res = fut.result(timeout=20)
        assert isinstance(res, RequestResult) and (res.state, res.mismatches) == ("success", 0)
        check_balanced(c.router)


class _FirstStepFails(SyntheticProducer):
    def produce(self, step: ProduceStep, kv: PoolTensor, state: PoolTensor | None) -> StepOutput:
        if step.tokens.start == 0:
            raise InvalidArgumentError("the step cannot run")
        return super().produce(step, kv, state)


def test_a_failed_step_is_never_cut_into_a_slice() -> None:
    """A step whose compute failed cancels its request; the KV it never wrote must not be
    submitted as a slice (it was, and only the cancel that overtook it kept it off the wire)."""
    p = PrefillWorker(base_config(), _FirstStepFails(MLA))
    d = DecodeWorker(replace(base_config(), name="decode"), SyntheticDecoder(MLA))
    p.start()
    d.start()
    r = Router([p.address], [d.address], timeout_s=20.0, secret=TEST_SECRET)
    r.connect()
    with Cluster(p, d, r):
        res = r.generate("x", list(range(80)), step_size=32)
        assert res.state == "aborted" and "prefill step failed" in res.reason
        counters = check_balanced(r)["prefill"].counters
    assert counters["worker_step_errors"] == 1
    assert counters.get("worker_slices_after_session_end", 0) == 0


def _share(c: Cluster, tp_rank: int = 0) -> SenderPiece:
    kv = c.prefill.pools.kv.layout
    return SenderPiece(
        peer="prefill", stage=0, tp_rank=tp_rank, heads=kv.head_range, layers=kv.layer_ids,
        lead=True,
    )  # fmt: skip


def test_a_share_covering_every_cell_moves_the_whole_kv_as_the_member() -> None:
    with cluster() as c:
        tokens = tuple(range(50))
        fut = c.router.decode[0].client.call_async(
            DecodeOrder(request_id="x", session_id="sx/0.0", prefill_peer="prefill",
                        token_ids=tokens)
        )  # fmt: skip
        order = PrefillOrder(
            request_id="x", session_id="sx/0.0", decode_peer="decode", token_ids=tokens,
            share=_share(c),
        )  # fmt: skip
        assert c.router.prefill[0].client.call(order) == Ack(detail="accepted")
        res = fut.result(timeout=20)
        assert isinstance(res, RequestResult) and (res.state, res.mismatches) == ("success", 0)
        check_balanced(c.router)


def test_a_share_of_another_rank_is_refused_before_anything_opens() -> None:
    with cluster() as c:
        order = PrefillOrder(
            request_id="x", session_id="sx/0.1", decode_peer="decode", token_ids=(1, 2, 3),
            share=_share(c, tp_rank=1),
        )  # fmt: skip
        got = c.router.prefill[0].client.call(order)
        assert got == ErrorReply(
            reason="share of prefill (stage, TP rank) (0, 1) sent to prefill at (0, 0)"
        )
        assert "x" not in c.prefill._requests  # type: ignore[attr-defined]
        assert "sx/0.1" not in c.prefill.participant.sessions
        check_balanced(c.router)
