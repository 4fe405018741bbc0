"""``Router(policy=cache-aware)`` over two real prefill workers (threads, real sockets) with
prefix offload and KV events, and one decode worker: a new prefix goes to the worker its first
chunk key picks (rendezvous hashing), and a request repeating a prefix goes to the prefill
worker that holds it (where round-robin would send it to the other) and loads it."""

from __future__ import annotations

from contextlib import ExitStack

from kvplane.offload import OffloadConfig
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.kv_publisher import KVEventSettings
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.prefix_offload import PrefixSettings
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer
from kvplane.serving.router.route_policy import (
    CacheRouting,
    ChunkKeyScheme,
    RoutePolicy,
    rendezvous,
)
from kvplane.serving.router.router import Router
from kvplane.testing.cluster import MLA, TEST_SECRET, base_config, wait_for

PROMPTS = [list(range(1000 + 100 * i, 1100 + 100 * i)) for i in range(40)]
"""100 tokens each: 3 full chunks of 2 blocks of 16."""


def test_a_repeated_prefix_goes_to_the_prefill_worker_holding_it() -> None:
    with ExitStack() as stack:
        ps = []
        for name in ("p0", "p1"):
            offload = PrefixSettings(OffloadConfig(host_slots=8, pin_memory=False), 2)
            p = PrefillWorker(base_config(name=name), SyntheticProducer(MLA), offload=offload,
                              kv_events=KVEventSettings())  # fmt: skip
            p.start()
            stack.callback(p.close)
            ps.append(p)
        d = DecodeWorker(base_config(name="decode"), SyntheticDecoder(MLA))
        d.start()
        stack.callback(d.close)
        assert ps[0].offload is not None and ps[1].offload is not None
        assert ps[0].pools.hasher.root == ps[1].pools.hasher.root  # one model, one key scheme
        scheme = ChunkKeyScheme(ps[0].pools.hasher, ps[0].offload.spec)

        def home(tokens: list[int]) -> str:
            return max(("p0", "p1"), key=lambda w: rendezvous(scheme.keys(tokens)[0], w))

        x = next(t for t in PROMPTS if home(t) == "p0")
        y = next(t for t in PROMPTS if home(t) == "p1")
        router = Router(
            [p.address for p in ps], [d.address], timeout_s=20.0, secret=TEST_SECRET,
            policy=RoutePolicy.CACHE_AWARE, cache=CacheRouting(scheme),
        )  # fmt: skip
        stack.callback(router.close)
        router.connect()
        index = router.prefix_index

        def run(request_id: str, tokens: list[int]) -> None:
            assert router.generate(request_id, tokens).state == "success"

        # nothing cached, nothing queued: each goes to its first key's rendezvous winner
        run("x0", x)
        run("y0", y)
        for name in ("p0", "p1"):
            wait_for(lambda n=name: len(index.holdings(n).get("host", ())) == 3,  # type: ignore[misc]
                     what=f"{name}'s 3 stored chunks in the router's index")  # fmt: skip
        assert [dict(p.offload.hits) for p in ps if p.offload] == [{}, {}]
        # round-robin would now send Y's prefix to p0 and X's to p1: cache-aware crosses over
        run("y1", y[:96] + [7] * 20)
        run("x1", x[:96] + [8] * 20)
        assert [dict(p.offload.hits) for p in ps if p.offload] == [{"host": 3}, {"host": 3}]
        assert scheme.keys(x)[0] in index.holdings("p0")["host"]
