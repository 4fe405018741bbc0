"""LlamaModel over paged GQA KV: a dense oracle, chunked prefill, batching, layouts,
backends and bad input (which leaves the pool untouched)."""

from __future__ import annotations

import pytest
import torch
from models_testlib import dense_llama_logits, paged_prefill, random_model, small_llama

from kvplane.attention import Selector, default_registry
from kvplane.blocks import BlockHasher, BlockTable
from kvplane.errors import InvalidArgumentError, UnsupportedError
from kvplane.ids import RequestId, TokenRange
from kvplane.layout import HEAD_MAJOR, LAYER_MAJOR, KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.models import LlamaModel, PagedKVCache, StepBatch, StepRequest

TOKENS = [3, 91, 14, 15, 92, 65, 35, 89, 79, 32, 38]
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize(
    "config",
    [
        small_llama(),
        small_llama(num_kv_heads=4),  # MHA
        small_llama(num_kv_heads=1, num_heads=6, head_dim=6, attention_bias=True, mlp_bias=True),
        small_llama(tie_word_embeddings=True, num_layers=3),
    ],
)
def test_one_shot_prefill_matches_the_dense_oracle(config: object) -> None:
    model = random_model(config)
    logits, table, pool, _ = paged_prefill(model, TOKENS, [len(TOKENS)])
    torch.testing.assert_close(logits, dense_llama_logits(model, TOKENS), **TOL)
    table.release(pool)
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize(
    ("steps", "block_size"), [([4, 4, 3], 4), ([1] * 11, 2), ([5, 6], 3), ([2, 9], 16)]
)
def test_chunked_prefill_matches_one_shot(steps: list[int], block_size: int) -> None:
    model = random_model(small_llama(), seed=1)
    want = dense_llama_logits(model, TOKENS)
    got, table, pool, kv = paged_prefill(model, TOKENS, steps, block_size=block_size, num_blocks=12)
    torch.testing.assert_close(got, want, **TOL)
    # only the request's slots were written
    written = torch.zeros(kv.num_slots, dtype=torch.bool)
    written[table.slot_mapping(TokenRange(0, len(TOKENS)))] = True
    k0, _ = kv.layout.kv_views(kv.pool, 0)
    touched = (k0.reshape(kv.num_slots, -1) != 0).any(dim=1)
    assert torch.equal(touched, written)
    table.release(pool)
    pool.check_integrity()


def test_a_mixed_batch_equals_separate_steps() -> None:
    model = random_model(small_llama(), seed=2)
    kv = model.new_kv_cache(8, 4)
    a, b = TOKENS[:6], TOKENS[4:]
    # request a prefilled [0, 5) first; the batch decodes its token 5 and prefills b [0, 7)
    model.forward_step(StepBatch.build([StepRequest(a[:5], 0, [6, 2])], 4), kv)
    batch = StepBatch.build([StepRequest(a[5:], 5, [6, 2]), StepRequest(b, 0, [0, 5])], 4)
    logits = model.forward_step(batch, kv)
    assert logits.shape == (2, 97) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], dense_llama_logits(model, a)[-1], **TOL)
    torch.testing.assert_close(logits[1], dense_llama_logits(model, b)[-1], **TOL)


@pytest.mark.parametrize("order", [LAYER_MAJOR, HEAD_MAJOR])
def test_any_pool_memory_order(order: tuple[object, ...]) -> None:
    model = random_model(small_llama(), seed=3)
    kv = PagedKVCache(model.kv_layout(4, 4, order))  # type: ignore[arg-type]
    batch = StepBatch.build([StepRequest(TOKENS, 0, [3, 1, 0])], 4)
    torch.testing.assert_close(
        model.forward_step(batch, kv, all_logits=True), dense_llama_logits(model, TOKENS), **TOL
    )


def test_backends_plans_and_metrics() -> None:
    registry = MetricsRegistry()
    model = random_model(small_llama(), seed=4, metrics=registry)
    batch = StepBatch.build([StepRequest(TOKENS, 0, [0, 1, 2])], 4)
    model.forward_step(batch, model.new_kv_cache(3, 4))
    (plan,) = model.last_plans
    assert plan.backend == "gqa_torch" and plan.trace[0].candidate == "gqa_torch"
    assert model.selector.plans == 1  # planned once for both layers
    ref = random_model(small_llama(), seed=4, backend="gqa_reference")
    got = ref.forward_step(batch, ref.new_kv_cache(3, 4), all_logits=True)
    torch.testing.assert_close(got, dense_llama_logits(ref, TOKENS), **TOL)
    bad = random_model(
        small_llama(), seed=4, backend="torch", selector=Selector(default_registry())
    )
    with pytest.raises(UnsupportedError, match="'torch' cannot run"):
        bad.forward_step(batch, bad.new_kv_cache(3, 4))


