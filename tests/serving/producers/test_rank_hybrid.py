"""Pipeline stages of a hybrid (Bamba): each stage's KV pool and state pool are byte for byte
its layers of the one-process producer's pools (chunked prefill, two requests); two stage
workers feed one decode worker (threads, real sockets) transformers' greedy tokens, each stage
moving its own layers' KV and Mamba2 state; TP ranks that would replicate KV heads, a stage
without attention layers and a restored state are refused (#33)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.errors import ConfigError, UnsupportedError
from kvplane.ids import RequestId, TokenRange
from kvplane.pd.handshake import Placement
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import RequestResult
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.base import PoolTensor, ProduceStep
from kvplane.serving.producers.model import ModelProducer, ModelSpec
from kvplane.serving.producers.rank import RankProducer
from kvplane.serving.worker import Worker
from kvplane.testing.cluster import idle, wait_for
from kvplane.testing.gather_run import run_gather, start_gather

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

BLOCKS, BS, STEP, SLOTS = 12, 16, 24, 2
PROMPTS = {"a": 40, "b": 57}  # tokens; "a" in blocks 0.. slot 0, "b" in blocks 6.. slot 1


def save_bamba_of_two_stages(path: Path, seed: int, groups: int = 2) -> Any:
    """A random-init transformers Bamba of 4 layers, attention at 1 and 3: two pipeline stages
    of one Mamba + one attention layer each; 2 KV heads; Mamba2 mixers of 8 heads of 16 in
    ``groups`` groups. Returns the model (eval mode)."""
    torch.manual_seed(seed)
    cfg = transformers.BambaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=groups,
        mamba_d_conv=4, mamba_chunk_size=16,
    )  # fmt: skip
    hf = transformers.BambaForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = tmp_path_factory.mktemp("bamba-pp")
    return str(path), save_bamba_of_two_stages(path, 21)


@pytest.fixture
def checkpoint(saved: tuple[str, Any]) -> str:
    return saved[0]


def pools(producer: ModelProducer) -> tuple[PoolTensor, PoolTensor]:
    kv, state = producer.kv_layout(BLOCKS, BS), producer.state_layout(SLOTS)
    assert state is not None
    return PoolTensor(kv, kv.allocate()), PoolTensor(state, state.allocate())


def run(producer: ModelProducer, kv: PoolTensor, state: PoolTensor) -> list[int]:
    """Both prompts interleaved step by step; returns their first tokens."""
    firsts: list[int] = []
    rng = np.random.default_rng(7)
    jobs = [(RequestId(r), rng.integers(0, 128, n), i) for i, (r, n) in enumerate(PROMPTS.items())]
    for start in range(0, max(PROMPTS.values()), STEP):
        for rid, ids, i in jobs:
            if start >= ids.size:
                continue
            end = min(start + STEP, ids.size)
            blocks = tuple(range(6 * i, 6 * i + -(-ids.size // BS)))
            step = ProduceStep(rid, ids, blocks, TokenRange(start, end), is_last=end == ids.size,
                               state_slot=i)  # fmt: skip
            out = producer.produce(step, kv, state)
            if out.first_token is not None:
                firsts.append(out.first_token)
    return firsts


def test_each_stage_holds_its_layers_of_the_kv_and_the_state(checkpoint: str) -> None:
    spec = ModelSpec(checkpoint)
    full = ModelProducer.from_spec(spec)
    full_kv, full_state = pools(full)
    firsts = run(full, full_kv, full_state)
    assert full_state.layout.layer_ids == (0, 2)
    for stage, (kv_layers, state_layers) in enumerate((((1,), (0,)), ((3,), (2,)))):
        producer = RankProducer.for_rank(spec, Placement(pp_stage=stage, pp_size=2))
        kv, state = pools(producer)
        assert (kv.layout.layer_ids, state.layout.layer_ids) == (kv_layers, state_layers)
        assert run(producer, kv, state) == firsts
        at = full_kv.layout.layer_index(kv_layers[0])
        assert torch.equal(kv.tensor, full_kv.tensor[:, at : at + 1])
        layer = state_layers[0]
        want = full_state.layout.state_view(full_state.tensor, layer)
        assert torch.equal(state.layout.state_view(state.tensor, layer), want)


def test_tp_ranks_that_would_replicate_a_hybrids_kv_heads_are_refused_in_one_line() -> None:
    # tiny-hybrid: 2 KV heads; at TP 4 two ranks share each head, and a gather takes one of them
    with pytest.raises(
        ConfigError,
        match=r"^TP 4 of model tiny-hybrid-seed0-float32: its 2 KV heads would be replicated",
    ):
        RankProducer.for_rank(ModelSpec("tiny-hybrid"), Placement(tp_rank=1, tp_size=4))


def test_a_stage_without_an_attention_layer_is_a_config_error() -> None:
    # tiny-hybrid: 4 layers, attention at 1 only; stage 1 holds layers 2 and 3
    with pytest.raises(
        ConfigError, match=r"stage 1 of 2 of .*pipeline stage 1 of 2 holds no attention \(KV\)"
    ):
        RankProducer.for_rank(ModelSpec("tiny-hybrid"), Placement(pp_stage=1, pp_size=2))


def test_a_restored_state_is_refused_before_any_write(checkpoint: str) -> None:
    producer = RankProducer.for_rank(ModelSpec(checkpoint), Placement(pp_stage=0, pp_size=2))
    kv, state = pools(producer)
    ids = np.arange(40) % 100
    first = ProduceStep(RequestId("one"), ids, (0, 1, 2), TokenRange(0, 40), is_last=True,
                        state_slot=0)  # fmt: skip
    producer.produce(first, kv, state)
    before = (kv.tensor.clone(), state.tensor.clone())
    late = ProduceStep(RequestId("two"), ids, (0, 1, 2), TokenRange(32, 40), is_last=True,
                       state_slot=1)  # fmt: skip
    with pytest.raises(UnsupportedError, match=r"cannot resume at 32 from a restored state"):
        producer.produce(late, kv, state)
    assert torch.equal(kv.tensor, before[0]) and torch.equal(state.tensor, before[1])


# -- two stage workers feed one decode worker ------------------------------------------------------
NEW, N = 6, 40


def _argv(model: str | Path, *argv: str) -> tuple[str, ...]:
    return (*argv, "--model", str(model), "--num-blocks", "16", "--num-slots", "4", "--insecure",
            "--step-size", "16")  # fmt: skip


@pytest.fixture
def stages(checkpoint: str) -> Iterator[tuple[list[PrefillWorker], DecodeWorker]]:
    with ExitStack() as stack:
        ranks = [_argv(checkpoint, "prefill", "--name", f"p{s}", "--pp-stage", str(s),
                       "--pp-size", "2") for s in (0, 1)]  # fmt: skip
        yield start_gather(stack, ranks, _argv(checkpoint, "decode", "--name", "d"))


def gather_transformers_tokens(
    hf: Any, ranks: list[PrefillWorker], d: DecodeWorker
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A random ``N``-token prompt through ``ranks`` into ``d``: asserts it succeeds with
    ``hf.generate``'s ``NEW`` greedy tokens and leaves every worker idle and whole; returns the
    prompt and the tokens."""
    prompt = tuple(int(t) for t in np.random.default_rng(N).integers(0, 128, N))
    res = run_gather(ranks, d, prompt, NEW)
    assert isinstance(res, RequestResult)
    assert (res.state, res.reason) == ("success", "")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, N:].tolist()  # fmt: skip
    assert list(res.tokens) == want
    workers: list[Worker] = [*ranks, d]
    for w in workers:
        wait_for(functools.partial(lambda w: idle(w.stats()), w), what=f"{w.config.name} idle")
        assert w.stats().integrity == ""
    return prompt, tuple(res.tokens)


def test_two_stages_feed_one_decoder_transformers_tokens(
    saved: tuple[str, Any], stages: tuple[list[PrefillWorker], DecodeWorker]
) -> None:
    ranks, d = stages
    assert [w.pools.state.layout.layer_ids for w in ranks if w.pools.state] == [(0,), (2,)]
    assert d.pools.state is not None and d.pools.state.layout.layer_ids == (0, 2)
    prompt, tokens = gather_transformers_tokens(saved[1], ranks, d)
    one = ModelSpec(saved[0]).load().generate(list(prompt), NEW, 16, block_size=16).tokens
    assert tokens == tuple(one)
    # each stage: its attention layer's N positions (K, V x 2 heads x 16 x float32) and its
    # Mamba layer's state row; the lead (stage 1) also the 32-byte tail
    row = [w.pools.state.layout.pool_bytes // 4 for w in ranks if w.pools.state]  # 4 slots
    moved = [w.stats().counters["pd_bytes_moved"] for w in ranks]
    assert moved == [N * 256 + row[0], N * 256 + row[1] + 32]
