"""A TP × PP rank producer: its pool is byte for byte the head × layer slice of the
one-process producer's pool (chunked prefill, two requests), and it refuses what it cannot do."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch

from kvplane.errors import ConfigError, UnsupportedError
from kvplane.ids import RequestId, TokenRange
from kvplane.pd.handshake import Placement
from kvplane.serving.producers.base import PoolTensor, ProduceStep
from kvplane.serving.producers.model import ModelProducer, ModelSpec
from kvplane.serving.producers.rank import RankProducer

BLOCKS, BS, STEP = 12, 16, 24
PROMPTS = {"a": 40, "b": 57}  # tokens; "a" in blocks 0.., "b" in blocks 6..


@cache
def full_pool(name: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The one-process producer's pool after both prompts, and each prompt's first token."""
    producer = ModelProducer.from_spec(ModelSpec(name, seed=3))
    kv = PoolTensor(producer.kv_layout(BLOCKS, BS), producer.kv_layout(BLOCKS, BS).allocate())
    return kv.tensor, tuple(run(producer, kv))


def run(producer: ModelProducer, kv: PoolTensor) -> list[int]:
    """Both prompts interleaved step by step; returns their first tokens."""
    firsts: list[int] = []
    rng = np.random.default_rng(7)
    jobs = [
        (RequestId(r), rng.integers(0, 100, n), 6 * i) for i, (r, n) in enumerate(PROMPTS.items())
    ]
    for start in range(0, max(PROMPTS.values()), STEP):
        for rid, ids, first_block in jobs:
            if start >= ids.size:
                continue
            end = min(start + STEP, ids.size)
            blocks = tuple(range(first_block, first_block + -(-ids.size // BS)))
            step = ProduceStep(rid, ids, blocks, TokenRange(start, end), is_last=end == ids.size)
            out = producer.produce(step, kv, None)
            if out.first_token is not None:
                firsts.append(out.first_token)
    return firsts


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek"])
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_a_rank_pool_is_the_head_and_layer_slice_of_the_full_pool(
    name: str, tp: int, pp: int
) -> None:
    full, firsts = full_pool(name)
    for stage in range(pp):
        for tp_rank in range(tp):
            at = Placement(tp_rank=tp_rank, tp_size=tp, pp_stage=stage, pp_size=pp)
            producer = RankProducer.for_rank(ModelSpec(name, seed=3), at)
            layout = producer.kv_layout(BLOCKS, BS)
            assert layout.layer_ids == ((0, 1) if pp == 1 else ((stage,)))
            kv = PoolTensor(layout, layout.allocate())
            assert tuple(run(producer, kv)) == firsts
            lo, hi = layout.head_range
            want = full[:, list(layout.layer_ids), :, :, lo:hi]  # BLOCK, LAYER, COMP, TOKEN, HEAD
            assert torch.equal(kv.tensor, want), (at, layout.head_range)


def test_the_heads_of_each_tp_rank() -> None:
    spec = ModelSpec("tiny-llama", seed=3)  # 2 KV heads
    heads = [
        RankProducer.for_rank(spec, Placement(tp_rank=r, tp_size=n)).kv_layout(4, BS).head_range
        for n, r in ((2, 0), (2, 1), (4, 2))
    ]
    assert heads == [(0, 1), (1, 2), (1, 2)]


def test_a_foreign_head_range_and_an_impossible_layout_are_config_errors() -> None:
    spec = ModelSpec("tiny-llama", seed=3)
    producer = RankProducer.for_rank(spec, Placement(tp_rank=1, tp_size=2))
    with pytest.raises(
        ConfigError, match=r"TP rank 1 of 2 holds heads \(1, 2\) of model .*not \(0, 2\)"
    ):
        producer.kv_layout(4, BS, head_range=(0, 2))
    with pytest.raises(ConfigError, match=r"stage 0 of 3 of model .*pp_size must be an int in"):
        RankProducer.for_rank(spec, Placement(pp_size=3))  # 2 layers
    with pytest.raises(ConfigError, match="2 KV heads and TP 3: one must divide the other"):
        RankProducer.for_rank(spec, Placement(tp_size=3))


def test_a_prefix_it_did_not_compute_is_refused_before_any_write() -> None:
    producer = RankProducer.for_rank(ModelSpec("tiny-llama", seed=3), Placement(tp_size=2))
    layout = producer.kv_layout(BLOCKS, BS)
    kv = PoolTensor(layout, layout.allocate())
    ids = np.arange(40) % 50
    kv.tensor[0, :, :, 3] = 1.0  # a "loaded" prefix the shadow never saw
    before = kv.tensor.clone()
    step = ProduceStep(RequestId("late"), ids, (0, 1, 2), TokenRange(16, 40), is_last=True)
    with pytest.raises(UnsupportedError, match=r"the KV of \[0, 16\) in the rank pool was not"):
        producer.produce(step, kv, None)
    assert torch.equal(kv.tensor, before)


def test_a_prefix_it_computed_itself_is_reused() -> None:
    """A device prefix hit: a second request starts after blocks this producer filled."""
    spec = ModelSpec("tiny-llama", seed=3)
    producer = RankProducer.for_rank(spec, Placement(tp_rank=1, tp_size=2))
    layout = producer.kv_layout(BLOCKS, BS)
    kv = PoolTensor(layout, layout.allocate())
    ids = np.arange(40) % 50
    first = ProduceStep(RequestId("one"), ids, (0, 1, 2), TokenRange(0, 40), is_last=True)
    token = producer.produce(first, kv, None).first_token
    snapshot = kv.tensor[0].clone()
    second = ProduceStep(RequestId("two"), ids, (0, 3, 4), TokenRange(16, 40), is_last=True)
    assert producer.produce(second, kv, None).first_token == token
    assert torch.equal(kv.tensor[0], snapshot)
    assert torch.equal(kv.tensor[3:5], kv.tensor[1:3])
