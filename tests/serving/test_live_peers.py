"""Info answers never hold the order thread behind the PD loop: real workers and sockets.

Issue 27 leftover: ``Worker.info()`` waited up to 1 s on the PD loop on the order thread, so
with the PD loop busy every info query held every order behind it for a second.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from kvplane.serving.live_peers import LivePeers
from kvplane.serving.messages import AnyMessage, InfoQuery, WorkerInfo
from kvplane.serving.rpc import RpcClient
from kvplane.serving.worker import PEERS_WAIT_S, Worker
from kvplane.testing.cluster import TEST_SECRET, cluster

STALL_S = 3.0
"""How long the test holds the PD loop."""


def _stall(w: Worker, seconds: float) -> threading.Thread:
    """Hold ``w``'s PD loop for ``seconds`` (from another thread)."""
    t = threading.Thread(target=lambda: w.endpoint.call(lambda: time.sleep(seconds), seconds + 5))
    t.start()
    return t


def test_info_answers_do_not_wait_on_a_stalled_pd_loop_in_line() -> None:
    with cluster() as c:
        w = c.decode
        client = RpcClient(w.address, timeout_s=10.0, secret=TEST_SECRET)
        try:
            first = client.call(InfoQuery())
            assert isinstance(first, WorkerInfo) and first.peers == ("prefill",)
            stall = _stall(w, STALL_S)
            time.sleep(0.1)  # the PD loop is now asleep in the stall
            start = time.monotonic()
            assert w.info().peers is None  # never waits (the peers come with a query)
            assert time.monotonic() - start < 0.05
            futs: list[Future[AnyMessage]] = [client.call_async(InfoQuery()) for _ in range(3)]
            got = [f.result(timeout=10.0) for f in futs]
            took = time.monotonic() - start
            # one read for all three, bounded by PEERS_WAIT_S; in line they took 3 s
            assert took < PEERS_WAIT_S + 0.8, f"answered after {took:.2f} s"
            assert all(isinstance(g, WorkerInfo) and g.peers is None for g in got)
            assert w.live_peers.unknown in (1, 2)  # one batch, or two in the same second
            stall.join()
            after = client.call(InfoQuery())
            # the loop answers again (what it lists depends on the leases the stall outlived)
            assert isinstance(after, WorkerInfo) and after.peers is not None
        finally:
            client.close()


def test_a_read_begins_after_the_answers_it_serves_were_queued() -> None:
    reads: list[float] = []
    gate = threading.Event()

    def read(timeout_s: float) -> list[str]:
        gate.wait(timeout_s)
        reads.append(time.monotonic())
        return ["b", "a"][: len(reads)]

    lp = LivePeers(read, wait_s=2.0, max_peers=1)
    got: list[tuple[str, ...] | None] = []
    done = threading.Event()

    def last(peers: tuple[str, ...] | None) -> None:
        got.append(peers)
        done.set()

    try:
        lp.ask(got.append)  # the first read starts and blocks on the gate
        time.sleep(0.1)
        queued = time.monotonic()
        lp.ask(got.append)  # queued during the first read: served by a second one
        lp.ask(last)
        gate.set()
        assert done.wait(5.0)
        assert got == [("b",), None, None]  # the second read listed 2 > max_peers: None
        assert lp.reads == 2 and reads[1] >= queued
    finally:
        lp.close()
    late: list[tuple[str, ...] | None] = []
    lp.ask(late.append)  # closed: answered None at once
    assert late == [None]
