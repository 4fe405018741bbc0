"""Shared fixtures of the blocks tests (snapshots for before/after comparisons)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvplane.blocks import BlockPool, BlockTable
from kvplane.ids import BlockId


def pool_state(pool: BlockPool) -> tuple[Any, ...]:
    """Everything observable about a pool, for before/after comparisons."""
    ids = [BlockId(b) for b in range(pool.num_blocks)]
    return (
        tuple(pool.free_queue_order()),
        tuple(pool.ref_count(b) for b in ids),
        tuple(pool.block_hash(b) for b in ids),
        pool.num_free_blocks,
        pool.num_used_blocks,
        pool.num_cached_blocks,
    )


def table_state(table: BlockTable) -> tuple[Any, ...]:
    """Everything observable about a block table, for before/after comparisons."""
    return (
        table.state,
        tuple(int(t) for t in table.token_ids),
        table.block_ids,
        table.block_hashes,
        table.num_tokens,
        table.cached_range,
        table.computed_range,
        table.new_range,
    )


@pytest.fixture
def snap_pool() -> Callable[[BlockPool], tuple[Any, ...]]:
    return pool_state


@pytest.fixture
def snap_table() -> Callable[[BlockTable], tuple[Any, ...]]:
    return table_state
