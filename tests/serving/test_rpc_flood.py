"""An order server bounds what a flood can queue, and keeps orders moving under one.

Identical queries waiting together share one answer; calls held unanswered are bounded per
connection and in all. Finding 2 of issue 27: 10,000 tiny ``StatsQuery`` frames stalled the
next request for 8 s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import pytest
import zmq

from kvplane.errors import InvalidArgumentError
from kvplane.serving.messages import (
    Ack,
    AnyMessage,
    CancelOrder,
    ErrorReply,
    InfoQuery,
    StatsQuery,
    WorkerStats,
)
from kvplane.serving.router.router import Router
from kvplane.serving.rpc import Reply, RpcClient, RpcServer
from kvplane.serving.rpc_admission import Admission
from kvplane.serving.rpc_auth import order_keys, secure_client
from kvplane.serving.rpc_codec import encode
from kvplane.testing import cluster
from kvplane.testing.cluster import Proc, free_port, wait_for

SECRET: bytes = getattr(cluster, "TEST_SECRET", b"flood-test-secret")
"""The secret of the processes this test starts (``KVPLANE_SECRET``)."""


class Holder:
    """Holds every ``StatsQuery`` and ``CancelOrder`` reply until told; answers the rest."""

    def __init__(self) -> None:
        self.held: list[tuple[AnyMessage, Reply]] = []

    def __call__(self, msg: AnyMessage, reply: Reply) -> None:
        if isinstance(msg, StatsQuery | CancelOrder):
            self.held.append((msg, reply))
        else:
            reply(Ack(detail=type(msg).__name__))

    def answer_all(self) -> None:
        held, self.held = self.held, []
        for msg, reply in held:
            reply(Ack(detail=f"{type(msg).__name__} answered"))


@pytest.fixture
def held() -> Iterator[tuple[RpcServer, Holder]]:
    holder = Holder()
    server = RpcServer("tcp://127.0.0.1:0", holder, max_pending=6, max_pending_per_peer=4)
    server.start()
    yield server, holder
    server.close()


def test_identical_queries_waiting_together_share_one_answer() -> None:
    holder = Holder()
    server = RpcServer("tcp://127.0.0.1:0", holder)
    server.start()
    client = RpcClient(server.address, timeout_s=5.0)
    try:
        futs = [client.call_async(StatsQuery()) for _ in range(200)]
        futs.append(client.call_async(StatsQuery(timeline=True)))
        wait_for(lambda: server.snapshot().get("calls", 0) == 201, 5.0, "the queries")
        assert [m for m, _ in holder.held] == [StatsQuery(), StatsQuery(timeline=True)]
        holder.answer_all()
        assert {f.result(timeout=5) for f in futs} == {Ack(detail="StatsQuery answered")}
        assert server.snapshot()["calls_shared"] == 199
        later = client.call_async(StatsQuery())  # after the answer: a fresh computation
        wait_for(lambda: len(holder.held) == 1, 5.0, "a new query")
        holder.answer_all()
        assert later.result(timeout=5) == Ack(detail="StatsQuery answered")
        assert server.admission.pending == 0
    finally:
        client.close()
        server.close()


def test_calls_held_unanswered_are_bounded_per_connection_and_in_all(
    held: tuple[RpcServer, Holder],
) -> None:
    server, holder = held
    a, b = (RpcClient(server.address, timeout_s=5.0) for _ in range(2))
    try:
        mine = [a.call_async(CancelOrder(request_id=f"a{i}")) for i in range(5)]
        refused = mine[4].result(timeout=5)
        assert isinstance(refused, ErrorReply) and "busy" in refused.reason
        assert a.call(InfoQuery()) == ErrorReply(reason=refused.reason)  # still over its bound
        theirs = [b.call_async(CancelOrder(request_id=f"b{i}")) for i in range(3)]
        assert isinstance(theirs[2].result(timeout=5), ErrorReply)  # 6 held in all
        wait_for(lambda: len(holder.held) == 6, 5.0, "six held calls")
        counters = server.snapshot()
        assert counters["refused_over_bound"] == 3 and server.admission.pending == 6
        holder.answer_all()
        assert all(f.result(timeout=5) == Ack(detail="CancelOrder answered") for f in mine[:4])
        assert a.call(InfoQuery()) == Ack(detail="InfoQuery")  # slots given back
    finally:
        a.close()
        b.close()
    assert server.admission.pending == 0


def test_admission_bounds_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="max_pending"):
        Admission(max_pending=0)
    with pytest.raises(InvalidArgumentError, match="exceeds"):
        Admission(max_pending=2, max_pending_per_peer=3)


def flood(address: str, n: int, secret: bytes | None) -> zmq.Socket[bytes]:
    """Queue ``n`` ``StatsQuery`` frames to ``address`` without reading any answer; the socket
    (close it with linger 0)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        secure_client(sock, order_keys(secret))
    sock.connect(address)
    for i in range(n):
        sock.send(encode(i + 1, StatsQuery()))
    return sock


WORKER = [
    "--layout", "mla", "--layers", "2", "--latent-dim", "32", "--rope-dim", "16",
    "--num-blocks", "128", "--heartbeat", "0.1", "--lease", "0.6",
]  # fmt: skip


def _worker(role: str) -> Proc:
    return Proc(role, ["--name", role, "--control", f"tcp://127.0.0.1:{free_port()}", *WORKER])


def test_a_stats_flood_does_not_stall_the_next_request(
    monkeypatch: pytest.MonkeyPatch,
    start_procs: Callable[..., list[Proc]],
    stop_procs: Callable[[Sequence[Proc]], None],
) -> None:
    """10,000 ``StatsQuery`` frames to each worker process, then one request: it is served
    within seconds (it waited 8 s behind the flood before shared answers)."""
    monkeypatch.setenv("KVPLANE_SECRET", SECRET.decode())
    procs: list[Proc] = []
    router: Router | None = None
    socks: list[zmq.Socket[bytes]] = []
    try:
        start_procs(procs, *[partial(_worker, role) for role in ("prefill", "decode")])
        router = Router([procs[0].control], [procs[1].control], timeout_s=30.0, secret=SECRET)
        router.connect()
        assert router.generate("warm", list(range(64))).state == "success"
        socks = [flood(p.control, 10_000, SECRET) for p in procs]
        start = time.monotonic()
        assert router.generate("after-flood", list(range(64))).state == "success"
        took = time.monotonic() - start
        assert took < 2.5, f"the request waited {took:.2f} s behind the flood"
        stats = router.stats()
        assert all(isinstance(s, WorkerStats) for s in stats.values())
        assert any(s.counters.get("rpc_calls_shared", 0) > 0 for s in stats.values())
    finally:
        for sock in socks:
            sock.close(linger=0)
        if router is not None:
            router.close()
        stop_procs(procs)
