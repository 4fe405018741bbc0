"""Decode worker edge cases: pairing errors (a one-process prefill lacking some of our TP heads
is refused at pairing), what joins the prefix cache, who marks the prompt computed, and the
metrics of requests that end before their session opens (bound session ids of either role:
``test_prefill_worker.py``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvplane.pipeline.timeline import Mark
from kvplane.serving.messages import (
    Ack,
    DecodeOrder,
    ErrorReply,
    PairWith,
    PrefillOrder,
    RequestResult,
)
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.base import DecodeJob, DecodeOutput, KVDecoder, PoolTensor
from kvplane.serving.producers.synthetic import SyntheticProducer
from kvplane.testing.cluster import GQA, MLA, base_config, check_balanced, cluster, prompt, wait_for


def test_a_malformed_pair_address_is_answered() -> None:
    with cluster() as c:
        for addr in ("garbage", "tcp://127.0.0.1:notaport"):
            got = c.router.decode[0].client.call(PairWith(pd_address=addr), timeout_s=3)
            assert isinstance(got, ErrorReply)
            assert got.reason.startswith(f"pairing with {addr!r} failed: Invalid argument")
        assert c.router.generate("after", list(range(20))).state == "success"


def test_a_one_process_prefill_lacking_some_of_our_heads_is_refused_at_pairing() -> None:
    """A 1:1 pairing (the prefill advertises no TP × PP placement) must cover our heads: a
    sender holding only part of them is a gather member only when its placement says its TP is
    finer than ours (``tests/pd/test_handshake_gather.py``). The refusal names the heads and
    comes at pairing: the decode worker then refuses an order naming that prefill before it
    allocates anything."""
    with cluster(GQA, prefill={"head_range": (0, 4)}, decode={"head_range": (1, 3)}) as c:
        narrow = PrefillWorker(
            base_config(name="narrow", head_range=(2, 4)), SyntheticProducer(GQA)
        )
        narrow.start()
        try:
            got = c.router.decode[0].client.call(
                PairWith(pd_address=narrow.endpoint.address), timeout_s=5
            )
            why = (
                "peer narrow is incompatible: peer refused: pool 0 KV heads: the receiver's "
                "(1, 3) are not all in the sender's (2, 4): one sender cannot fill them"
            )
            assert isinstance(got, ErrorReply) and got.reason.endswith(why), got
            assert narrow.endpoint.snapshot()["handshakes_refused"] == 1
            order = DecodeOrder(
                request_id="x", session_id="sx", prefill_peer="narrow", token_ids=(1, 2, 3)
            )
            refused = c.router.decode[0].client.call(order, timeout_s=5)
            assert isinstance(refused, ErrorReply) and "is not connected" in refused.reason
            assert (
                c.decode.pools.blocks.num_used_blocks == c.decode.pools.slots.num_used_blocks == 0
            )
            wide = c.router.decode[0].client.call(
                PairWith(pd_address=c.prefill.endpoint.address), timeout_s=5
            )
            assert isinstance(wide, Ack) and wide.detail == "prefill"  # covered: still pairs
            assert c.router.generate("ok", prompt(np.random.default_rng(0), 40)).state == "success"
            check_balanced(c.router)
        finally:
            narrow.close()


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

    verifies = True

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


class _Generating:
    """A generating decoder that grows the table by one token and relies on the worker to have
    marked the received prompt computed (it never marks the prompt itself)."""

    verifies = False

    def __init__(self, inner: KVDecoder) -> None:
        self.inner = inner
        self.seen: list[tuple[int, int]] = []

    def decode(self, job: DecodeJob, kv: PoolTensor, state: PoolTensor | None) -> DecodeOutput:
        self.seen.append((job.table.num_computed_tokens, job.table.num_tokens))
        job.table.append_tokens(job.pool, [job.first_token])
        job.table.mark_computed(job.pool, 1)
        return DecodeOutput(tokens=(job.first_token, job.first_token))


def test_the_worker_marks_the_prompt_computed_before_a_generating_decoder() -> None:
    with cluster() as c:
        gen = _Generating(c.decode.decoder)
        c.decode.decoder = gen  # type: ignore[assignment]
        res = c.router.generate("gen", list(range(2000, 2048)), max_new_tokens=2)
        assert (res.state, len(res.tokens)) == ("success", 2), res.reason
        assert gen.seen == [(48, 48)]  # the whole prompt computed when decode began
        assert c.decode.pools.blocks.num_cached_blocks == 3  # its 3 full blocks are cached
        check_balanced(c.router)
