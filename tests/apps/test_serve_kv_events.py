"""``kvplane serve prefill --kv-events``: a real prefill worker publishes its offload tiers'
chunk changes and a router finds it through membership; bad flags refused before start."""

from __future__ import annotations

import socket
from collections.abc import Callable
from functools import partial

import pytest

from kvplane.apps.serve import kv_events_of
from kvplane.cli import build_parser
from kvplane.errors import ConfigError
from kvplane.serving.kv_describe import KeyScheme
from kvplane.serving.kv_publisher import KVEventSettings
from kvplane.serving.messages import InfoQuery, WorkerInfo
from kvplane.serving.router.kv_subscriber import EventSource
from kvplane.serving.router.route_policy import RoutePolicy
from kvplane.serving.router.router import Router
from kvplane.serving.rpc import RpcClient
from kvplane.testing.cluster import TEST_SECRET, Proc, wait_for

SMALL = ["--layers", "1", "--latent-dim", "16", "--rope-dim", "8"]
EVENTS = ["--offload-host-slots", "8", "--blocks-per-chunk", "1", "--kv-events"]


def test_the_router_indexes_a_prefill_workers_stored_chunks(
    procs: list[Proc], start_procs: Callable[..., list[Proc]]
) -> None:
    pre, dec = start_procs(
        procs, partial(Proc, "prefill", [*SMALL, *EVENTS]), partial(Proc, "decode", SMALL)
    )
    source = EventSource(str(pre.info["kv_events"]), str(pre.info["kv_replay"]))
    assert source.address.startswith("tcp://127.0.0.1:") and dec.info["kv_events"] == ""
    client = RpcClient(pre.control, timeout_s=10, secret=TEST_SECRET)
    try:
        info = client.call(InfoQuery())
    finally:
        client.close()
    assert isinstance(info, WorkerInfo)
    assert (info.kv_events_address, info.kv_replay_address) == (
        source.address,
        source.replay_address,
    )
    router = Router(
        [pre.control],
        [dec.control],
        timeout_s=20,
        secret=TEST_SECRET,
        policy=RoutePolicy.CACHE_AWARE,
    )
    try:
        router.connect()
        assert router.kv_events.sources == {"prefill": source}
        assert (info.block_size, info.blocks_per_chunk) == (16, 1)  # its chunk-key scheme
        # 70 tokens: 4 full chunks of one 16-token block, each stored in the host tier
        assert router.generate("r0", list(range(70))).state == "success"
        index = router.prefix_index

        def indexed() -> bool:
            return len(index.holdings("prefill").get("host", ())) == 4

        wait_for(indexed, what="the 4 stored chunks in the router's index")
        held = index.holdings("prefill")
        assert list(held) == ["host"] and index.workers() == ["prefill"]
        for key in held["host"]:
            match = index.longest_prefix([key])["prefill"]
            assert (match.any_tier, dict(match.by_tier)) == (1, {"host": 1})
        # the router keys the prompt exactly as the worker did, from what WorkerInfo advertises
        assert router.cache.scheme is not None
        keys = router.cache.scheme.keys(list(range(70)))
        assert len(keys) == 4 and set(keys) == set(held["host"])
        assert router.cache.matches(index, list(range(70)))["prefill"].any_tier == 4
        subscriber = router.kv_events.subscriber
        assert subscriber is not None
        # its publisher describes the same scheme to a reader without WorkerInfo (a proxy)
        said = subscriber.describe(0, timeout_s=10)
        assert said.scheme == KeyScheme(info.hash_seed, info.hash_fingerprint, 16, 1)
        assert router.kv_events.update(w.info for w in router.workers) is False  # unchanged
    finally:
        router.close()
    assert router.kv_events.subscriber is None
    assert len(router.prefix_index.holdings("prefill")["host"]) == 4  # still readable


def _args(*argv: str) -> object:
    return build_parser().parse_args(["serve", "prefill", *SMALL, *argv])


def test_kv_event_flags_become_settings() -> None:
    assert kv_events_of(_args(*EVENTS[:-1])) is None  # type: ignore[arg-type]
    got = kv_events_of(
        _args(*EVENTS, "--kv-events-pub", "tcp://127.0.0.1:0")  # type: ignore[arg-type]
    )
    assert got == KVEventSettings("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")


def test_kv_event_flags_are_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="--kv-events needs --offload-host-slots"):
        kv_events_of(_args("--kv-events"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"kv_events_pub|--kv-events-pub"):
        kv_events_of(
            _args(*EVENTS, "--kv-events-pub", "tcp://127.0.0.1:99999")  # type: ignore[arg-type]
        )
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match="--kv-events-replay"):
            kv_events_of(
                _args(*EVENTS, "--kv-events-replay", f"tcp://127.0.0.1:{port}")  # type: ignore[arg-type]
            )
    finally:
        busy.close()
