"""Router edge cases: refusals fail the request on both sides; configs are validated; request
ids are unique in flight; cancels are keyed by session; deadlines; workers going down and up."""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from kvplane.apps import serve
from kvplane.cli import build_parser, main
from kvplane.errors import (
    ConfigError,
    InvalidArgumentError,
    ProtocolError,
    TransferTimeoutError,
)
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import (
    Ack,
    AnyMessage,
    CancelOrder,
    DecodeOrder,
    ErrorReply,
    InfoQuery,
    PairWith,
    PrefillOrder,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
)
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer
from kvplane.serving.router.router import Router
from kvplane.serving.router.service import RouterService
from kvplane.serving.rpc import Reply, RpcServer
from kvplane.serving.worker_config import WorkerConfig
from kvplane.testing.cluster import (
    FAST,
    MLA,
    TEST_SECRET,
    base_config,
    check_balanced,
    cluster,
    free_port,
    prompt,
    start_slow,
    wait_for,
)


def test_a_refused_order_fails_the_request_and_frees_both_sides() -> None:
    # the prefill side never hears from a receiver, so its session ends at its own deadline
    quick = replace(FAST, deadline_s=0.5, verdict_grace_s=0.3)
    with cluster(decode={"num_blocks": 4}, timings=quick) as c:
        res = c.router.generate("big", list(range(200)))  # needs 13 decode blocks of 16
        assert res.state == "failed" and "needs 13 blocks" in res.reason
        assert c.router.generate("small", list(range(20))).state == "success"
        check_balanced(c.router)


def test_decode_refuses_an_unpaired_prefill_peer() -> None:
    with cluster() as c:
        got = c.router.decode[0].client.call(
            DecodeOrder(
                request_id="x",
                session_id="s",
                prefill_peer="stranger",
                token_ids=(1, 2),
            )
        )
        assert isinstance(got, ErrorReply) and "'stranger' is not connected" in got.reason
        check_balanced(c.router)


def test_router_misuse_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match="at least one"):
        Router([], ["tcp://127.0.0.1:1"])
    r = Router(["tcp://127.0.0.1:9"], ["tcp://127.0.0.1:9"], timeout_s=0.2)
    try:
        with pytest.raises(ProtocolError, match="connect"):
            r.submit("x", [1])
        with pytest.raises(InvalidArgumentError, match="side"):
            r.cancel("y", side="middle")
        assert not r.cancel("y")
        with pytest.raises(ProtocolError, match="no prefill worker answered"):
            r.connect()  # nothing listens there
        assert not r.ready() and r.refresh() == []
    finally:
        r.close()
    for kw in ({"deadline_s": 0}, {"refresh_s": -1.0}, {"timeout_s": True}, {"probe_s": "1"}):
        with pytest.raises(InvalidArgumentError, match=next(iter(kw))):
            Router(["tcp://127.0.0.1:9"], ["tcp://127.0.0.1:9"], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_blocks", 0, "num_blocks"),
        ("pd_bind", "127.0.0.1", "zmq address"),
        ("head_range", (3, 1), "head_range"),
        ("slice_timeout_s", 0, "slice_timeout_s"),
        ("metrics_port", 70000, "metrics_port"),
        ("name", "", "name"),
    ],
)
def test_worker_config_names_the_bad_field(field: str, value: object, match: str) -> None:
    kwargs: dict[str, object] = {"name": "w", field: value}
    with pytest.raises(ConfigError, match=match):
        WorkerConfig(**kwargs)  # type: ignore[arg-type]


def test_serve_command_is_registered() -> None:
    parser = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "decode",
            "--block-size",
            "8",
            "--head-range",
            "0:2",
            "--layout",
            "gqa",
            "--sliding-window",
            "64",
            "--insecure",
        ]
    )
    config = serve.config_of(args)
    assert (config.block_size, config.head_range, config.transport) == (8, (0, 2), "tcp")
    assert config.pd_bind.startswith("tcp://127.0.0.1:")
    assert serve.spec_of(args).sliding_window == 64
    assert not [k for k in vars(args) if k.startswith("chaos")]  # no fault flags in production
    bad = parser.parse_args(["serve", "prefill", "--head-range", "x"])
    with pytest.raises(ConfigError, match="START:END"):
        serve.config_of(bad)
    assert serve.run(argparse.Namespace()) == 2
    assert main(["serve", "prefill", "--num-blocks", "0"]) == 1


