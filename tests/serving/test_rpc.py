"""The runtime's order sockets: request/reply, late replies, bad frames, timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvplane.errors import InvalidArgumentError, RemoteDisconnectError, TransferTimeoutError
from kvplane.serving.messages import (
    Ack,
    AnyMessage,
    CancelOrder,
    ErrorReply,
    InfoQuery,
    StatsQuery,
)
from kvplane.serving.rpc import Reply, RpcClient, RpcServer
from kvplane.testing.cluster import free_port


class Echo:
    def __init__(self) -> None:
        self.later: list[Reply] = []

    def __call__(self, msg: AnyMessage, reply: Reply) -> None:
        if isinstance(msg, CancelOrder):
            if msg.request_id == "later":
                self.later.append(reply)  # answered from another thread, afterwards
                return
            raise InvalidArgumentError(f"bad request {msg.request_id!r}")
        if isinstance(msg, StatsQuery):
            return  # never answered
        reply(Ack(detail=type(msg).__name__))


@pytest.fixture
def served() -> Iterator[tuple[RpcServer, RpcClient, Echo]]:
    echo = Echo()
    server = RpcServer("tcp://127.0.0.1:0", echo)
    server.start()
    client = RpcClient(server.address, timeout_s=2.0)
    yield server, client, echo
    client.close()
    server.close()


def test_call_and_deferred_reply(served: tuple[RpcServer, RpcClient, Echo]) -> None:
    server, client, echo = served
    assert server.address.startswith("tcp://127.0.0.1:")
    assert client.call(InfoQuery()) == Ack(detail="InfoQuery")
    fut = client.call_async(CancelOrder(request_id="later"))
    while not echo.later:
        time.sleep(0.005)
    threading.Thread(target=echo.later[0], args=(Ack(detail="done"),)).start()
    assert fut.result(timeout=2) == Ack(detail="done")


def test_handler_errors_become_error_replies(served: tuple[RpcServer, RpcClient, Echo]) -> None:
    server, client, _ = served
    got = client.call(CancelOrder(request_id="x"))
    assert isinstance(got, ErrorReply) and "bad request 'x'" in got.reason
    assert server.counters["handler_errors"] == 1


def test_bad_frames_are_dropped_and_the_loop_keeps_serving(
    served: tuple[RpcServer, RpcClient, Echo],
) -> None:
    server, client, _ = served
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(server.address)
    raw.send(b"\xc1not an envelope")  # no readable call id: nobody to answer
    raw.send_multipart([b"a", b"b"])
    raw.send(msgspec.msgpack.encode(["x", 3, {"type": "info_query"}]))
    raw.close(linger=100)
    ctx.term()
    assert client.call(InfoQuery()) == Ack(detail="InfoQuery")
    assert server.counters["dropped_malformed"] == 2
    assert server.counters["dropped_bad_parts"] == 1


@pytest.mark.parametrize(
    ("envelope", "reason"),
    [
        ([1, 8, {"type": "generate", "request_id": "r", "token_ids": []}], "token_ids"),
        ([1, 9, {"type": "nope"}], "Invalid value 'nope'"),
        ([1, 10, {"type": "cancel_order"}], "missing required field `request_id`"),
        ([1, 11, {"type": "generate", "request_id": "r", "token_ids": [1 << 63]}], "<= 9223"),
        ([2, 12, {"type": "info_query"}], "runtime version 2 is not 1"),
        ([7, 13, "whatever"], "runtime version 7 is not 1"),
    ],
)
def test_a_frame_with_a_readable_call_id_is_answered(
    served: tuple[RpcServer, RpcClient, Echo], envelope: list[object], reason: str
) -> None:
    server, client, _ = served
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.RCVTIMEO, 2000)
    raw.connect(server.address)
    try:
        raw.send(msgspec.msgpack.encode(envelope))
        version, call_id, body = msgspec.msgpack.decode(raw.recv())
    finally:
        raw.close(linger=0)
        ctx.term()
    assert (version, call_id, body["type"]) == (1, envelope[1], "error")
    assert reason in body["reason"]
    assert server.counters["calls"] == 0  # the handler never saw it
    assert client.call(InfoQuery()) == Ack(detail="InfoQuery")


def test_a_malformed_reply_resolves_its_call_with_an_error_reply() -> None:
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    fake.setsockopt(zmq.RCVTIMEO, 2000)
    client = RpcClient(f"tcp://127.0.0.1:{port}", timeout_s=2.0)
    try:
        fut = client.call_async(InfoQuery())
        identity, payload = fake.recv_multipart()
        call_id = msgspec.msgpack.decode(payload)[1]
        fake.send_multipart([identity, msgspec.msgpack.encode([1, call_id, {"type": "nope"}])])
        got = fut.result(timeout=2)
        assert isinstance(got, ErrorReply) and "Invalid value 'nope'" in got.reason
        assert client.counters["refused_malformed"] == 1
    finally:
        client.close()
        fake.close(linger=0)
        ctx.term()


def test_a_reply_over_the_frame_limit_becomes_an_error_reply() -> None:
    server = RpcServer(
        "tcp://127.0.0.1:0", lambda m, reply: reply(Ack(detail="x" * 100_000)), max_frame=65536
    )
    server.start()
    client = RpcClient(server.address, timeout_s=2.0, max_frame=65536)
    try:
        got = client.call(InfoQuery())
        assert isinstance(got, ErrorReply)
        assert "exceeds the 65536-byte frame limit" in got.reason
        assert server.counters["replies_oversized"] == 1
        assert client.counters["socket_errors"] == 0
    finally:
        client.close()
        server.close()


def test_a_handler_bug_is_answered() -> None:
    def boom(msg: AnyMessage, reply: Reply) -> None:
        raise RuntimeError("oops")

    server = RpcServer("tcp://127.0.0.1:0", boom)
    server.start()
    client = RpcClient(server.address, timeout_s=2.0)
    try:
        assert client.call(InfoQuery()) == ErrorReply(reason="internal error: RuntimeError: oops")
    finally:
        client.close()
        server.close()


def test_timeout_names_the_call(served: tuple[RpcServer, RpcClient, Echo]) -> None:
    _, client, _ = served
    with pytest.raises(TransferTimeoutError, match=r"StatsQuery within 0\.1 s"):
        client.call(StatsQuery(), timeout_s=0.1)
    assert client.call(InfoQuery()) == Ack(detail="InfoQuery")


def test_a_client_of_a_dead_server_never_blocks_and_can_drop_what_it_queued() -> None:
    # 1,500 frames is past zmq's send high-water mark (1,000): a blocking send would stick the
    # loop, and every call after it would wait forever
    addr = f"tcp://127.0.0.1:{free_port()}"
    client = RpcClient(addr, timeout_s=0.5)
    seen: list[str] = []
    server: RpcServer | None = None
    fresh: RpcClient | None = None
    try:
        futs = [client.call_async(InfoQuery()) for _ in range(1500)]
        with pytest.raises(TransferTimeoutError, match=r"not sent within 0\.5 s"):
            futs[-1].result(timeout=3)  # zmq took 1,000: the rest waited, then failed
        assert client.counters["unsent"] == 500
        client.close(discard=True)  # at once, and what zmq queued for the address is dropped
        with pytest.raises(RemoteDisconnectError, match="closed"):
            futs[0].result(timeout=1)  # taken by zmq, never answered: resolved at the close
        with pytest.raises(RemoteDisconnectError, match="closed"):
            client.call_async(InfoQuery()).result(timeout=1)

        def record(msg: AnyMessage, reply: Reply) -> None:
            seen.append(type(msg).__name__)
            reply(Ack())

        server = RpcServer(addr, record)
        server.start()
        fresh = RpcClient(addr, timeout_s=3.0)
        assert fresh.call(InfoQuery()) == Ack()
        time.sleep(0.2)
        assert seen == ["InfoQuery"]  # only the fresh call: nothing stale arrives
    finally:
        client.close()
        for c in (fresh, server):
            if c is not None:
                c.close()


def test_a_frame_waits_for_the_connection_to_complete() -> None:
    addr = f"tcp://127.0.0.1:{free_port()}"
    client = RpcClient(addr, timeout_s=5.0)
    server = None
    try:
        fut = client.call_async(InfoQuery())  # no server yet: the frame waits in the outbox
        time.sleep(0.3)
        server = RpcServer(addr, lambda m, reply: reply(Ack(detail="late")))
        server.start()
        assert fut.result(timeout=5) == Ack(detail="late")
    finally:
        client.close()
        if server is not None:
            server.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "1"])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="timeout_s must be a finite number > 0"):
        RpcClient("tcp://127.0.0.1:1", timeout_s=bad)  # type: ignore[arg-type]
