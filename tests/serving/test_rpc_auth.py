"""The order sockets authenticate both ways with the cluster secret (CURVE), and count refusals.

Against in-process sockets and against a real ``kvplane serve decode`` process (finding 2 of
issue 27: an unauthenticated ``Shutdown`` stopped a decode worker).
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
import zmq

from kvplane.errors import InvalidArgumentError, TransferTimeoutError
from kvplane.serving.messages import (
    Ack,
    AnyMessage,
    InfoQuery,
    Shutdown,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
)
from kvplane.serving.rpc import Reply, RpcClient, RpcServer
from kvplane.serving.rpc_auth import order_keys
from kvplane.serving.rpc_codec import encode
from kvplane.testing import cluster
from kvplane.testing.cluster import Proc, free_port, wait_for

SECRET: bytes = getattr(cluster, "TEST_SECRET", b"order-socket-test-secret")
"""The secret of the processes this test starts (``KVPLANE_SECRET``)."""


def test_keys_are_derived_from_the_secret_alone() -> None:
    keys = order_keys(SECRET)
    assert keys == order_keys(SECRET)
    other = order_keys(b"another secret")
    assert {keys.server_public, keys.client_public}.isdisjoint(
        {other.server_public, other.client_public}
    )
    assert keys.server_public != keys.client_public
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert zmq.curve_public(keys.client_secret) == keys.client_public
    assert len(keys.client_public_raw) == 32
    for bad in (b"", "text"):
        with pytest.raises(InvalidArgumentError, match="non-empty bytes"):
            order_keys(bad)  # type: ignore[arg-type]


class Recorder:
    """A handler that records what it was asked and answers ``Ack``."""

    def __init__(self) -> None:
        self.seen: list[AnyMessage] = []

    def __call__(self, msg: AnyMessage, reply: Reply) -> None:
        self.seen.append(msg)
        reply(Ack(detail=type(msg).__name__))


@pytest.fixture
def secured() -> Iterator[tuple[RpcServer, Recorder]]:
    rec = Recorder()
    server = RpcServer("tcp://127.0.0.1:0", rec, secret=SECRET)
    server.start()
    yield server, rec
    server.close()


def test_a_client_with_the_secret_is_served(secured: tuple[RpcServer, Recorder]) -> None:
    server, rec = secured
    client = RpcClient(server.address, timeout_s=5.0, secret=SECRET)
    try:
        assert client.call(InfoQuery()) == Ack(detail="InfoQuery")
        assert client.call(Shutdown()) == Ack(detail="Shutdown")
    finally:
        client.close()
    assert rec.seen == [InfoQuery(), Shutdown()]
    assert server.snapshot().get("refused_unauthenticated", 0) == 0


@pytest.mark.parametrize("secret", [None, b"a wrong secret"], ids=["plain", "wrong-secret"])
def test_a_client_without_the_secret_is_refused_before_any_order_is_read(
    secured: tuple[RpcServer, Recorder], secret: bytes | None
) -> None:
    server, rec = secured
    client = RpcClient(server.address, timeout_s=0.5, secret=secret)
    try:
        with pytest.raises(TransferTimeoutError):
            client.call(Shutdown())
    finally:
        client.close(discard=True)
    wait_for(lambda: server.snapshot().get("refused_unauthenticated", 0) >= 1, 5.0, "refusal")
    assert rec.seen == []
    assert server.snapshot().get("calls", 0) == 0


def test_the_servers_public_key_alone_is_not_enough(secured: tuple[RpcServer, Recorder]) -> None:
    """The ZAP check: a client with the servers' public key but its own keypair is refused."""
    server, rec = secured
    public, secret = zmq.curve_keypair()
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, order_keys(SECRET).server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    try:
        sock.connect(server.address)
        sock.send(encode(1, Shutdown()))
        wait_for(lambda: server.snapshot().get("refused_unauthenticated", 0) >= 1, 5.0, "refusal")
        assert sock.poll(300) == 0  # no answer
    finally:
        sock.close(linger=0)
    assert rec.seen == []


def test_raw_bytes_on_a_secured_socket_are_refused(secured: tuple[RpcServer, Recorder]) -> None:
    server, rec = secured
    host, port = server.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        # a NULL-mechanism ZMTP 3.0 greeting, then an order frame
        greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
        raw.sendall(greeting)
        raw.sendall(b"\x00" + bytes([len(frame := encode(1, Shutdown()))]) + frame)
        wait_for(lambda: server.snapshot().get("refused_unauthenticated", 0) >= 1, 5.0, "refusal")
    assert rec.seen == []


def test_a_secured_client_refuses_a_server_without_the_secret() -> None:
    rec = Recorder()
    plain = RpcServer("tcp://127.0.0.1:0", rec)
    plain.start()
    client = RpcClient(plain.address, timeout_s=0.5, secret=SECRET)
    try:
        with pytest.raises(TransferTimeoutError):
            client.call(InfoQuery())
        wait_for(lambda: client.snapshot().get("refused_unauthenticated", 0) >= 1, 5.0, "refusal")
    finally:
        client.close(discard=True)
        plain.close()
    assert rec.seen == []


WORKER = [
    "--layout", "mla", "--layers", "2", "--latent-dim", "32", "--rope-dim", "16",
    "--num-blocks", "64",
]  # fmt: skip


def test_unauthenticated_shutdown_does_not_stop_a_decode_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 2: a process without the secret sent ``Shutdown`` and the decode worker exited.
    Now it is refused before decoding, counted in ``StatsQuery`` and ``/metrics``."""
    monkeypatch.setenv("KVPLANE_SECRET", SECRET.decode())
    mport = free_port()
    control = f"tcp://127.0.0.1:{free_port()}"
    dec = Proc(
        "decode",
        ["--name", "decode", "--control", control, "--metrics-port", str(mport), *WORKER],
    )
    try:
        for secret in (None, b"not the secret"):
            intruder = RpcClient(dec.control, timeout_s=1.0, secret=secret)
            try:
                with pytest.raises(TransferTimeoutError):
                    intruder.call(Shutdown())
            finally:
                intruder.close(discard=True)
        time.sleep(0.5)
        assert dec.proc.poll() is None, "the decode worker exited on an unauthenticated order"
        client = RpcClient(dec.control, timeout_s=10.0, secret=SECRET)
        try:
            assert isinstance(client.call(InfoQuery()), WorkerInfo)
            stats = client.call(StatsQuery())
            assert isinstance(stats, WorkerStats)
            assert stats.counters.get("rpc_refused_unauthenticated", 0) >= 2
            url = f"http://127.0.0.1:{mport}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            assert 'kvplane_order_socket_drops_total{reason="unauthenticated"}' in text
            assert client.call(Shutdown()) == Ack(detail="exiting")
        finally:
            client.close()
        assert dec.proc.wait(timeout=15) == 0
    finally:
        if dec.proc.poll() is None:
            dec.stop()
