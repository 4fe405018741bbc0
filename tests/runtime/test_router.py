"""Router edge cases: refusals fail the request on both sides; configs are validated; request
ids are unique in flight; cancels are keyed by session; deadlines; workers going down and up."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np
import pytest
from pd_testlib import FAST, MLA, check_balanced, cluster, free_port, prompt, wait_for

from kvplane.cli import build_parser, main
from kvplane.errors import ConfigError, InvalidArgumentError, ProtocolError
from kvplane.runtime import serve
from kvplane.runtime.decode_worker import DecodeWorker
from kvplane.runtime.messages import Ack, CancelOrder, DecodeOrder, ErrorReply
from kvplane.runtime.prefill_worker import PrefillWorker
from kvplane.runtime.router import Router
from kvplane.runtime.synthetic_model import SyntheticDecoder, SyntheticProducer
from kvplane.runtime.worker_config import WorkerConfig


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
        ]
    )
    config = serve.config_of(args)
    assert (config.block_size, config.head_range, config.transport) == (8, (0, 2), "tcp")
    assert config.pd_bind.startswith("tcp://127.0.0.1:")
    assert serve.spec_of(args).sliding_window == 64
    assert serve.faults_of(args) is None
    bad = parser.parse_args(["serve", "prefill", "--head-range", "x"])
    with pytest.raises(ConfigError, match="START:END"):
        serve.config_of(bad)
    assert serve.run(argparse.Namespace()) == 2
    assert main(["serve", "prefill", "--num-blocks", "0"]) == 1


def test_a_duplicate_request_id_is_refused_before_anything_is_sent() -> None:
    with cluster(replace(MLA, compute_s_per_step=0.05)) as c:
        rng = np.random.default_rng(0)
        first = c.router.submit("req", prompt(rng, 200), step_size=32)
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
        fut = c.router.submit("req", list(range(200)), step_size=32)
        wait_for(lambda: "req" in c.prefill._requests and "req" in c.decode._requests)
        stray = CancelOrder(request_id="req", reason="stray", session_id="req/other.0")
        for w in (c.router.prefill[0], c.router.decode[0]):
            assert w.client.call(stray) == Ack(detail="unknown request")
        res = fut.result(timeout=15)
        assert (res.state, res.mismatches) == ("success", 0)
        check_balanced(c.router)


def test_a_request_past_its_deadline_fails_and_is_cancelled_on_both_sides() -> None:
    c = cluster(replace(MLA, compute_s_per_step=0.2))  # 13 steps: ~2.6 s of prefill
    r = Router([c.prefill.address], [c.decode.address], timeout_s=5.0, deadline_s=0.5)
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
    finally:
        r.close()
        c.close()


def test_an_unreachable_worker_is_marked_down_and_comes_back() -> None:
    base = WorkerConfig(
        name="prefill", num_blocks=64, block_size=16, num_slots=16, step_size=32, timings=FAST
    )
    p = PrefillWorker(base, SyntheticProducer(MLA))
    bind = f"tcp://127.0.0.1:{free_port()}"
    configs = [replace(base, name="d0"), replace(base, name="d1", control_bind=bind)]
    ds = [DecodeWorker(cfg, SyntheticDecoder(MLA)) for cfg in configs]
    for w in (p, *ds):
        w.start()
    r = Router([p.address], [d.address for d in ds], timeout_s=3.0, probe_s=0.3)
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
        assert [r.generate(f"y{i}", list(range(30))).state for i in range(3)] == ["success"] * 3
        ds[1] = DecodeWorker(configs[1], SyntheticDecoder(MLA))
        ds[1].start()
        assert r.refresh() == ["d1"]  # back up (new incarnation): re-paired
        assert [r.generate(f"z{i}", list(range(30))).state for i in range(2)] == ["success"] * 2
        assert ds[1].timeline.events("z0") or ds[1].timeline.events("z1")  # d1 serves again
        check_balanced(r)
    finally:
        r.close()
        p.close()
        for d in ds:
            d.close()
