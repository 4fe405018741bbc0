"""Router edge cases: refusals fail the request on both sides; configs are validated."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
from pd_testlib import FAST, check_balanced, cluster

from kvplane.cli import build_parser, main
from kvplane.errors import ConfigError, InvalidArgumentError, ProtocolError
from kvplane.runtime import serve
from kvplane.runtime.messages import DecodeOrder, ErrorReply
from kvplane.runtime.router import Router
from kvplane.runtime.worker_config import WorkerConfig


def test_a_refused_order_fails_the_request_and_frees_both_sides() -> None:
    # the prefill side never hears from a receiver, so its session ends at its own deadline
    quick = replace(FAST, deadline_s=0.5, verdict_grace_s=0.3)
    c = cluster(decode={"num_blocks": 4}, timings=quick)
    try:
        res = c.router.generate("big", list(range(200)))  # needs 13 decode blocks of 16
        assert res.state == "failed" and "needs 13 blocks" in res.reason
        assert c.router.generate("small", list(range(20))).state == "success"
        check_balanced(c.router)
    finally:
        c.close()


def test_decode_refuses_an_unpaired_prefill_peer() -> None:
    c = cluster()
    try:
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
    finally:
        c.close()


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
    finally:
        r.close()


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
