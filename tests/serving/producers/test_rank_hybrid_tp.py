"""TP ranks of a hybrid (Bamba): each rank's KV pool holds its KV heads and its state pool exactly
its part of every row of the one-process producer's state (its Mamba heads' x channels and SSM
state; the one group's B and C on both ranks); the memory check counts both shadows; two TP
ranks, alone or in each of two pipeline stages, feed one decode worker (threads, real sockets)
transformers' greedy tokens, each moving its part of the rows, rank 0 the shared group (#33)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import torch

from kvplane.pd.handshake import Placement
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.model import ModelProducer, ModelSpec
from kvplane.serving.producers.rank import RankProducer
from kvplane.testing.gather_run import start_gather

from .test_rank_hybrid import (
    BLOCKS,
    BS,
    SLOTS,
    N,
    _argv,
    gather_transformers_tokens,
    pools,
    run,
    save_bamba_of_two_stages,
)

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# Mamba: H=8 heads of P=16, one group of N=16, K=4: a row is x [0, 384), B [384, 432),
# C [432, 480), SSM [480, 2528); TP rank r holds heads [4r, 4r + 4) and the one group
PARTS = {0: [(0, 192), (384, 432), (432, 480), (480, 1504)],
         1: [(192, 384), (384, 432), (432, 480), (1504, 2528)]}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = tmp_path_factory.mktemp("bamba-tp")
    return str(path), save_bamba_of_two_stages(path, 33, groups=1)


def test_each_tp_rank_holds_its_heads_and_its_part_of_each_state_row(
    saved: tuple[str, Any],
) -> None:
    spec = ModelSpec(saved[0])
    full = ModelProducer.from_spec(spec)
    full_kv, full_state = pools(full)
    firsts = run(full, full_kv, full_state)
    assert full_state.layout.head_dim == 2528
    canonical = full_kv.layout.canonical_view(full_kv.tensor)
    for r in (0, 1):
        producer = RankProducer.for_rank(spec, Placement(tp_rank=r, tp_size=2))
        kv, state = pools(producer)
        assert (kv.layout.head_range, state.layout.row_dim) == ((r, r + 1), 1312)
        assert run(producer, kv, state) == firsts
        assert torch.equal(kv.layout.canonical_view(kv.tensor), canonical[..., r : r + 1, :])
        part = torch.cat([torch.arange(a, b) for a, b in PARTS[r]])
        for layer in (0, 2):
            want = full_state.layout.state_view(full_state.tensor, layer)[:, part]
            assert torch.equal(state.layout.state_view(state.tensor, layer), want)


def test_the_shadow_bytes_count_the_full_kv_and_the_full_state(saved: tuple[str, Any]) -> None:
    producer = RankProducer.for_rank(ModelSpec(saved[0]), Placement(tp_rank=1, tp_size=2))
    kv = BLOCKS * BS * 2 * 2 * 2 * 16 * 4  # blocks x tokens x layers x K,V x heads x dim x fp32
    state = SLOTS * 2 * 2528 * 4  # slots x Mamba layers x whole row x fp32
    assert (kv, state) == (98304, 40448)
    assert producer.shadow_bytes(BLOCKS, BS, SLOTS) == kv + state
    assert producer.shadow_bytes(BLOCKS, BS) == kv


# -- TP ranks (and pipeline stages) feed one decode worker ---------------------------------------
# per rank: N positions of its stages' attention layers (K, V x 1 head x 16 x fp32: 128 bytes a
# layer) and its part of its stages' Mamba rows x fp32 (rank 0: 192 + 48 + 48 + 1024 elements,
# the group included; rank 1: 192 + 1024); the lead (last stage, rank 0) also the 32-byte tail
MOVED = {
    1: [N * 256 + 2 * 1312 * 4 + 32, N * 256 + 2 * 1216 * 4],
    2: [N * 128 + 1312 * 4, N * 128 + 1216 * 4, N * 128 + 1312 * 4 + 32, N * 128 + 1216 * 4],
}


@pytest.fixture(params=[1, 2], ids=["tp2", "pp2xtp2"])
def ranks(
    saved: tuple[str, Any], request: pytest.FixtureRequest
) -> Iterator[tuple[int, list[PrefillWorker], DecodeWorker]]:
    pp = request.param
    with ExitStack() as stack:
        argv = [_argv(saved[0], "prefill", "--name", f"p{s}{r}", "--tp-rank", str(r),
                      "--tp-size", "2", "--pp-stage", str(s), "--pp-size", str(pp))
                for s in range(pp) for r in (0, 1)]  # fmt: skip
        yield pp, *start_gather(stack, argv, _argv(saved[0], "decode", "--name", "d"))


def test_tp_ranks_feed_one_decoder_transformers_tokens(
    saved: tuple[str, Any], ranks: tuple[int, list[PrefillWorker], DecodeWorker]
) -> None:
    pp, prefill, d = ranks
    states = [w.pools.state.layout for w in prefill if w.pools.state]
    assert [s.row_dim for s in states] == [1312] * 2 * pp
    assert [s.layer_ids for s in states] == ([(0, 2)] * 2 if pp == 1 else [(0,), (0,), (2,), (2,)])
    assert d.pools.state is not None and d.pools.state.layout.row_dim == 2528
    gather_transformers_tokens(saved[1], prefill, d)
    assert [w.stats().counters["pd_bytes_moved"] for w in prefill] == MOVED[pp]
