"""Worker edge cases: a session id binds one request (either role); attaching stays legitimate."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pd_testlib import MLA, check_balanced, cluster, start_slow, wait_for

from kvplane.runtime.messages import Ack, DecodeOrder, ErrorReply, PrefillOrder, RequestResult


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
