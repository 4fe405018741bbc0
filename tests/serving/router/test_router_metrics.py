"""The router serves ``/metrics``: requests, their ends, pairings, workers, order-socket drops.

Finding 2 of issue 27: the router had no ``/metrics``, and order-socket drops were visible
nowhere.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
import zmq

from kvplane.errors import InvalidArgumentError, TransferTimeoutError
from kvplane.metrics import MetricsRegistry
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import Generate, InfoQuery, RequestResult
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer
from kvplane.serving.router.observe import RouterMetrics
from kvplane.serving.router.router import Router
from kvplane.serving.router.service import RouterService
from kvplane.serving.rpc import RpcClient
from kvplane.serving.rpc_auth import order_keys, secure_client
from kvplane.testing.cluster import MLA, base_config, free_port, wait_for

SECRET = b"router-metrics-test-secret"


@pytest.fixture
def service() -> Iterator[tuple[RouterService, int]]:
    p = PrefillWorker(base_config(secret=SECRET), SyntheticProducer(MLA))
    d = DecodeWorker(base_config(name="decode", secret=SECRET), SyntheticDecoder(MLA))
    p.start()
    d.start()
    router = Router([p.address], [d.address], timeout_s=20.0, secret=SECRET)
    port = free_port()
    svc = RouterService(router, "tcp://127.0.0.1:0", metrics_port=port)
    try:
        router.connect()
        svc.start()
        yield svc, port
    finally:
        svc.close()
        router.close()
        p.close()
        d.close()


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` at ``port`` as {sample with labels: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def test_router_metrics_count_requests_pairings_and_order_socket_drops(
    service: tuple[RouterService, int],
) -> None:
    svc, port = service
    client = RpcClient(svc.address, timeout_s=15.0, secret=SECRET)
    intruder = RpcClient(svc.address, timeout_s=0.5)  # no secret
    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        got = client.call(Generate(request_id="r1", token_ids=tuple(range(40))))
        assert isinstance(got, RequestResult) and got.state == "success"
        with pytest.raises(TransferTimeoutError):
            intruder.call(InfoQuery())
        raw.setsockopt(zmq.LINGER, 0)
        secure_client(raw, order_keys(SECRET))
        raw.connect(svc.address)
        raw.send(b"\xc1 not msgpack")  # authenticated, malformed: dropped and counted
        wait_for(lambda: svc.server.snapshot().get("dropped_malformed", 0) == 1, 5.0, "drop")
        wait_for(lambda: svc.server.snapshot().get("refused_unauthenticated", 0) >= 1, 5.0, "auth")
        m = scrape(port)
    finally:
        raw.close(linger=0)
        intruder.close(discard=True)
        client.close()
    assert m["kvplane_router_requests_total"] == 1.0
    assert m['kvplane_router_results_total{state="success"}'] == 1.0
    assert m["kvplane_router_pairings_total"] >= 2.0  # connect paired both workers
    assert m["kvplane_router_pairing_errors_total"] == 0.0
    assert m["kvplane_router_flights"] == 0.0
    assert m['kvplane_router_workers{state="up"}'] == 2.0
    assert m['kvplane_router_workers{state="down"}'] == 0.0
    assert m['kvplane_order_socket_drops_total{reason="malformed"}'] == 1.0
    assert m['kvplane_order_socket_drops_total{reason="unauthenticated"}'] >= 1.0


def test_results_are_counted_by_state_and_unknown_states_as_other() -> None:
    reg = MetricsRegistry()
    rm = RouterMetrics(reg, flights=lambda: 3, workers=lambda: (1, 2))
    for state in ("failed", "failed", "aborted", "x" * 300):
        rm.ended(state)
    assert reg.value("router_results", {"state": "failed"}, "_total") == 2.0
    assert reg.value("router_results", {"state": "aborted"}, "_total") == 1.0
    assert reg.value("router_results", {"state": "other"}, "_total") == 1.0
    assert reg.value("router_flights") == 3.0
    assert reg.value("router_workers", {"state": "down"}) == 2.0


def test_metrics_port_is_checked() -> None:
    router = Router(["tcp://127.0.0.1:9"], ["tcp://127.0.0.1:9"], timeout_s=0.2)
    try:
        for bad in (-1, 65536, "9100"):
            with pytest.raises(InvalidArgumentError, match="metrics_port"):
                RouterService(router, "tcp://127.0.0.1:0", metrics_port=bad)  # type: ignore[arg-type]
    finally:
        router.close()
