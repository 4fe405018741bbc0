"""``kvplane serve prefill --tp-rank r --tp-size n --pp-stage s --pp-size m``: the flags (and
their ``[worker]`` config keys) become a :class:`Placement`, bad ones are one-line
``ConfigError`` s, and a real-model prefill worker of a rank holds its heads × layers."""

from __future__ import annotations

import argparse

import pytest

from kvplane.apps import serve
from kvplane.apps.serve import build_worker, placement_of
from kvplane.apps.serve_config import settle
from kvplane.cli import build_parser
from kvplane.errors import ConfigError
from kvplane.pd.handshake import Placement
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.rank import RankProducer

SMALL = ["--num-blocks", "8", "--num-slots", "2", "--insecure"]


def args(*argv: str, env: dict[str, str] | None = None) -> argparse.Namespace:
    parsed = build_parser().parse_args(["serve", *argv])
    return settle(parsed, env or {})


def test_the_flags_and_the_config_keys_make_a_placement() -> None:
    got = placement_of(
        args("prefill", "--tp-rank", "1", "--tp-size", "2", "--pp-stage", "1", "--pp-size", "2")
    )
    assert got == Placement(tp_rank=1, tp_size=2, pp_stage=1, pp_size=2)
    env = {"KVPLANE_WORKER_TP_SIZE": "4", "KVPLANE_WORKER_TP_RANK": "3"}
    assert placement_of(args("prefill", env=env)) == Placement(tp_rank=3, tp_size=4)
    assert placement_of(args("prefill")) == Placement()
    assert placement_of(args("decode")) == Placement()  # a decode worker is one process


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--tp-rank", "2", "--tp-size", "2"],
            "--tp-rank 2 --tp-size 2 --pp-stage 0 --pp-size 1: Placement.tp_rank must be an "
            "int in [0, 1], got 2",
        ),
        (
            ["--pp-stage", "1"],
            "--tp-rank 0 --tp-size 1 --pp-stage 1 --pp-size 1: Placement.pp_stage must be an "
            "int in [0, 0], got 1",
        ),
        (
            ["--tp-size", "0"],
            "--tp-rank 0 --tp-size 0 --pp-stage 0 --pp-size 1: Placement.tp_size must be a "
            "positive int, got 0",
        ),
    ],
)
def test_a_bad_placement_is_one_config_error(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        placement_of(args("prefill", *argv))
    assert str(info.value) == message


def test_the_rank_flags_belong_to_prefill_workers_only() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "decode", "--tp-size", "2"])


def test_a_real_model_rank_holds_its_heads_and_stage_layers() -> None:
    a = args("prefill", *SMALL, "--model", "tiny-llama", "--tp-rank", "1", "--tp-size", "2",
             "--pp-stage", "1", "--pp-size", "2")  # fmt: skip
    worker = build_worker(a)
    try:
        assert isinstance(worker, PrefillWorker)
        assert isinstance(worker.producer, RankProducer)
        layout = worker.pools.kv.layout
        assert (layout.head_range, layout.layer_ids) == ((1, 2), (1,))
        info = worker.info()  # what the router learns today: the heads and layers it holds
        assert (info.head_ranges[0], info.layer_ids) == ((1, 2), (1,))
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp-size", "2"], "--tp-size/--pp-size above 1 need --model"),
        (
            ["--model", "tiny-llama", "--tp-rank", "1", "--tp-size", "2", "--head-range", "0:2"],
            r"TP rank 1 of 2 holds heads \(1, 2\) of model tiny-llama-seed0-float32, not \(0, 2\)",
        ),
        (
            ["--model", "tiny-llama", "--pp-stage", "2", "--pp-size", "3"],
            "stage 2 of 3 of model tiny-llama-seed0-float32: pp_size must be",
        ),
    ],
)
def test_a_layout_the_model_cannot_take_is_refused_before_start(
    argv: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_worker(args("prefill", *SMALL, *argv))


def test_the_memory_check_counts_the_rank_producers_full_shadow_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked: list[int] = []
    monkeypatch.setattr(serve, "check_pool_memory", lambda what, total: checked.append(total))
    worker = build_worker(args("prefill", *SMALL, "--model", "tiny-llama", "--tp-rank", "1",
                               "--tp-size", "2"))  # fmt: skip
    try:
        assert isinstance(worker.producer, RankProducer)
        rank = worker.pools.kv.layout.pool_bytes
        shadow = worker.producer.shadow_bytes(8, worker.pools.kv.layout.block_size)
        assert shadow == 2 * rank  # TP 2: the shadow holds both ranks' heads
        state = worker.pools.state.layout.pool_bytes if worker.pools.state is not None else 0
        assert checked == [rank + state + shadow]
    finally:
        worker.close()
