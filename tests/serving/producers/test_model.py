"""Real models across PD workers (threads, real tcp sockets): exact single-process tokens.

A prefill worker runs the tiny model's chunked prefill and offloads every prompt's chunks to a
3-chunk host tier over a disk tier; a decode worker continues greedy decoding from the received
KV. Every request must give exactly ``model.generate``'s tokens (and, for a transformers Bamba
checkpoint, ``transformers``' greedy tokens); a repeated shared prefix must come back from the
offload tiers (from host AND disk; for the hybrid with its recurrent state), and every test ends
with the pools, the ledgers and the offload slots balanced.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvplane.errors import ConfigError, InvalidArgumentError, UnsupportedError
from kvplane.ids import RequestId, TokenRange
from kvplane.models import PagedDecoder
from kvplane.offload import OffloadConfig
from kvplane.pd.handshake import Placement
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.prefix_offload import PrefixSettings
from kvplane.serving.producers.base import PoolTensor, ProduceStep
from kvplane.serving.producers.model import ModelDecoder, ModelProducer, ModelSpec
from kvplane.serving.producers.rank import RankProducer
from kvplane.serving.router.router import Router
from kvplane.serving.worker_config import WorkerConfig
from kvplane.testing.cluster import FAST, TEST_SECRET, check_balanced, wait_for
from kvplane.testing.reference import save_tiny_bamba

STEP = 16
NEW = 6


@dataclass
class ModelCluster:
    prefill: PrefillWorker
    decode: DecodeWorker
    router: Router
    model: PagedDecoder

    def close(self) -> None:
        self.router.close()
        self.prefill.close()
        self.decode.close()

    def reference(self, tokens: list[int]) -> tuple[int, ...]:
        return self.model.generate(tokens, NEW, STEP, block_size=16).tokens


def model_cluster(name: str, disk: Path, *, host_slots: int = 3) -> ModelCluster:
    spec = ModelSpec(name, seed=3)
    base = WorkerConfig(
        name="prefill", num_blocks=48, block_size=16, num_slots=8, step_size=STEP,
        timings=FAST, slice_timeout_s=5.0, secret=TEST_SECRET,
    )  # fmt: skip
    offload = OffloadConfig(
        host_slots=host_slots, disk_path=disk, disk_slots=16, disk_direct_io=False,
        pin_memory=False,
    )  # fmt: skip
    p = PrefillWorker(base, ModelProducer.from_spec(spec), offload=PrefixSettings(offload, 2))
    d = DecodeWorker(
        WorkerConfig(
            name="decode", num_blocks=48, block_size=8, num_slots=8, timings=FAST,
            slice_timeout_s=5.0, secret=TEST_SECRET,
        ),
        ModelDecoder.from_spec(spec),
    )  # fmt: skip
    p.start()
    d.start()
    r = Router([p.address], [d.address], timeout_s=30.0, secret=TEST_SECRET)
    r.connect()
    return ModelCluster(p, d, r, spec.load())


@pytest.fixture(params=["tiny-llama", "tiny-deepseek", "tiny-hybrid"])
def mc(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ModelCluster]:
    c = model_cluster(request.param, tmp_path / "disk")
    yield c
    c.close()


def offload_idle(c: ModelCluster) -> bool:
    off = c.prefill.offload
    return off is not None and not off.busy


def test_pd_offloaded_pipelined_tokens_match_one_process(mc: ModelCluster) -> None:
    rng = np.random.default_rng(7)
    shared = [int(t) for t in rng.integers(0, 1024, 96)]  # 3 chunks of 32 tokens
    other = [int(t) for t in rng.integers(0, 1024, 70)]  # 2 chunks: evicts 2 of the 3
    prompts = [
        [*shared, 5, 6, 7, 8, 9],
        other,
        [*shared, 11, 12, 13],  # prefix: 1 chunk from host, 2 from disk
        [int(t) for t in rng.integers(0, 1024, 9)],  # no full chunk
    ]
    for i, tokens in enumerate(prompts):
        res = mc.router.generate(f"r{i}", tokens, max_new_tokens=NEW)
        assert res.state == "success", res.reason
        assert res.tokens == mc.reference(tokens), f"request r{i}"
        wait_for(lambda: offload_idle(mc), what="offload idle")
    off = mc.prefill.offload
    assert off is not None
    assert dict(off.hits) == {"host": 1, "disk": 2}
    stats = check_balanced(mc.router)
    counters = stats["prefill"].counters
    assert counters["offload_hit_chunks_host"] == 1
    assert counters["offload_hit_chunks_disk"] == 2
    assert counters["offload_chunks_stored"] == 3 + 2  # r2's chunks are back in host: held
    assert counters["attention_plans"] > 0
    assert stats["decode"].counters["attention_plans"] > 0
    assert counters["pd_bytes_moved"] >= counters["pd_logical_bytes"] > 0


def test_bad_prompts_fail_clearly_and_leave_nothing_behind(tmp_path: Path) -> None:
    c = model_cluster("tiny-llama", tmp_path / "disk")
    try:
        res = c.router.generate("oov", [1, 2, 5000], max_new_tokens=2)
        assert res.state == "failed"
        assert "token id 5000 at position 2 is outside the vocabulary [0, 1024)" in res.reason
        long = c.router.generate("long", list(range(48 * 16 + 1)), max_new_tokens=2)
        assert long.state == "failed"
        assert "needs 97 blocks; the pool has 48" in long.reason  # decode blocks of 8
        ok = c.router.generate("ok", [1, 2, 3], max_new_tokens=NEW)
        assert ok.tokens == c.reference([1, 2, 3])
        check_balanced(c.router)
    finally:
        c.close()


def test_model_spec_and_adapter_refuse_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="seed"):
        ModelSpec("tiny-llama", seed=-1)
    with pytest.raises(ConfigError, match="dtype"):
        ModelSpec("tiny-llama", dtype="int8")
    producer = ModelProducer.from_spec(ModelSpec("tiny-llama"))
    with pytest.raises(ConfigError, match="TP head range"):
        producer.kv_layout(4, 16, (0, 1))
    with pytest.raises(InvalidArgumentError, match="token id -1 at position 1"):
        producer.check_prompt(np.array([3, -1]))
    assert producer.model_id == "tiny-llama-seed0-float32"
    assert ModelSpec("tiny-llama", seed=1).identity() != producer.model_id


def test_a_hybrid_serves_its_state_from_the_state_pool_and_splits_it_at_tp_ranks() -> None:
    """tiny-hybrid: the paged pool holds its one attention layer, the state pool its three
    Mamba2 layers (float32 conv + SSM rows); a step without the state pool is refused; a TP
    rank's rows are its part of each row (stages and ranks: test_rank_hybrid*.py)."""
    spec = ModelSpec("tiny-hybrid")
    producer = ModelProducer.from_spec(spec)
    assert producer.kv_layout(4, 16).layer_ids == (1,)
    state = producer.state_layout(3)
    assert state is not None and state.whole_only
    assert (state.layer_ids, state.head_dim, state.num_blocks) == ((0, 2, 3), 288 * 3 + 4096, 3)
    assert ModelProducer.from_spec(ModelSpec("tiny-llama")).state_layout(3) is None
    kv = PoolTensor(producer.kv_layout(4, 16), producer.kv_layout(4, 16).allocate())
    step = ProduceStep(RequestId("r"), np.arange(5), (0,), TokenRange(0, 5), True, None)
    with pytest.raises(UnsupportedError, match="needs the worker's state pool"):
        producer.produce(step, kv, None)
    rank = RankProducer.for_rank(spec, Placement(tp_size=2, tp_rank=1)).state_layout(3)
    assert rank is not None  # x 4 heads x 32 x 3, B and C 16 x 3 each, SSM 4 heads x 32 x 16
    assert (rank.head_dim, rank.row_dim) == (288 * 3 + 4096, 384 + 96 + 2048)