def test_a_duplicate_request_id_is_refused_before_anything_is_sent() -> None:
    with cluster(replace(MLA, compute_s_per_step=0.05)) as c:
        rng = np.random.default_rng(1)
        first = start_slow(c, "req")
        calls = (c.prefill.rpc.counters["calls"], c.decode.rpc.counters["calls"])
        with pytest.raises(InvalidArgumentError, match="request 'req' is already in flight"):
            c.router.submit("req", prompt(rng, 50))
        assert (c.prefill.rpc.counters["calls"], c.decode.rpc.counters["calls"]) == calls
        with pytest.raises(InvalidArgumentError, match=r"token_ids\[1\]"):
            c.router.submit("other", [1, 1 << 63])
        res = first.result(timeout=15)
        assert (res.state, res.mismatches) == ("success", 0)
        assert c.router.generate("req", list(range(20))).state == "success"  # ended: reusable
        check_balanced(c.router)


def test_a_cancel_naming_another_session_never_stops_the_request() -> None:
    with cluster(replace(MLA, compute_s_per_step=0.05)) as c:
        fut = start_slow(c, "req")
        stray = CancelOrder(request_id="req", reason="stray", session_id="req/other.0")
        for w in (c.router.prefill[0], c.router.decode[0]):
            assert w.client.call(stray) == Ack(detail="unknown request")
        res = fut.result(timeout=15)
        assert (res.state, res.mismatches) == ("success", 0)
        check_balanced(c.router)


def test_a_request_past_its_deadline_fails_and_is_cancelled_on_both_sides() -> None:
    c = cluster(replace(MLA, compute_s_per_step=0.2))  # 13 steps: ~2.6 s of prefill
    r = Router(
        [c.prefill.address], [c.decode.address], timeout_s=5.0, deadline_s=0.5,
        secret=TEST_SECRET,
    )  # fmt: skip
    try:
        r.connect()
        start = time.monotonic()
        res = r.submit("slow", list(range(200)), step_size=16).result(timeout=5)
        assert 0.5 <= time.monotonic() - start < 2.0
        assert (res.state, res.reason) == (
            "failed",
            "no answer within the request deadline (0.5 s)",
        )
        assert r.flights_live == 0
        check_balanced(c.router)
        for w in (c.prefill, c.decode):  # cancelled on both sides, not left to finish
            ends = [e.detail for e in w.timeline.events("slow") if e.mark == "session_end"]
            assert ends == ["aborted"], (w.role, ends)
    finally:
        r.close()
        c.close()


class SpyDecode(DecodeWorker):
    """A decode worker that records the request ids of the decode orders it is sent."""

    orders: list[str]

    def _on_order(self, msg: AnyMessage, reply: Reply) -> None:
        if isinstance(msg, DecodeOrder):
            self.orders.append(msg.request_id)
        super()._on_order(msg, reply)


class SpyPrefill(PrefillWorker):
    """A prefill worker that records the cancel orders it is sent: (request id, reason)."""

    cancels: list[tuple[str, str]]

    def _on_order(self, msg: AnyMessage, reply: Reply) -> None:
        if isinstance(msg, CancelOrder):
            self.cancels.append((msg.request_id, msg.reason))
        super()._on_order(msg, reply)


