"""The synthetic KV: bit-exact round trips on any layout, and every misplacement is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import InvalidArgumentError
from kvplane.ids import TokenRange
from kvplane.layout import LAYER_MAJOR, KVLayout
from kvplane.serving.producers import synthetic_kv as synthetic
from kvplane.serving.producers.base import PoolTensor
from kvplane.serving.producers.synthetic_kv import SyntheticKV

KV = SyntheticKV(seed=5)


def gqa(bs: int, heads: tuple[int, int] = (0, 4), order: tuple = ()) -> KVLayout:  # type: ignore[type-arg]
    extra = {"order": order} if order else {}
    return KVLayout.gqa(
        num_blocks=16,
        block_size=bs,
        num_layers=2,
        kv_heads=4,
        head_dim=8,
        dtype=torch.float16,
        head_range=heads,
        **extra,
    )


@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, 60), length=st.integers(0, 40), bs=st.sampled_from([1, 4, 16]))
def test_write_then_check_is_exact_and_touches_nothing_else(
    start: int, length: int, bs: int
) -> None:
    lay = gqa(bs)
    pool = lay.allocate()
    tokens = np.arange(1000, 1100)
    table = [int(b) for b in np.random.default_rng(bs).permutation(16)][: -(-100 // bs)]
    if -(-(start + length) // bs) > len(table):
        return
    rng = TokenRange(start, start + length)
    KV.write(PoolTensor(lay, pool), tokens, table, rng)
    assert KV.mismatches(PoolTensor(lay, pool), tokens, table, rng) == 0
    touched = int((pool.view(torch.int16) != 0).sum())
    assert touched <= length * 2 * 2 * 4 * 8  # nothing outside the range (zeros may collide)
    assert touched >= length * 2 * 2 * 4 * 8 * 0.99


def test_same_bytes_across_block_sizes_orders_and_tp_ranges() -> None:
    tokens = np.arange(40)
    a, b = gqa(4), gqa(16, heads=(1, 3), order=LAYER_MAJOR)
    pa, pb = a.allocate(), b.allocate()
    KV.write(PoolTensor(a, pa), tokens, list(range(10)), TokenRange(0, 40))
    KV.write(PoolTensor(b, pb), tokens, [3, 5, 7], TokenRange(0, 40))
    ka, _ = a.kv_views(pa, 1)
    kb, _ = b.kv_views(pb, 1)
    # token 21: block 5 offset 1 in a; block index 1 (id 5) offset 5 in b; heads 1..3
    assert torch.equal(ka[5, 1, 1:3].view(torch.int16), kb[5, 5].view(torch.int16))


def test_misplaced_or_stale_bytes_are_counted() -> None:
    lay = gqa(4)
    pool = lay.allocate()
    tokens = np.arange(20)
    KV.write(PoolTensor(lay, pool), tokens, list(range(5)), TokenRange(0, 20))
    k, v = lay.kv_views(pool, 0)
    k[2, 3, 1, 0] = k[2, 3, 1, 1]  # one element copied from its neighbour
    v[0, 0] = v[0, 1]  # one token's V heads swapped in from the next token
    kv, table, span = PoolTensor(lay, pool), list(range(5)), TokenRange(0, 20)
    assert KV.mismatches(kv, tokens, table, span) == 1 + 4 * 8
    assert KV.mismatches(kv, tokens[::-1].copy(), table, span) > 0


def test_state_and_first_token_depend_on_every_token_and_its_position() -> None:
    a = KV.state_bytes(np.array([1, 2, 3]), 32)
    assert a.dtype == torch.uint8 and a.shape == (32,)
    assert not torch.equal(a, KV.state_bytes(np.array([2, 1, 3]), 32))
    assert KV.first_token(np.array([1, 2, 3]), 100) == KV.first_token(np.array([1, 2, 3]), 100)
    with pytest.raises(InvalidArgumentError, match="cannot hold"):
        KV.write(PoolTensor(gqa(4), gqa(4).allocate()), np.arange(100), [0, 1], TokenRange(0, 9))


@pytest.mark.parametrize(
    "lay",
    [
        KVLayout.mla(num_blocks=8, block_size=4, num_layers=3, latent_dim=8, rope_dim=4),
        KVLayout.gqa(
            num_blocks=8, block_size=4, num_layers=2, kv_heads=2, head_dim=6, dtype=torch.float32
        ),
        KVLayout.gqa(
            num_blocks=8, block_size=4, num_layers=2, kv_heads=2, head_dim=3, dtype=torch.bfloat16
        ),  # rows of 6 bytes: the element path
        gqa(4, order=LAYER_MAJOR),
    ],
)
def test_whole_blocks_hold_exactly_the_values(lay: KVLayout) -> None:
    """The write's word-wide whole-block path gives the same elements as ``values``."""
    pool = lay.allocate()
    tokens = np.arange(500, 530)
    table = [6, 1, 4, 0, 7, 2, 5, 3]
    KV.write(PoolTensor(lay, pool), tokens, table, TokenRange(2, 30))
    want = KV.values(lay, tokens[2:30], np.arange(2, 30))  # [T, L, C, H, D]
    canon = lay.canonical_view(pool)  # [B, L, C, Tb, H, D]
    ints = {2: torch.int16, 4: torch.int32}[lay.element_size]
    for t in range(2, 30):
        got = canon[table[t // 4], :, :, t % 4]
        assert torch.equal(got.view(ints), want[t - 2].view(ints)), t
    assert KV.mismatches(PoolTensor(lay, pool), tokens, table, TokenRange(2, 30)) == 0


def test_each_wrong_element_counts_once_in_whole_and_partial_blocks() -> None:
    """bf16 MLA elements pack four to a word: the fast word compare must still count elements."""
    lay = KVLayout.mla(num_blocks=6, block_size=4, num_layers=2, latent_dim=8, rope_dim=4)
    pool = lay.allocate()
    tokens = np.arange(100, 118)
    table = [5, 0, 3, 1, 4]  # tokens 0..17: four whole blocks, then two tokens of block 4
    KV.write(PoolTensor(lay, pool), tokens, table, TokenRange(0, 18))
    assert KV.mismatches(PoolTensor(lay, pool), tokens, table, TokenRange(0, 18)) == 0
    words = lay.canonical_view(pool).view(torch.int16)  # [B, L, C, Tb, H, D]
    words[3, 1, 0, 2, 0, 0:3] ^= 1  # three elements of one 8-byte word (token 10, layer 1)
    words[5, 0, 0, 0, 0, 11] ^= 1  # the last element of token 0
    words[4, 0, 0, 1, 0, 5] ^= 1  # token 17, in the partial last block
    assert KV.mismatches(PoolTensor(lay, pool), tokens, table, TokenRange(0, 18)) == 5
    assert (
        KV.mismatches(PoolTensor(lay, pool), tokens, table, TokenRange(4, 8)) == 0
    )  # block 0 untouched
    words[2, 0, 0, 0, 0, 0] ^= 1  # a block outside the table: not looked at
    assert KV.mismatches(PoolTensor(lay, pool), tokens, table, TokenRange(0, 18)) == 5


@pytest.mark.parametrize("run_min", [1, 1 << 30], ids=["one-op-per-run", "chunked-scatter"])
def test_runs_of_blocks_are_written_and_checked_in_chunks(monkeypatch, run_min: int) -> None:
    """Runs of consecutive ids are one XOR straight into the pool when they are long enough,
    else go chunk by chunk through a scatter; the check walks either way in chunks."""
    monkeypatch.setattr(synthetic, "CHUNK_BYTES", 1)  # one block per chunk
    monkeypatch.setattr(synthetic, "RUN_MIN_BYTES", run_min)
    lay = KVLayout.mla(num_blocks=12, block_size=4, num_layers=2, latent_dim=8, rope_dim=4)
    pool = lay.allocate()
    tokens = np.arange(300, 330)
    table = [2, 3, 4, 5, 9, 10, 0, 1]  # runs 2..5, 9..10, 0..1; tokens 28..29 in block 1
    KV.write(PoolTensor(lay, pool), tokens, table, TokenRange(1, 30))
    want = KV.values(lay, tokens[1:30], np.arange(1, 30))
    canon = lay.canonical_view(pool)
    for t in range(1, 30):
        got = canon[table[t // 4], :, :, t % 4].view(torch.int16)
        assert torch.equal(got, want[t - 1].view(torch.int16)), t
    assert torch.count_nonzero(canon[[6, 7, 8, 11]].view(torch.int16)) == 0  # untouched
    assert KV.mismatches(PoolTensor(lay, pool), tokens, table, TokenRange(1, 30)) == 0
    words = canon.view(torch.int16)
    words[4, 0, 0, 3, 0, 1] ^= 1  # token 11 (third block of the first run)
    words[10, 1, 0, 0, 0, 7] ^= 1  # token 20 (second run)
    assert KV.mismatches(PoolTensor(lay, pool), tokens, table, TokenRange(1, 30)) == 2
