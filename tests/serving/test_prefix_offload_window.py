"""Prefix offload of a window-only model (every layer slides over ``W`` positions): a hit needs
only the chunks inside its window, so only those are loaded; the chunks before it stay unloaded
and are never stored from the request's blocks; a hit wholly before its window (window 1) is a
hit with nothing loaded. Exact chunk counts and bytes, a lower tier's larger chunks (the skip
rounds down to them), a hybrid's state (no skip: the state comes with a load; without it a
miss), and the PD runs of ``tiny-swa`` and its window-1 checkpoint token-exact (#33)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.ids import RequestId
from kvplane.layout import KVLayout
from kvplane.models.loader import save_checkpoint, tiny_config
from kvplane.offload import OffloadConfig
from kvplane.serving.prefix_offload import (
    LoadFinished,
    LoadStarted,
    PrefixOffload,
    PrefixSettings,
)
from kvplane.serving.producers.base import PoolTensor
from kvplane.serving.producers.model import ModelSpec

BS, BPC, WINDOW = 4, 2, 12
TPC = BS * BPC


def _offload(
    pool: BlockPool, window: int | None, **config: object
) -> tuple[PrefixOffload, torch.Tensor]:
    """A prefix offload of a 2-layer pool of ``window`` (random bytes), and the pool."""
    layout = KVLayout.gqa(num_blocks=pool.num_blocks, block_size=BS, num_layers=2, kv_heads=2,
                          head_dim=8, dtype=torch.float32, sliding_window=window)  # fmt: skip
    kv = PoolTensor(layout, torch.randn(layout.shape, generator=torch.Generator().manual_seed(0)))
    settings = OffloadConfig(host_slots=8, admission_min_lookups=0, pin_memory=False, **config)  # type: ignore[arg-type]
    return PrefixOffload(PrefixSettings(settings, BPC), kv, pool), kv.tensor


def _drain(off: PrefixOffload) -> list[object]:
    events: list[object] = []
    while off.busy or off.loading:
        events += off.wait(1.0)
    return events


def _table(pool: BlockPool, rid: str, tokens: list[int]) -> BlockTable:
    table = BlockTable(RequestId(rid), BS, BlockHasher(seed=7, fingerprint=b"m"))
    assert table.admit(pool, tokens) is not None
    return table


def _chunks(kv: torch.Tensor, table: BlockTable, chunks: range) -> list[torch.Tensor]:
    """The bytes of ``table``'s chunks (block-major pool: a block is ``kv[block]``)."""
    return [kv[list(table.block_ids[c * BPC : (c + 1) * BPC])].clone() for c in chunks]


def _store_and_load(
    off: PrefixOffload, pool: BlockPool, kv: torch.Tensor, prompt: list[int], n: int
) -> tuple[LoadStarted, LoadFinished, BlockTable, list[torch.Tensor]]:
    """Store ``prompt``'s chunks, wipe the device pool, then load them back for a prompt of
    ``n`` tokens that extends it; also returns the stored chunks' bytes."""
    first = _table(pool, "a", prompt)
    want = _chunks(kv, first, range(len(prompt) // TPC))
    assert off.store(RequestId("a"), first) == len(prompt) // TPC
    _drain(off)
    first.release(pool)
    kv.zero_()
    again = _table(pool, "b", prompt + list(range(1, 1 + n - len(prompt))))
    started = off.begin_load(RequestId("b"), again)
    assert started is not None
    (done,) = [e for e in _drain(off) if isinstance(e, LoadFinished)]
    return started, done, again, want


@pytest.mark.parametrize(
    ("window", "skipped"), [(WINDOW, 3), (None, 0), (3 * TPC, 2), (5 * TPC, 0), (2, 4), (1, 5)]
)
def test_a_hit_loads_only_the_chunks_inside_its_window(window: int | None, skipped: int) -> None:
    """40 stored tokens (5 chunks of 8) and a 49-token prompt: the hit is 40 tokens; with
    window 12 the step at 40 reads from 29 on, inside chunk 3, so chunks 3 and 4 load and 0-2
    stay empty; with window 1 the step reads from 40 on: a hit of 40 tokens, nothing loaded."""
    pool = BlockPool(32, BS)
    off, kv = _offload(pool, window)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 500, 40)]
    started, done, table, want = _store_and_load(off, pool, kv, prompt, 49)
    loaded = 5 - skipped
    assert (started.chunks, done.chunks, done.tokens) == (loaded, loaded, 40)
    assert off.counts.get("chunks_skipped_window", 0) == skipped
    assert dict(off.hits) == ({"host": loaded} if loaded else {})
    got = _chunks(kv, table, range(5))
    for c in range(5):
        assert torch.equal(got[c], want[c] if c >= skipped else torch.zeros_like(want[c])), c
    # the finished request's store asks for none of its unfilled chunks (6 full chunks: the
    # skipped ones are left out; of the rest only chunk 5 is new to the host tier)
    assert off.store(RequestId("b"), table) == 6 - skipped
    _drain(off)
    assert off.counts["chunks_stored"] == 5 + 1
    table.release(pool)
    off.check_integrity()
    off.close()


