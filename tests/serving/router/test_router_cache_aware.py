"""``Router(policy=cache-aware)`` over two real prefill workers (threads, real sockets) with
prefix offload and KV events, and one decode worker: a request repeating a prefix goes to the
prefill worker that holds it (where round-robin would send it to the other) and loads it."""

from __future__ import annotations

from contextlib import ExitStack

from kvplane.offload import OffloadConfig
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.kv_publisher import KVEventSettings
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.prefix_offload import PrefixSettings
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer
from kvplane.serving.router.route_policy import CacheRouting, ChunkKeyScheme, RoutePolicy
from kvplane.serving.router.router import Router
from kvplane.testing.cluster import MLA, TEST_SECRET, base_config, wait_for

X = list(range(1000, 1100))  # 100 tokens: 3 full chunks of 2 blocks of 16
Y = list(range(5000, 5100))


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
        router = Router(
            [p.address for p in ps], [d.address], timeout_s=20.0, secret=TEST_SECRET,
            policy=RoutePolicy.CACHE_AWARE, cache=CacheRouting(scheme),
        )  # fmt: skip
        stack.callback(router.close)
        router.connect()
        index = router.prefix_index

        def run(request_id: str, tokens: list[int]) -> None:
            assert router.generate(request_id, tokens).state == "success"

        # nothing cached, nothing queued: exact ties rotate, so X goes to p0 and Y to p1
        run("x0", X)
        run("y0", Y)
        for name in ("p0", "p1"):
            wait_for(lambda n=name: len(index.holdings(n).get("host", ())) == 3,  # type: ignore[misc]
                     what=f"{name}'s 3 stored chunks in the router's index")  # fmt: skip
        assert [dict(p.offload.hits) for p in ps if p.offload] == [{}, {}]
        # round-robin would now send Y's prefix to p0 and X's to p1: cache-aware crosses over
        run("y1", Y[:96] + [7] * 20)
        run("x1", X[:96] + [8] * 20)
        assert [dict(p.offload.hits) for p in ps if p.offload] == [{"host": 3}, {"host": 3}]
        assert scheme.keys(X)[0] in index.holdings("p0")["host"]