def _unchanged(model: LlamaModel, kv: PagedKVCache, batch: StepBatch, words: str) -> None:
    before = kv.pool.clone()
    with pytest.raises(InvalidArgumentError, match=words):
        model.forward_step(batch, kv)
    assert torch.equal(kv.pool, before)


def test_bad_input_is_refused_before_the_pool_is_touched() -> None:
    model = random_model(small_llama())
    assert isinstance(model, LlamaModel)
    kv = model.new_kv_cache(4, 4)
    kv.pool.normal_(generator=torch.Generator().manual_seed(0))
    ok = [StepRequest([1, 2, 3], 0, [0])]
    _unchanged(model, kv, StepBatch.build([StepRequest([1, 97, 3], 0, [0])], 4),
               r"token id 97 at position 1 is outside the vocabulary \[0, 97\)")  # fmt: skip
    _unchanged(model, kv, StepBatch.build([StepRequest([1, 2], 0, [0])], 2), "block size 2, the")
    _unchanged(model, kv, StepBatch.build([StepRequest([1], 5, [0, 4])], 4), "fall outside")
    _unchanged(model, kv, StepBatch.build([StepRequest([1], 0, [9])], 4), "fall outside")
    _unchanged(model, kv, StepBatch.build([StepRequest([1], 4, [9, 0])], 4), "reads block 9")
    mla = PagedKVCache(
        KVLayout.mla(num_blocks=4, block_size=4, num_layers=2, latent_dim=8, rope_dim=4,
                     dtype=torch.float32)
    )  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="does not fit this model"):
        model.forward_step(StepBatch.build(ok, 4), mla)
    wrong_dtype = KVLayout.gqa(
        num_blocks=4, block_size=4, num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float64
    )
    half = PagedKVCache(wrong_dtype)
    with pytest.raises(InvalidArgumentError, match="does not fit this model"):
        model.forward_step(StepBatch.build(ok, 4), half)
    with pytest.raises(InvalidArgumentError, match="expected a StepBatch"):
        model.forward_step("batch", kv)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="expected a PagedKVCache"):
        model.forward_step(StepBatch.build(ok, 4), kv.pool)  # type: ignore[arg-type]


def test_decode_from_kv_written_elsewhere() -> None:
    """The PD case: a pool whose prefix KV was written by another model instance (the same
    weights in another process) is decoded from without recomputing the prefix."""
    prefill, decode = random_model(small_llama(), seed=5), random_model(small_llama(), seed=5)
    _, table, pool, kv_p = paged_prefill(prefill, TOKENS, [6, 5])
    kv_d = decode.new_kv_cache(kv_p.num_blocks, kv_p.block_size)
    kv_d.pool.copy_(kv_p.pool)  # "the transfer"
    table2 = BlockTable(RequestId("d"), 4, BlockHasher(0, kv_p.layout.fingerprint()))
    assert table2.admit(pool, [*TOKENS, 7]) is not None  # shares the cached full blocks
    assert table2.num_cached_tokens == 8
    got = decode.forward_step(StepBatch.from_tables([(table2, TokenRange(8, 12))]), kv_d)
    torch.testing.assert_close(got[0], dense_llama_logits(decode, [*TOKENS, 7])[-1], **TOL)
    table2.release(pool)
    table.release(pool)
    pool.check_integrity()


SLIDING_TWO = ("sliding_attention", "sliding_attention")
MIXED = ("full_attention", "sliding_attention")


@pytest.mark.parametrize(
    ("changes", "windows"),
    [
        ({}, (None, None)),  # Llama: no window
        ({"architecture": "MistralForCausalLM", "sliding_window": 5}, (5, 5)),  # every layer
        ({"architecture": "Qwen2ForCausalLM", "sliding_window": 5, "layer_types": SLIDING_TWO},
         (5, 5)),
        ({"architecture": "Qwen2ForCausalLM", "sliding_window": 5, "layer_types": MIXED},
         (None, 5)),
    ],
)  # fmt: skip
def test_the_kv_layout_carries_each_layers_window(
    changes: dict[str, object], windows: tuple[int | None, ...]
) -> None:
    """One window on every layer is the pool's ``sliding_window``; a mixed model's pool names
    each layer's (its full layer keeps every position, its window layer what the next step
    reads: after 12 positions, ``(12 - 5, 12]``)."""
    model = random_model(small_llama(**changes))
    layout = model.kv_layout(4, 4)
    assert tuple(layout.window_of(i) for i in range(2)) == windows
    assert layout.sliding_window == (windows[0] if len(set(windows)) == 1 else None)
    assert [layout.window_start(12, (i,)) for i in range(2)] == [
        0 if w is None else 8 for w in windows
    ]
