"""The router's order socket: Generate, CancelOrder, InfoQuery, aggregated StatsQuery."""

from __future__ import annotations

import ast
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import (
    REPLY_MARGIN,
    Ack,
    AnyMessage,
    CancelOrder,
    ErrorReply,
    Generate,
    InfoQuery,
    RequestResult,
    Shutdown,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
)
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer
from kvplane.serving.router import router as router_module
from kvplane.serving.router.router import Router
from kvplane.serving.router.service import RouterService, router_stats
from kvplane.serving.rpc import DEFAULT_MAX_FRAME, RpcClient
from kvplane.testing.cluster import (
    MLA,
    TEST_SECRET,
    Cluster,
    base_config,
    check_balanced,
    cluster,
    free_port,
    wait_for,
)


@pytest.fixture
def served() -> Iterator[tuple[Cluster, RpcClient]]:
    c = cluster(replace(MLA, compute_s_per_step=0.05))
    service = RouterService(c.router, "tcp://127.0.0.1:0")
    service.start()
    client = RpcClient(service.address, timeout_s=15.0, secret=TEST_SECRET)
    yield c, client
    client.close()
    service.close()
    c.close()


def test_generate_info_cancel_and_refusals(served: tuple[Cluster, RpcClient]) -> None:
    c, client = served
    got = client.call(Generate(request_id="a", token_ids=tuple(range(40))))
    assert isinstance(got, RequestResult) and (got.state, got.mismatches) == ("success", 0)
    slow = client.call_async(Generate(request_id="dup", token_ids=tuple(range(200)), step_size=16))
    again = client.call(Generate(request_id="dup", token_ids=(1, 2)))
    assert again == ErrorReply(reason="request 'dup' is already in flight")
    assert client.call(CancelOrder(request_id="dup")) == Ack(detail="cancelling")
    assert client.call(CancelOrder(request_id="nobody")) == Ack(detail="unknown request")
    res = slow.result(timeout=15)
    assert isinstance(res, RequestResult) and res.state == "aborted"
    info = client.call(InfoQuery())
    assert isinstance(info, WorkerInfo) and (info.role, info.peer_id) == ("router", "router")
    assert client.call(Shutdown()) == ErrorReply(reason="the router does not take Shutdown")
    check_balanced(c.router)


def test_stats_are_aggregated_over_the_workers(served: tuple[Cluster, RpcClient]) -> None:
    c, client = served
    done = client.call(Generate(request_id="a", token_ids=tuple(range(40))))
    assert isinstance(done, RequestResult) and done.state == "success"
    check_balanced(c.router)
    got = client.call(StatsQuery(timeline=True))
    assert isinstance(got, WorkerStats) and got.peer_id == "router"
    each = c.router.stats()
    moved = sum(s.counters["pd_bytes_moved"] for s in each.values())
    assert got.counters["pd_bytes_moved"] == moved > 0
    own = {k: v for k, v in got.counters.items() if k.startswith("router_")}
    assert own == {
        "router_flights": 0, "router_gathered": 0, "router_workers_up": 2,
        "router_workers_down": 0, "router_workers_missing": 0,
    }  # fmt: skip
    assert (got.used_blocks, got.used_slots, got.requests_live, got.integrity) == (0, 0, 0, "")
    assert {e["worker"] for e in got.timeline} == {"prefill", "decode"}
    times = [float(e["t"]) for e in got.timeline]
    assert times == sorted(times) and got.timeline_truncated == 0


def test_a_generate_while_no_decode_worker_is_up_refreshes_first() -> None:
    base = base_config()
    dcfg = replace(base, name="decode", control_bind=f"tcp://127.0.0.1:{free_port()}")
    p = PrefillWorker(base, SyntheticProducer(MLA))
    d = DecodeWorker(dcfg, SyntheticDecoder(MLA))
    p.start()
    d.start()
    r = Router([p.address], [d.address], timeout_s=5.0, probe_s=0.3, secret=TEST_SECRET)
    service = RouterService(r, "tcp://127.0.0.1:0")
    service.start()
    client = RpcClient(service.address, timeout_s=10.0, secret=TEST_SECRET)
    try:
        r.connect()
        d.close()
        r.refresh()
        assert not r.ready()
        d = DecodeWorker(dcfg, SyntheticDecoder(MLA))  # restarted, same address
        d.start()
        got = client.call(Generate(request_id="after", token_ids=tuple(range(40))))
        assert isinstance(got, RequestResult) and (got.state, got.mismatches) == ("success", 0)
        check_balanced(r)
    finally:
        client.close()
        service.close()
        r.close()
        p.close()
        d.close()


def test_generates_while_a_role_is_down_share_one_refresh() -> None:
    dead = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    r = Router(dead[:1], dead[1:], timeout_s=5.0, probe_s=0.5)
    service = RouterService(r, "tcp://127.0.0.1:0")
    done: list[tuple[float, AnyMessage]] = []
    try:
        start = time.monotonic()
        for i in range(10):
            service.handle(
                Generate(request_id=f"g{i}", token_ids=(1, 2, 3)),
                lambda m: done.append((time.monotonic() - start, m)),
            )
        wait_for(lambda: len(done) == 10, what="ten replies")
        assert max(t for t, _ in done) < 1.5  # two refreshes of 0.5 s at most (ten in turn: 5 s)
        assert all(isinstance(m, ErrorReply) and "connect" in m.reason for _, m in done)
        assert r.refreshes <= 2
    finally:
        service.close()
        r.close()


def test_aggregated_stats_fit_the_router_sockets_frame_limit() -> None:
    with cluster() as c:
        for i in range(8):
            assert c.router.generate(f"r{i}", list(range(100))).state == "success"
        full = router_stats(c.router, 1 << 30, timeline=True)
        bare = len(msgspec.msgpack.encode(msgspec.structs.replace(full, timeline=())))
        limit = REPLY_MARGIN + bare + (len(msgspec.msgpack.encode(full)) - bare) // 2
        assert limit < DEFAULT_MAX_FRAME
        service = RouterService(c.router, "tcp://127.0.0.1:0", max_frame=limit)
        service.start()
        client = RpcClient(service.address, timeout_s=10.0, max_frame=limit, secret=TEST_SECRET)
        try:
            got = client.call(StatsQuery(timeline=True))
            assert isinstance(got, WorkerStats), got  # not an "exceeds the frame" ErrorReply
            assert got.timeline_truncated > 0 and got.timeline
        finally:
            client.close()
            service.close()


def test_the_router_does_not_import_its_server() -> None:
    # router_serve comes after router in its layer: it imports Router, never the other way
    tree = ast.parse(Path(router_module.__file__).read_text())
    names = {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module is not None
    }
    assert "kvplane.serving.router.service" not in names
    assert not hasattr(Router, "handle")