def test_an_unreachable_worker_is_marked_down_and_comes_back() -> None:
    base = base_config()
    p = SpyPrefill(base, SyntheticProducer(MLA))
    p.cancels = []
    bind = f"tcp://127.0.0.1:{free_port()}"
    configs = [replace(base, name="d0"), replace(base, name="d1", control_bind=bind)]
    ds = [DecodeWorker(cfg, SyntheticDecoder(MLA)) for cfg in configs]
    for w in (p, *ds):
        w.start()
    r = Router([p.address], [d.address for d in ds], timeout_s=3.0, probe_s=0.3, secret=TEST_SECRET)
    try:
        r.connect()
        assert [r.generate(f"w{i}", list(range(30))).state for i in range(2)] == ["success"] * 2
        ds[1].close()
        futs = [r.submit(f"x{i}", list(range(30))) for i in range(4)]
        assert r.refresh() == []  # no exception: d1 is marked down
        got = [f.result(timeout=5) for f in futs]
        assert [g.state for g in got] == ["success", "failed"] * 2
        assert got[1].reason == f"decode worker at {bind} is unreachable"
        assert [r.decode[0].up, r.decode[1].up] == [True, False]
        gone = f"decode worker at {bind} is unreachable"
        wait_for(lambda: len(p.cancels) >= 2, what="the cancels of x1 and x3")
        assert sorted(p.cancels) == [("x1", gone), ("x3", gone)]  # the router cancelled them
        assert [r.generate(f"y{i}", list(range(30))).state for i in range(3)] == ["success"] * 3
        ds[1] = back = SpyDecode(configs[1], SyntheticDecoder(MLA))
        back.orders = []
        ds[1].start()
        assert r.refresh() == ["d1"]  # back up (new incarnation): re-paired
        assert [r.generate(f"z{i}", list(range(30))).state for i in range(2)] == ["success"] * 2
        assert ds[1].timeline.events("z0") or ds[1].timeline.events("z1")  # d1 serves again
        assert "x1" not in back.orders and "x3" not in back.orders  # failed: never delivered
        check_balanced(r)
    finally:
        r.close()
        p.close()
        for d in ds:
            d.close()


class FakeWorker:
    """An order server that answers info queries as ``role`` (but the first ``mute`` ones),
    stats when ``stats`` is set and pairings when ``pairs`` is, acks prefill orders and leaves
    everything else unanswered."""

    def __init__(
        self,
        role: str,
        *,
        stats: bool = False,
        pairs: bool = True,
        mute: int = 0,
        bind: str = "tcp://127.0.0.1:0",
    ) -> None:
        self.role, self.stats, self.pairs, self.mute = role, stats, pairs, mute
        self.seen: list[str] = []
        self.server = RpcServer(bind, self.handle)
        self.address = self.server.address
        self.server.start()

    def handle(self, msg: AnyMessage, reply: Reply) -> None:
        self.seen.append(type(msg).__name__)
        if isinstance(msg, InfoQuery) and self.seen.count("InfoQuery") <= self.mute:
            pass
        elif isinstance(msg, InfoQuery):
            reply(
                WorkerInfo(
                    role=self.role, peer_id=self.role, pd_address="tcp://127.0.0.1:1",
                    incarnation=1, transport="tcp",
                )
            )  # fmt: skip
        elif isinstance(msg, StatsQuery) and self.stats:
            reply(
                WorkerStats(
                    peer_id=self.role, counters={}, used_blocks=0, used_slots=0,
                    sessions_live=0, requests_live=0,
                )
            )  # fmt: skip
        elif isinstance(msg, PrefillOrder) or (isinstance(msg, PairWith) and self.pairs):
            reply(Ack(detail="accepted"))

    def close(self) -> None:
        self.server.close()


def test_refreshes_keep_one_probe_per_dead_worker() -> None:
    # a dead worker's unanswered probe is waited for again, never sent again: nothing piles
    # up for it, and a worker that starts at its address later gets one query, not a backlog
    # (timeout_s is far longer than the test, so no query is resent for being old: on a busy
    # machine a first connection and its reply can take longer than 200 refreshes of 1 ms)
    addr = f"tcp://127.0.0.1:{free_port()}"
    alive = FakeWorker("decode")
    r = Router([addr], [alive.address], timeout_s=30.0, probe_s=0.001)
    back = None
    try:
        for _ in range(200):
            r.refresh()
        wait_for(lambda: (r.refresh(), r.decode[0].up)[1], what="decode up")
        assert not r.prefill[0].up
        back = FakeWorker("prefill", bind=addr)

        def back_up() -> bool:
            with contextlib.suppress(ProtocolError):  # a pairing slower than probe_s: retried
                r.refresh()
            return r.prefill[0].up

        wait_for(back_up, what="prefill back up")
        time.sleep(0.2)
        assert back.seen.count("InfoQuery") == 1, back.seen
    finally:
        r.close()
        alive.close()
        if back is not None:
            back.close()


