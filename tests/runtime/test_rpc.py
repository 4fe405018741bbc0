"""The runtime's order sockets: request/reply, late replies, bad frames, timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvplane.errors import InvalidArgumentError, TransferTimeoutError
from kvplane.runtime.messages import (
    Ack,
    AnyMessage,
    CancelOrder,
    ErrorReply,
    InfoQuery,
    StatsQuery,
)
from kvplane.runtime.rpc import Reply, RpcClient, RpcServer, encode


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
    raw.send(b"\x92not an envelope")
    raw.send_multipart([b"a", b"b"])
    bad_version = encode(1, InfoQuery()).replace(b"\x93\x01", b"\x93\x07", 1)
    raw.send(bad_version)
    raw.close(linger=100)
    ctx.term()
    assert client.call(InfoQuery()) == Ack(detail="InfoQuery")
    assert server.counters["dropped_malformed"] == 1
    assert server.counters["dropped_bad_parts"] == 1
    assert server.counters["dropped_version"] == 1


def test_timeout_names_the_call(served: tuple[RpcServer, RpcClient, Echo]) -> None:
    _, client, _ = served
    with pytest.raises(TransferTimeoutError, match=r"StatsQuery within 0\.1 s"):
        client.call(StatsQuery(), timeout_s=0.1)
    assert client.call(InfoQuery()) == Ack(detail="InfoQuery")