def test_the_skip_rounds_down_to_a_lower_tiers_larger_chunks(tmp_path: Path) -> None:
    """A disk tier of 2-host-chunk chunks: the 3 chunks before the window round down to 2, so
    the load starts where a disk chunk starts (its keys and pieces stay aligned)."""
    pool = BlockPool(32, BS)
    off, kv = _offload(pool, WINDOW, disk_path=tmp_path / "disk", disk_slots=8,
                       disk_blocks_per_chunk=2 * BPC, disk_direct_io=False)  # fmt: skip
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 500, 40)]
    started, done, table, want = _store_and_load(off, pool, kv, prompt, 49)
    assert (started.chunks, done.tokens, off.counts["chunks_skipped_window"]) == (3, 40, 2)
    got = _chunks(kv, table, range(5))
    assert all(torch.equal(got[c], want[c]) for c in range(2, 5))
    table.release(pool)
    _drain(off)
    off.check_integrity()
    off.close()


@pytest.mark.parametrize("with_state", [True, False])
def test_a_window_1_hybrid_loads_its_kv_with_its_state_or_misses(with_state: bool) -> None:
    """A window-1 KV pool beside a state pool: no layer reads the hit's KV again, but the state
    comes with a load, so all 5 chunks load (no skip) and the state after chunk 5 is restored;
    with no state kept the KV hit is a miss."""
    pool = BlockPool(32, BS)
    layout = KVLayout.gqa(num_blocks=32, block_size=BS, num_layers=2, kv_heads=2, head_dim=8,
                          dtype=torch.float32, sliding_window=1)  # fmt: skip
    kv = torch.randn(layout.shape, generator=torch.Generator().manual_seed(0))
    st_layout = KVLayout.state(num_slots=4, num_layers=1, state_dim=8)
    state = PoolTensor(st_layout, st_layout.allocate())
    config = OffloadConfig(host_slots=8, admission_min_lookups=0, pin_memory=False)
    off = PrefixOffload(PrefixSettings(config, BPC), PoolTensor(layout, kv), pool, state=state)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 500, 40)]
    first = _table(pool, "a", prompt)
    for chunk in range(1, 6) if with_state else ():
        state.tensor.fill_(float(chunk))  # the state after ``chunk`` chunks
        assert off.keep_state(first, 0, chunk * TPC)
    want = _chunks(kv, first, range(5))
    assert off.store(RequestId("a"), first) == 5
    _drain(off)
    first.release(pool)
    kv.zero_()
    state.tensor.zero_()
    table = _table(pool, "b", prompt + list(range(1, 10)))
    started = off.begin_load(RequestId("b"), table, state_slot=1)
    if with_state:
        assert started is not None and started.chunks == 5
        (done,) = [e for e in _drain(off) if isinstance(e, LoadFinished)]
        assert (done.chunks, done.tokens) == (5, 40)
        assert torch.equal(state.tensor[1], torch.full_like(state.tensor[1], 5.0))
        assert not state.tensor[[0, 2, 3]].any()  # slot 1 only
        got = _chunks(kv, table, range(5))
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    else:
        assert started is None
        assert off.counts["chunks_without_state"] == 5
    assert off.counts.get("chunks_skipped_window", 0) == 0
    table.release(pool)
    off.check_integrity()
    off.close()


@pytest.fixture(params=[16, 1], ids=["window16", "window1"])
def swa_cluster(
    request: pytest.FixtureRequest, tmp_path: Path, offload_cluster: Callable[..., Any]
) -> Any:
    """``tiny-swa`` (window 16, or its window-1 checkpoint) prefill (host prefix offload,
    chunks of 2 blocks of 16) and decode workers behind a router."""
    spec = ModelSpec("tiny-swa", seed=3)
    if request.param != 16:
        config = dataclasses.replace(tiny_config("tiny-swa"), sliding_window=request.param)
        spec = ModelSpec(str(save_checkpoint(config, tmp_path / "swa", seed=3)))
    return offload_cluster(spec)


def test_pd_of_a_window_model_loads_only_the_window_and_is_token_exact(
    swa_cluster: Any,
) -> None:
    """``tiny-swa`` (window 16, chunks of 32 tokens): a 101-token prompt after a 98-token one
    hits 3 chunks and loads only the last (the hit's window is positions 81-95), token-exact.
    With window 1 the step at 96 reads nothing before it: the 96-token hit loads no chunk."""
    counters = swa_cluster.shared_prefix(vocab=1024)
    loaded = 0 if swa_cluster.spec.source != "tiny-swa" else 1
    assert counters["offload_hit_chunks_host"] == loaded
    assert counters["offload_chunks_skipped_window"] == 3 - loaded
    assert counters["offload_chunks_stored"] == 3
    assert swa_cluster.prefill.metrics.value("prefill_prefix_tokens", suffix="_total") == 96