def test_a_deadline_is_not_held_up_by_a_pairing() -> None:
    # the decode worker never answers PairWith: each refresh tries to pair it again
    p, d = FakeWorker("prefill"), FakeWorker("decode", pairs=False)
    r = Router([p.address], [d.address], timeout_s=5.0, deadline_s=0.3, refresh_s=0.1, probe_s=0.2)
    try:
        with pytest.raises(ProtocolError, match=r"cannot pair: no answer within 0\.2 s"):
            r.connect()
        start = time.monotonic()
        res = r.submit("x", [1, 2, 3]).result(timeout=10)
        assert time.monotonic() - start < 1.5
        assert (res.state, res.reason) == (
            "failed",
            "no answer within the request deadline (0.3 s)",
        )
        assert d.seen.count("PairWith") == 1  # still outstanding: waited for, not resent
    finally:
        r.close()
        p.close()
        d.close()


def test_stats_do_not_wait_for_a_worker_that_is_down() -> None:
    p, d = FakeWorker("prefill", stats=True), FakeWorker("decode", stats=True)
    dead = f"tcp://127.0.0.1:{free_port()}"
    r = Router([p.address], [d.address, dead], timeout_s=3.0, probe_s=0.2)
    try:
        r.connect()
        assert r.worker_counts() == (2, 1)
        start = time.monotonic()
        got, missing = r.gather_stats()
        assert time.monotonic() - start < 1.0
        assert sorted(got) == ["decode", "prefill"] and missing == [f"{dead} (down)"]
        with pytest.raises(TransferTimeoutError, match="down"):
            r.stats()
    finally:
        r.close()
        p.close()
        d.close()


def test_a_probe_a_worker_took_and_never_answered_is_sent_again_after_timeout_s() -> None:
    p, d = FakeWorker("prefill"), FakeWorker("decode", mute=1)  # as if it died after taking one
    r = Router([p.address], [d.address], timeout_s=0.5, probe_s=0.05)
    try:
        start = time.monotonic()
        wait_for(lambda: r.refresh() is not None and r.ready(), timeout_s=5, what="decode up")
        assert 0.4 <= time.monotonic() - start < 3.0
        assert d.seen.count("InfoQuery") == 2  # the lost one, then one fresh after timeout_s
    finally:
        r.close()
        p.close()
        d.close()


def test_close_ends_a_refresh_stuck_on_a_dead_worker_at_once_and_leaks_nothing() -> None:
    # probe_s is a minute: a close that waited for the stuck refresh would take that long
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    r = Router([p.address], [d.address], timeout_s=120.0, probe_s=60.0)
    service = RouterService(r, "tcp://127.0.0.1:0")
    replies: list[AnyMessage] = []
    try:
        r.connect()
        p.mute = 10**9  # the prefill worker stops answering: a refresh waits on it
        t = threading.Thread(target=r.refresh)  # as the refresh thread runs it
        t.start()

        def refresh() -> None:
            r.refresh()

        service._off_thread(refresh, replies.append)  # and as a service helper
        wait_for(lambda: p.seen.count("InfoQuery") == 2, what="the refresh waits on prefill")

        def close_both() -> None:  # as serve router does
            r.close()
            service.close()

        closing = threading.Thread(target=close_both)
        closing.start()
        closing.join(timeout=30.0)  # a liveness bound: half the probe a stuck close waits out
        assert not closing.is_alive()
        t.join()
        assert replies == []
        client = r.prefill[0].client
        assert client._closed and not client._thread.is_alive()
        left = [x.name for x in threading.enumerate() if x.name.startswith("kvplane-router")]
        assert left == []
        r.close()  # idempotent
    finally:
        p.close()
        d.close()