def test_pd_of_a_transformers_bamba_checkpoint_gives_transformers_tokens(tmp_path: Path) -> None:
    """A random-init ``BambaForCausalLM`` saved by transformers, served across the workers
    with prefix offload: exactly ``hf.generate``'s greedy tokens, a shared prefix's second
    request included (its KV and Mamba2 state loaded, not computed)."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = save_tiny_bamba(tmp_path / "ckpt", 11)
    c = model_cluster(str(tmp_path / "ckpt"), tmp_path / "disk")
    try:
        rng = np.random.default_rng(1)
        shared = [int(t) for t in rng.integers(0, 128, 64)]
        for i, tail in enumerate(([3, 4, 5], [9, 8])):
            tokens = [*shared, *tail]
            ids = torch.tensor([tokens])
            with torch.no_grad():
                want = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                    do_sample=False, eos_token_id=None, pad_token_id=0,
                )[0, len(tokens) :].tolist()  # fmt: skip
            res = c.router.generate(f"h{i}", tokens, max_new_tokens=NEW)
            assert res.state == "success", res.reason
            assert list(res.tokens) == want, f"request h{i}"
            wait_for(lambda: offload_idle(c), what="offload idle")
        off = c.prefill.offload
        assert off is not None and dict(off.hits) == {"host": 2}
        check_balanced(c.router)
    finally:
        c.close()
