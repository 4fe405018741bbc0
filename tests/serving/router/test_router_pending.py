"""A cache-aware router's pending holdings, over stand-in workers (order servers; the decode
one holds its answers until the test releases them) that advertise a chunk-key scheme but
publish no KV events: the router records each routed prompt's chunks as expected on its prefill
worker, a second request of the prefix follows them there while the first is in flight, a
failed request's expectations go at once and a successful one's after the grace."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.serving.messages import (
    Ack,
    AnyMessage,
    DecodeOrder,
    InfoQuery,
    PairWith,
    PrefillOrder,
    RequestResult,
    WorkerInfo,
)
from kvplane.serving.router.route_policy import ChunkKeyScheme, RoutePolicy, rendezvous
from kvplane.serving.router.router import PENDING_GRACE_S, Router
from kvplane.serving.rpc import Reply, RpcServer
from kvplane.testing.cluster import wait_for

SCHEME = ChunkKeyScheme(BlockHasher(seed=3, fingerprint=b"fp"), ChunkSpec(4, 2))
PROMPTS = [list(range(100 * i, 100 * i + 40)) for i in range(1, 30)]
"""40 tokens each: 5 chunks of 2 blocks of 4."""


class Stand:
    """A stand-in worker: answers info (with :data:`SCHEME` for a prefill worker), acks every
    pairing and prefill order; a decode worker keeps each order's reply in ``held`` by
    request id until the test answers it."""

    def __init__(self, role: str, name: str) -> None:
        self.role, self.name = role, name
        self.held: dict[str, Reply] = {}
        self.lock = threading.Lock()
        self.server = RpcServer("tcp://127.0.0.1:0", self.handle)
        self.address = self.server.address
        self.server.start()

    def handle(self, msg: AnyMessage, reply: Reply) -> None:
        if isinstance(msg, InfoQuery):
            chunks = SCHEME.spec.blocks_per_chunk if self.role == "prefill" else 0
            reply(
                WorkerInfo(
                    role=self.role, peer_id=self.name, pd_address=f"pd-{self.name}",
                    incarnation=1, transport="tcp", hash_seed=3, hash_fingerprint=b"fp",
                    block_size=4, blocks_per_chunk=chunks,
                )
            )  # fmt: skip
        elif isinstance(msg, PairWith | PrefillOrder):
            reply(Ack(detail="ok"))
        elif isinstance(msg, DecodeOrder):
            with self.lock:
                self.held[msg.request_id] = reply

    def answer(self, request_id: str, state: str) -> None:
        with self.lock:
            reply = self.held.pop(request_id)
        reply(RequestResult(request_id=request_id, state=state, reason=state))


def test_pending_holdings_follow_routing_and_end_with_the_request() -> None:
    with ExitStack() as stack:
        ps = [Stand("prefill", "p0"), Stand("prefill", "p1")]
        d = Stand("decode", "d0")
        for w in (*ps, d):
            stack.callback(w.server.close)
        router = Router([p.address for p in ps], [d.address], timeout_s=5.0,
                        policy=RoutePolicy.CACHE_AWARE)  # fmt: skip
        stack.callback(router.close)
        router.connect()
        assert router.cache.scheme == SCHEME  # adopted from the prefill workers' info
        index = router.prefix_index

        def home(tokens: list[int]) -> str:
            return max(("p0", "p1"), key=lambda w: rendezvous(SCHEME.keys(tokens)[0], w))

        # a prompt whose home is p1, though the decode worker's cursor starts at p0
        x = next(t for t in PROMPTS if home(t) == "p1")
        a = router.submit("a", x)
        assert index.pending("p1", now=time.monotonic()) == frozenset(SCHEME.keys(x))
        # b shares a's first 4 chunks: they are only pending on p1, and b follows them
        # (p1 has a's 40 tokens queued: 40 + 9 tokens against p0's 41, under 1.35x: not busier)
        b = router.submit("b", x[:32] + [9] * 9)
        wait_for(lambda: len(d.held) == 2, what="both decode orders")
        assert index.longest_prefix(SCHEME.keys(x), now=time.monotonic())["p1"].pending == 5
        d.answer("a", "failed")  # a failed: its expectations go now; b's stay
        assert a.result(timeout=5).state == "failed"
        assert index.pending("p1", now=time.monotonic()) == frozenset(SCHEME.keys(x[:32] + [9] * 9))
        d.answer("b", "success")  # b succeeded: expected PENDING_GRACE_S more at most
        assert b.result(timeout=5).state == "success"
        now = time.monotonic()
        assert len(index.pending("p1", now=now)) == 5
        assert index.pending("p1", now=now + PENDING_GRACE_S) == frozenset()
        assert router.flights_live == 0
