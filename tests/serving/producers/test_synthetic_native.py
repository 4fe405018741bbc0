"""The synthetic producer's C whole-block write: the broadcast XOR exactly, or no write at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplane.ids import TokenRange
from kvplane.layout import KVLayout
from kvplane.native import KernelBuild
from kvplane.serving.producers import synthetic_native
from kvplane.serving.producers.base import PoolTensor
from kvplane.serving.producers.synthetic_kv import SyntheticKV
from kvplane.serving.producers.synthetic_native import kernel, xor_blocks

needs_kernel = pytest.mark.skipif(
    kernel().library is None, reason="needs a C compiler to build the synthetic KV kernel"
)


def _factors(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``row [n, 1, 1, Tb, 1, 1]`` and ``cols [1, L, C, 1, H, X]`` for ``dst`` ``shape``."""
    n, layers, comps, tokens, heads, width = shape
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(-(2**62), 2**62, (n, 1, 1, tokens, 1, 1), generator=g)
    cols = torch.randint(-(2**62), 2**62, (1, layers, comps, 1, heads, width), generator=g)
    return row, cols


@needs_kernel
@pytest.mark.parametrize("width", [1, 3, 4, 7, 144])
@pytest.mark.parametrize("offset", [0, 1, 3])  # words: 32-byte aligned or not
def test_words_equal_the_broadcast_xor_and_nothing_else_is_written(width, offset):
    shape = (3, 5, 2, 4, 2, width)
    row, cols = _factors(shape, seed=width + offset)
    size = int(np.prod(shape))
    backing = torch.full((size + offset + 5,), 7, dtype=torch.int64)
    dst = backing[offset : offset + size].view(shape)
    assert xor_blocks(dst, row, cols)
    assert torch.equal(dst, row ^ cols)
    assert torch.all(backing[:offset] == 7) and torch.all(backing[offset + size :] == 7)


@needs_kernel
def test_tensors_it_cannot_take_are_left_to_the_caller():
    row, cols = _factors((2, 3, 1, 4, 1, 8), seed=1)
    dst = torch.zeros(2, 3, 1, 4, 1, 8, dtype=torch.int64)
    wide = torch.zeros(2, 3, 1, 4, 1, 16, dtype=torch.int64)
    assert not xor_blocks(wide[..., ::2], row, cols)  # strided
    assert not xor_blocks(dst.view(torch.int32), row, cols)  # not words
    assert not xor_blocks(dst, row[:1], cols)  # block counts differ
    assert not xor_blocks(dst, row, cols[:, :2])  # layer counts differ
    assert not xor_blocks(dst.view(2, 3, 4, 8), row, cols)  # not the six axes
    assert not dst.any()
    assert xor_blocks(dst[:0], row[:0], cols)  # no blocks: nothing to do


def test_no_compiler_leaves_the_write_to_torch(monkeypatch):
    monkeypatch.setattr(synthetic_native, "kernel", lambda: KernelBuild(None, "no C compiler"))
    row, cols = _factors((1, 1, 1, 2, 1, 4), seed=2)
    dst = torch.zeros(1, 1, 1, 2, 1, 4, dtype=torch.int64)
    assert not xor_blocks(dst, row, cols) and not dst.any()


@pytest.mark.parametrize("path", ["native", "torch"])
def test_both_paths_write_the_same_pool_bytes(monkeypatch, path):
    """A DeepSeek-shaped step (bf16 MLA, words of four elements) over runs of blocks."""
    if path == "torch":
        monkeypatch.setattr(synthetic_native, "kernel", lambda: KernelBuild(None, "disabled"))
    elif kernel().library is None:
        pytest.skip("needs a C compiler to build the synthetic KV kernel")
    lay = KVLayout.mla(num_blocks=12, block_size=16, num_layers=3)
    pool = lay.allocate()
    kv, tokens = SyntheticKV(seed=9), np.arange(7000, 7160)
    table = [4, 5, 6, 7, 0, 1, 2, 3, 10, 11]
    kv.write(PoolTensor(lay, pool), tokens, table, TokenRange(3, 150))
    assert kv.mismatches(PoolTensor(lay, pool), tokens, table, TokenRange(3, 150)) == 0
    want = kv.values(lay, tokens[3:150], np.arange(3, 150)).view(torch.int16)
    canon = lay.canonical_view(pool).view(torch.int16)
    for t in (3, 15, 16, 80, 149):
        assert torch.equal(canon[table[t // 16], :, :, t % 16], want[t - 3]), t
    assert not canon[[8, 9]].any()  # blocks outside the table stay untouched
