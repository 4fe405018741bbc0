"""Decode worker edge cases: bound session ids, pairing errors, what joins the prefix cache,
and the metrics of requests that end before their session opens."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from pd_testlib import MLA, check_balanced, cluster, prompt, wait_for

from kvplane.runtime.messages import (
    DecodeOrder,
    ErrorReply,
    PairWith,
    PrefillOrder,
    RequestResult,
)
from kvplane.runtime.producer import DecodeJob, DecodeOutput, KVDecoder, PoolTensor
from kvplane.runtime.timeline import Mark


def test_a_reused_session_id_is_refused_and_the_original_completes() -> None:
    with cluster(replace(MLA, compute_s_per_step=0.05)) as c:
        rng = np.random.default_rng(0)
        fut = c.router.submit("orig", prompt(rng, 200), step_size=32)
        wait_for(lambda: bool(c.decode._by_session), what="the decode order")
        sid = next(iter(c.decode._by_session))
        intruder = DecodeOrder(
            request_id="intruder", session_id=sid, prefill_peer="prefill", token_ids=(1, 2, 3)
        )
        got = c.router.decode[0].client.call(intruder, timeout_s=5)
        assert got == ErrorReply(reason=f"session {sid!r} is already bound to request 'orig'")
        res = fut.result(timeout=15)
        assert (res.state, res.mismatches) == ("success", 0)
        check_balanced(c.router)


def test_a_malformed_pair_address_is_answered() -> None:
    with cluster() as c:
        for addr in ("garbage", "tcp://127.0.0.1:notaport"):
            got = c.router.decode[0].client.call(PairWith(pd_address=addr), timeout_s=3)
            assert isinstance(got, ErrorReply)
            assert got.reason.startswith(f"pairing with {addr!r} failed: Invalid argument")
        assert c.router.generate("after", list(range(20))).state == "success"


def test_kv_of_another_prompt_fails_the_request_and_is_never_cached() -> None:
    with cluster() as c:
        rng = np.random.default_rng(0)
        a, b = tuple(prompt(rng, 48)), tuple(prompt(rng, 48))
        fut = c.router.decode[0].client.call_async(
            DecodeOrder(request_id="x", session_id="sx", prefill_peer="prefill", token_ids=b)
        )
        pre = PrefillOrder(request_id="x", session_id="sx", decode_peer="decode", token_ids=a)
        c.router.prefill[0].client.call(pre)
        res = fut.result(timeout=20)
        assert isinstance(res, RequestResult)
        assert (res.state, res.mismatches) == ("failed", None)
        assert res.reason == "the prefill computed another prompt (48 tokens, other digest)"
        assert c.decode.counters["prompt_mismatches"] == 1
        assert c.decode.pools.blocks.num_cached_blocks == 0
        legit = c.router.generate("legit", [*b, 7, 8, 9])
        assert (legit.state, legit.prefix_tokens, legit.mismatches) == ("success", 0, 0)
        check_balanced(c.router)


class _Corrupt:
    """A verifying decoder that always finds one mismatch (KV corrupted on the way)."""

    def __init__(self, inner: KVDecoder) -> None:
        self.inner = inner

    def decode(self, job: DecodeJob, kv: PoolTensor, state: PoolTensor | None) -> DecodeOutput:
        out = self.inner.decode(job, kv, state)
        return DecodeOutput(tokens=out.tokens, mismatches=(out.mismatches or 0) + 1)


def test_blocks_with_counted_mismatches_are_never_cached() -> None:
    with cluster() as c:
        base = list(range(1000, 1048))
        clean = c.decode.decoder
        c.decode.decoder = _Corrupt(clean)  # type: ignore[assignment]
        first = c.router.generate("bad", base)
        assert (first.state, first.mismatches) == ("success", 1)
        assert c.decode.pools.blocks.num_cached_blocks == 0
        c.decode.decoder = clean
        again = c.router.generate("good", [*base, 1, 2])
        assert (again.state, again.prefix_tokens, again.mismatches) == ("success", 0, 0)
        assert c.decode.pools.blocks.num_cached_blocks == 3  # now cached: 50 tokens, blocks of 16
        check_balanced(c.router)


def test_a_request_cancelled_while_waiting_for_memory_counts_as_finished() -> None:
    with cluster(replace(MLA, compute_s_per_step=0.1), decode={"num_blocks": 14}) as c:
        rng = np.random.default_rng(0)
        big = c.router.submit("big", prompt(rng, 200), step_size=16)  # 13 of 14 decode blocks
        wait_for(lambda: "big" in c.decode._requests and c.decode._requests["big"].opened)
        waits = c.router.submit("waits", prompt(rng, 40))  # needs 3 blocks: waits in FIFO
        wait_for(lambda: any(r.order.request_id == "waits" for r in c.decode._waiting))
        assert c.router.cancel("waits", side="decode", reason="client gave up")
        res = waits.result(timeout=10)
        assert (res.state, res.reason) == ("aborted", "client gave up")
        assert big.result(timeout=20).state == "success"
        check_balanced(c.router)
        m = c.decode.metrics
        assert m.value("pd_requests", {"role": "decode", "state": "aborted"}, suffix="_total") == 1
        assert m.value("pd_requests", {"role": "decode", "state": "success"}, suffix="_total") == 1
        assert m.value("pd_release_latency_seconds", suffix="_count") == 0  # it held nothing
        marks = [e.mark for e in c.decode.timeline.events("waits")]
        assert Mark.RELEASED.value not in marks and Mark.ORDER.value in marks
