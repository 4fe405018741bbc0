"""A prompt with more chunks than the host tier has slots: its leading chunks are stored, the
rest counted (stats and ``/metrics``) and logged once -- never silently nothing."""

from __future__ import annotations

import logging

import pytest
import torch

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.ids import RequestId
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.offload import OffloadConfig
from kvplane.serving.prefix_offload import PrefixOffload, PrefixSettings, StoreFinished
from kvplane.serving.producers.base import PoolTensor

BS, BPC, HOST = 4, 2, 2


def test_a_prompt_larger_than_the_host_tier_stores_its_lead_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = BlockPool(64, BS)
    layout = KVLayout.gqa(num_blocks=64, block_size=BS, num_layers=2, kv_heads=2, head_dim=8,
                          dtype=torch.float32)  # fmt: skip
    kv = PoolTensor(layout, torch.randn(layout.shape, generator=torch.Generator().manual_seed(0)))
    metrics = MetricsRegistry()
    config = OffloadConfig(host_slots=HOST, admission_min_lookups=0, pin_memory=False)
    off = PrefixOffload(PrefixSettings(config, BPC), kv, pool, metrics=metrics)
    hasher = BlockHasher(seed=1, fingerprint=b"m")
    try:
        with caplog.at_level(logging.WARNING, logger="kvplane.serving.prefix_offload"):
            for rid, start in (("a", 0), ("b", 1000)):
                table = BlockTable(RequestId(rid), BS, hasher)
                assert table.admit(pool, list(range(start, start + 6 * BPC * BS + 1))) is not None
                assert off.store(RequestId(rid), table) == HOST  # 6 chunks, 2 slots
                events = []
                while off.busy:
                    events += off.wait(1.0)
                assert events == [StoreFinished(RequestId(rid), HOST)]
                table.release(pool)
        assert off.snapshot()["offload_chunks_unstored"] == 2 * (6 - HOST)
        assert metrics.value("prefill_prefix_chunks_unstored", suffix="_total") == 8
        told = [r for r in caplog.records if "exceeds the host tier" in r.getMessage()]
        assert len(told) == 1  # logged once, counted every time
        off.check_integrity()
    finally:
        off.close()
