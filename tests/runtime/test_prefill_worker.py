"""Prefill worker edge cases: a session id binds one request; attaching stays legitimate."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from pd_testlib import MLA, check_balanced, cluster, prompt, wait_for

from kvplane.runtime.messages import Ack, DecodeOrder, ErrorReply, PrefillOrder, RequestResult


def test_a_reused_session_id_is_refused_and_the_original_completes() -> None:
    with cluster(replace(MLA, compute_s_per_step=0.05)) as c:
        rng = np.random.default_rng(0)
        fut = c.router.submit("orig", prompt(rng, 200), step_size=32)
        wait_for(lambda: bool(c.prefill._by_session), what="the prefill order")
        sid = next(iter(c.prefill._by_session))
        intruder = PrefillOrder(
            request_id="intruder", session_id=sid, decode_peer="decode", token_ids=(1, 2, 3)
        )
        got = c.router.prefill[0].client.call(intruder, timeout_s=5)
        assert got == ErrorReply(reason=f"session {sid!r} is already bound to request 'orig'")
        assert "intruder" not in c.prefill._requests
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
