"""Router membership: a worker that is not up never gets a backlog of queries; recycled
clients are closed; asking and recycling keep their contracts."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from kvplane.errors import InvalidArgumentError, ProtocolError, RemoteDisconnectError
from kvplane.serving.messages import (
    Ack,
    AnyMessage,
    CancelOrder,
    InfoQuery,
    PairWith,
    StatsQuery,
    WorkerInfo,
)
from kvplane.serving.router.membership import Membership
from kvplane.serving.router.router import Router
from kvplane.serving.router.workers import serves
from kvplane.serving.rpc import Reply, RpcClient, RpcServer
from kvplane.testing.cluster import free_port, wait_for


class Counting:
    """An order server that records every message type it is sent and answers info queries
    as ``role`` (and pairings with an ``Ack``)."""

    def __init__(self, role: str, bind: str = "tcp://127.0.0.1:0") -> None:
        self.role = role
        self.seen: list[str] = []
        self.server = RpcServer(bind, self.handle)
        self.address = self.server.address
        self.server.start()

    def handle(self, msg: AnyMessage, reply: Reply) -> None:
        self.seen.append(type(msg).__name__)
        if isinstance(msg, InfoQuery):
            reply(
                WorkerInfo(
                    role=self.role, peer_id=self.role, pd_address="tcp://127.0.0.1:1",
                    incarnation=1, transport="tcp",
                )
            )  # fmt: skip
        elif isinstance(msg, PairWith):
            reply(Ack(detail="paired"))

    def close(self) -> None:
        self.server.close()


def test_a_worker_never_up_gets_no_backlog_across_timeouts() -> None:
    # nothing listens at addr for several timeout_s; each resend after timeout_s goes out on a
    # fresh client (the old one, with zmq's queued frame, is dropped), so the process that
    # finally binds there gets one info query, not one per timeout_s
    addr = f"tcp://127.0.0.1:{free_port()}"
    alive = Counting("decode")
    r = Router([addr], [alive.address], timeout_s=0.25, probe_s=0.01)
    late = None
    try:
        clients: list[RpcClient] = []
        end = time.monotonic() + 1.5  # six times timeout_s
        while time.monotonic() < end:
            r.refresh()
            if not clients or clients[-1] is not r.prefill[0].client:
                clients.append(r.prefill[0].client)
            time.sleep(0.02)
        assert not r.prefill[0].up and r.decode[0].up
        late = Counting("prefill", bind=addr)
        time.sleep(0.8)  # zmq reconnects within 100 ms and hands over what it kept
        assert late.seen.count("InfoQuery") <= 1, late.seen
        assert all(c._closed for c in clients[:-1])  # every replaced client was closed

        def back_up() -> bool:
            with contextlib.suppress(ProtocolError):
                r.refresh()
            return r.prefill[0].up

        wait_for(back_up, what="prefill up")
        assert alive.seen.count("InfoQuery") >= 6  # the up worker was asked every refresh
    finally:
        r.close()
        alive.close()
        if late is not None:
            late.close()


def test_recycling_fails_the_old_clients_calls_and_stops_with_the_router() -> None:
    dead = f"tcp://127.0.0.1:{free_port()}"
    m = Membership([dead], [dead], timeout_s=0.2, probe_s=0.01, stop=threading.Event())
    try:
        w = m.prefill[0]
        old = w.client
        pending = old.call_async(CancelOrder(request_id="x", reason="r", session_id="x/1"))
        assert m.ask([(w, StatsQuery())], 0.01) == [None] and w.asked
        m.recycle(w)
        assert w.client is not old and old._closed and not w.asked
        with pytest.raises(RemoteDisconnectError):  # failed, not lost: its caller hears it
            pending.result(timeout=1)
        m.close()
        now = w.client
        m.recycle(w)  # stopped: no new client after close
        assert w.client is now and now._closed
    finally:
        m.close()


def test_an_up_worker_is_resent_to_on_its_own_client() -> None:
    # a worker that answers info queries but not stats: its slow stats query is sent again
    # after timeout_s on the same client, and its other calls are not failed for it
    w0 = Counting("prefill")
    m = Membership([w0.address], [], timeout_s=0.2, probe_s=0.5, stop=threading.Event())
    try:
        census = m.census(False)
        w = m.prefill[0]
        assert w.up and census.changed == (w,) and census.gone == ()
        client = w.client
        other = client.call_async(StatsQuery())  # never answered: like an order in flight
        assert m.gather_stats(False) == ({}, [f"{w0.address} (no reply)"])
        time.sleep(0.05)
        m.gather_stats(False)  # outstanding for more than timeout_s: sent again
        assert w.client is client and not other.done()
        # 3 stats queries reached the server; identical ones waiting share the first's answer
        shared = w0.server.snapshot().get("calls_shared", 0)
        assert w0.seen.count("StatsQuery") + shared == 3, (w0.seen, shared)
    finally:
        m.close()
        w0.close()


def _info(heads: tuple[tuple[int, int], ...], paged: int = 0) -> WorkerInfo:
    return WorkerInfo(
        role="w", peer_id="w", pd_address="a", incarnation=1, transport="tcp", head_ranges=heads,
        paged_pools=paged,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("held", "needed", "ok"),
    [
        (((0, 4), (0, 1)), ((1, 3), (0, 1)), True),  # GQA across TP degrees: a subset
        (((0, 2), (0, 1)), ((0, 2), (0, 1)), True),
        (((0, 2), (0, 1)), ((2, 4), (0, 1)), False),
        (((0, 2), (0, 1)), ((1, 3), (0, 1)), False),  # one sender per session: no split
        (((1, 3), (0, 1)), ((0, 4), (0, 1)), False),
        (((0, 1), (0, 1)), ((0, 1), (0, 1)), True),  # MLA's latent head
        ((), ((2, 4),), True),  # a worker that does not say: the handshake decides
        (((0, 2),), (), True),
        (((0, 2),), ((0, 2), (0, 1)), False),  # pools that differ: never served
    ],
)
def test_serves_is_heads_cover_in_every_pool(
    held: tuple[tuple[int, int], ...], needed: tuple[tuple[int, int], ...], ok: bool
) -> None:
    assert serves(_info(held), _info(needed)) is ok


@pytest.mark.parametrize(
    ("held", "held_paged", "needed", "needed_paged", "ok"),
    [
        (((0, 2), (0, 1)), 1, ((0, 2), (0, 2), (0, 1)), 2, True),  # one pool -> KV cache groups
        (((0, 2), (0, 2), (0, 1)), 2, ((0, 2), (0, 1)), 1, True),  # groups -> one pool
        (((0, 4), (0, 4)), 2, ((1, 3), (1, 3)), 2, True),  # groups, GQA across TP degrees
        (((0, 2), (0, 2)), 2, ((2, 4),), 1, False),  # the paged pools' heads not covered
        (((0, 2),), 1, ((0, 2), (0, 2), (0, 1)), 2, False),  # whole-only pools differ: 0 vs 1
        (((0, 2),), 0, ((0, 2), (0, 2)), 2, False),  # one does not say: pools pair by index
    ],
)
def test_paged_pools_pair_by_layers_and_whole_only_pools_by_index(
    held: tuple[tuple[int, int], ...],
    held_paged: int,
    needed: tuple[tuple[int, int], ...],
    needed_paged: int,
    ok: bool,
) -> None:
    assert serves(_info(held, held_paged), _info(needed, needed_paged)) is ok


def test_paged_pools_cannot_exceed_the_pools() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^paged_pools 2 exceeds the 1 head ranges$"):
        _info(((0, 2),), paged=2)
