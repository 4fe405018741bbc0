"""The router's order socket: Generate, CancelOrder, InfoQuery, aggregated StatsQuery."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from pd_testlib import FAST, MLA, Cluster, check_balanced, cluster, free_port

from kvplane.runtime.decode_worker import DecodeWorker
from kvplane.runtime.messages import (
    Ack,
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
from kvplane.runtime.prefill_worker import PrefillWorker
from kvplane.runtime.router import Router
from kvplane.runtime.rpc import RpcClient, RpcServer
from kvplane.runtime.synthetic_model import SyntheticDecoder, SyntheticProducer
from kvplane.runtime.worker_config import WorkerConfig


@pytest.fixture
def served() -> Iterator[tuple[Cluster, RpcClient]]:
    c = cluster(replace(MLA, compute_s_per_step=0.05))
    server = RpcServer("tcp://127.0.0.1:0", c.router.handle)
    server.start()
    client = RpcClient(server.address, timeout_s=15.0)
    yield c, client
    client.close()
    server.close()
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
        "router_flights": 0, "router_workers_up": 2, "router_workers_down": 0,
        "router_workers_missing": 0,
    }  # fmt: skip
    assert (got.used_blocks, got.used_slots, got.requests_live, got.integrity) == (0, 0, 0, "")
    assert {e["worker"] for e in got.timeline} == {"prefill", "decode"}
    times = [float(e["t"]) for e in got.timeline]
    assert times == sorted(times) and got.timeline_truncated == 0


def test_a_generate_while_no_decode_worker_is_up_refreshes_first() -> None:
    base = WorkerConfig(
        name="prefill", num_blocks=64, block_size=16, num_slots=16, step_size=32, timings=FAST
    )
    dcfg = replace(base, name="decode", control_bind=f"tcp://127.0.0.1:{free_port()}")
    p = PrefillWorker(base, SyntheticProducer(MLA))
    d = DecodeWorker(dcfg, SyntheticDecoder(MLA))
    p.start()
    d.start()
    r = Router([p.address], [d.address], timeout_s=5.0, probe_s=0.3)
    server = RpcServer("tcp://127.0.0.1:0", r.handle)
    server.start()
    client = RpcClient(server.address, timeout_s=10.0)
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
        server.close()
        r.close()
        p.close()
        d.close()
