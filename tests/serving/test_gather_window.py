"""A model mixing window and full layers through a pipeline-parallel gather (threads, real
sockets): two prefill stages of a tiny transformers Qwen2 (layers sliding, full | sliding;
window 8) feed one decode worker with the one-process tokens, each stage moving, per window
group of its own layers, only what the decode side reads; the same into a decode worker serving
one paged pool per KV cache group (``--kv-groups on``): the handshake pairs each stage's one
pool with the groups by layers, and the bytes moved are the same (#33)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import RequestResult
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.model import ModelSpec
from kvplane.serving.worker import Worker
from kvplane.testing.cluster import wait_for
from kvplane.testing.gather_run import run_gather, start_gather
from qwen2_testlib import WINDOW

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

NEW, N = 5, 40
CELL = 2 * 2 * 16 * 4
"""One position of one layer: K,V x 2 KV heads x head_dim 16 x float32."""
TAIL_BYTES = 32


@pytest.fixture
def checkpoint(mixed_qwen2: Any) -> Path:
    """The session's mixed Qwen2 (``qwen2_testlib``: sliding, full, sliding; window 8)."""
    path: Path = mixed_qwen2.path
    return path


def _argv(model: str | Path, *argv: str) -> tuple[str, ...]:
    return (*argv, "--model", str(model), "--num-blocks", "16", "--num-slots", "4", "--insecure",
            "--step-size", "16")  # fmt: skip


def _idle(w: Worker) -> bool:
    stats = w.stats()
    return stats.used_blocks == 0 and stats.sessions_live == 0


@pytest.fixture(params=["off", "on"], ids=["one-pool", "kv-groups"])
def stages(
    request: pytest.FixtureRequest, checkpoint: Path
) -> Iterator[tuple[list[PrefillWorker], DecodeWorker]]:
    with ExitStack() as stack:
        ranks = [_argv(checkpoint, "prefill", "--name", f"p{s}", "--pp-stage", str(s),
                       "--pp-size", "2", "--kv-groups", request.param)
                 for s in (0, 1)]  # fmt: skip
        decode = _argv(checkpoint, "decode", "--name", "d", "--kv-groups", request.param)
        ranks_, d = start_gather(stack, ranks, decode)
        assert d.pools.num_kv_pools == (2 if request.param == "on" else 1)
        yield ranks_, d


def test_two_stages_move_only_their_groups_windows(
    checkpoint: Path, stages: tuple[list[PrefillWorker], DecodeWorker]
) -> None:
    ranks, d = stages
    assert [w.pools.num_kv_pools for w in ranks] == [1, 1]  # a rank keeps one pool of its layers
    assert ranks[0].pools.kv.layout.layer_ids == (0, 1)
    assert ranks[1].pools.kv.layout.layer_windows == (WINDOW, None, WINDOW)
    grouped = d.pools.num_kv_pools == 2
    assert [p.layout.layer_ids for p in d.pools.kv.pools] == ([(0, 2), (1,)] if grouped
                                                               else [(0, 1, 2)])  # fmt: skip
    prompt = tuple(int(t) for t in np.random.default_rng(N).integers(0, 128, N))
    res = run_gather(ranks, d, prompt, NEW)
    assert isinstance(res, RequestResult)
    assert (res.state, res.reason) == ("success", "")
    model = ModelSpec(str(checkpoint)).load()
    assert list(res.tokens) == list(model.generate(list(prompt), NEW, 16, block_size=16).tokens)
    workers: list[Worker] = [*ranks, d]
    for w in workers:
        wait_for(functools.partial(_idle, w), what=f"{w.config.name} idle")
        assert w.stats().integrity == ""
    moved = [w.stats().counters["pd_bytes_moved"] for w in ranks]
    # stage 0: layer 0's window and all of full layer 1; stage 1: layer 2's window + the tail
    # (the step at N reads (N - WINDOW, N]: WINDOW - 1 prompt positions of a window layer)
    assert moved == [(WINDOW - 1 + N) * CELL, (WINDOW - 1) * CELL + TAIL_BYTES]
